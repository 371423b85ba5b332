"""Press API and KV-cache eviction (prunelab.inference) on tiny random models."""

import math

import pytest
import torch
from transformers import DynamicCache

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.perplexity import final_hidden, score_windows
from prunelab.inference import (
    H2O,
    PRESSES,
    TOVA,
    EntroPrefill,
    ExpectedAttention,
    KNorm,
    LazyLLM,
    ScoreInputs,
    SnapKV,
    StreamingLLM,
    cache_bytes,
    press,
    press_for,
)
from prunelab.inference.kv import keep_indices
from prunelab.models.loading import wrap
from prunelab.registry import to_dict

from tiny_models import tiny_model, tiny_tokens

NOOPS = [StreamingLLM(ratio=0.0), H2O(ratio=0.0), SnapKV(ratio=0.0, window=4),
         TOVA(ratio=0.0, every=1), KNorm(ratio=0.0), ExpectedAttention(ratio=0.0),
         LazyLLM(ratio=0.0), EntroPrefill(max_ratio=0.0)]


def _lm(arch="llama", impl=None):
    m = tiny_model(arch)
    if impl:
        m.config._attn_implementation = impl
    return wrap(m)


def _generate(m, ids, n=5):
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                     do_sample=False, output_logits=True, return_dict_in_generate=True,
                     pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def test_configs_validate_and_round_trip():
    for name in PRESSES.names():
        cfg = PRESSES.make(name)
        assert PRESSES.from_dict(to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="ratio"):
        SnapKV(ratio=1.5)
    with pytest.raises(ConfigError, match="kernel"):
        SnapKV(kernel=4)
    with pytest.raises(ConfigError, match="mass_bound"):
        EntroPrefill(mass_bound=float("nan"))
    with pytest.raises(ConfigError, match="no option"):
        PRESSES.make("h2o", window=3)


@pytest.mark.parametrize("arch,impl", [("llama", None), ("qwen3", None),
                                       ("gemma3_text", None), ("llama", "sdpa")])
@pytest.mark.parametrize("cfg", NOOPS, ids=lambda c: type(c).__name__)
def test_ratio_zero_reproduces_plain_model_exactly(arch, impl, cfg):
    if arch == "gemma3_text" and cfg.kind == "prefill":
        pytest.skip("prefill pruning refuses sliding-window models (tested below)")
    lm = _lm(arch, impl)
    ids = tiny_tokens(2, 20)
    seq, logits = _generate(lm.model, ids)
    with press(lm, cfg):
        seq_p, logits_p = _generate(lm.model, ids)
        hidden_p = final_hidden(lm, ids)
    assert torch.equal(seq, seq_p)
    assert torch.equal(logits, logits_p)
    assert torch.equal(hidden_p, final_hidden(lm, ids))


def test_model_restored_exactly_on_exit_even_after_an_error():
    lm = _lm()
    ids = tiny_tokens(1, 16)
    before = dict(lm.model.model.__dict__)
    impl = lm.model.config._attn_implementation
    ref = lm.model(ids).logits
    with pytest.raises(RuntimeError, match="boom"):
        with press(lm, LazyLLM(ratio=0.5)):
            lm.model(ids)
            raise RuntimeError("boom")
    assert lm.model.model.__dict__.keys() == before.keys()
    assert lm.model.config._attn_implementation == impl
    assert all(not blk._forward_hooks and not blk._forward_pre_hooks
               for blk in lm.adapter.blocks())
    assert torch.equal(lm.model(ids).logits, ref)


@pytest.mark.parametrize("cfg", [StreamingLLM(ratio=0.5, sinks=2), H2O(ratio=0.5),
                                 SnapKV(ratio=0.5, window=4, kernel=3)],
                         ids=lambda c: type(c).__name__)
def test_cache_tensors_really_shrink(cfg):
    lm = _lm()
    ids = tiny_tokens(2, 20)
    full = lm.model(ids, use_cache=True).cache
    with press(lm, cfg) as s:
        cache = lm.model(ids, use_cache=True).cache
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (2, 2, 10, 8)
        assert tuple(layer.values.shape) == (2, 2, 10, 8)
        assert layer.keys.is_contiguous()
    assert cache_bytes(cache) * 2 == cache_bytes(full)
    assert s.report["kept"] == 10 and s.report["cache_bytes"] == cache_bytes(cache)


def test_gemma3_evicts_full_attention_layers_only():
    lm = _lm("gemma3_text")
    ids = tiny_tokens(1, 20)
    with press(lm, SnapKV(ratio=0.5, window=4)):
        cache = lm.model(ids, use_cache=True).cache
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    assert lengths[2] == 10  # the full-attention block
    assert all(n != 10 for i, n in enumerate(lengths) if i != 2)  # sliding windows intact


def test_decode_positions_continue_from_the_original_length():
    """Reference by hand: the plain model's full cache with the same entries removed, then
    the next tokens at explicit positions L, L+1 (not the shrunken cache length)."""
    lm = _lm()
    ids = tiny_tokens(1, 20)
    nxt = tiny_tokens(1, 2, seed=5)
    cfg = StreamingLLM(ratio=0.5, sinks=3)
    with press(lm, cfg):
        out = lm.model(ids, use_cache=True)
        step = lm.model(nxt, cache=out.cache, use_cache=True)
    keep = torch.cat([torch.arange(3), torch.arange(13, 20)])
    cache = DynamicCache(config=lm.model.config)
    lm.model(ids, cache=cache, use_cache=True)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
    ref = lm.model(nxt, cache=cache, use_cache=True, position_ids=torch.tensor([[20, 21]]))
    assert torch.allclose(step.logits, ref.logits, atol=1e-6)
    for layer in cache.layers:  # control: the shrunken length would give other logits
        layer.keys, layer.values = layer.keys[:, :, :10], layer.values[:, :, :10]
    wrong = lm.model(nxt, cache=cache, use_cache=True, position_ids=torch.tensor([[10, 11]]))
    assert not torch.allclose(step.logits, wrong.logits, atol=1e-3)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma", "gemma2", "phi3", "gpt2",
                                  "gpt_neox", "gemma3_text"])
def test_eviction_table_matches_hand_built_cache_with_explicit_positions(arch):
    """SnapKV on every causal family: the next tokens equal the plain model run on the
    plain cache with the press's kept entries and explicit original positions."""
    m = tiny_model(arch)
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 3, seed=4)
    with press(m, SnapKV(ratio=0.5, window=4)) as s:
        out = m(ids, use_cache=True)
        step = m(nxt, cache=out.cache, use_cache=True)
    assert s.report["keep"] and all(i.shape[-1] == 10 for i in s.report["keep"].values())
    cache = DynamicCache(config=m.config)
    m(ids, cache=cache, use_cache=True)
    for i, idx in s.report["keep"].items():
        layer = cache.layers[i]
        g = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
    ref = m(nxt, cache=cache, use_cache=True, position_ids=torch.tensor([[20, 21, 22]]))
    assert torch.allclose(step.logits, ref.logits, atol=1e-5)


def test_generate_with_eviction_matches_hand_built_reference():
    lm = _lm()
    ids = tiny_tokens(1, 20)
    with press(lm, StreamingLLM(ratio=0.5, sinks=3)):
        seq = lm.model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    keep = torch.cat([torch.arange(3), torch.arange(13, 20)])
    cache = DynamicCache(config=lm.model.config)
    logits = lm.model(ids, cache=cache, use_cache=True).logits
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
    tokens = [logits[:, -1].argmax(-1)]
    for t in range(3):
        step = lm.model(tokens[-1][:, None], cache=cache, use_cache=True,
                        position_ids=torch.tensor([[20 + t]]))
        tokens.append(step.logits[:, -1].argmax(-1))
    assert torch.equal(seq[:, 20:], torch.stack(tokens, 1))


def test_snapkv_keeps_window_and_top_pooled_scores():
    """Independent scores from the plain model's attention weights (eager)."""
    lm = _lm()
    ids = tiny_tokens(1, 20)
    att = lm.model(ids, output_attentions=True).attentions
    cfg = SnapKV(ratio=0.5, window=4, kernel=1)
    with press(lm, cfg) as s:
        lm.model(ids, use_cache=True)
    for layer, idx in s.report["keep"].items():
        score = att[layer][:, :, -4:].sum(2).view(1, 2, 2, 20).mean(2)  # [B, G, L]
        for g in range(2):
            want = set(range(16, 20)) | set(score[0, g, :16].topk(6).indices.tolist())
            assert set(idx[0, g].tolist()) == want


def test_keep_indices_hand_cases():
    sc = torch.tensor([[[5.0, 1.0, 4.0, 0.0, 3.0, 2.0]]])
    keys = torch.zeros(1, 1, 6, 2)
    streaming = StreamingLLM(sinks=1).score(ScoreInputs(keys, keys, keys, 1.0))
    assert streaming.tolist() == [[[6.0, 1.0, 2.0, 3.0, 4.0, 5.0]]]  # sinks, then recency
    assert keep_indices(StreamingLLM(sinks=1), 6, 3, streaming, 1, 1, "cpu").tolist() == \
        [[[0, 4, 5]]]
    assert keep_indices(StreamingLLM(sinks=4), 6, 3, StreamingLLM(sinks=4).score(
        ScoreInputs(keys, keys, keys, 1.0)), 1, 1, "cpu").tolist() == [[[0, 1, 2]]]
    assert keep_indices(SnapKV(window=2, kernel=1), 6, 3, sc, 1, 1, "cpu").tolist() == \
        [[[0, 4, 5]]]
    assert keep_indices(H2O(recent=0.0), 6, 3, sc, 1, 1, "cpu").tolist() == [[[0, 2, 4]]]


@pytest.mark.parametrize("cfg", [StreamingLLM(ratio=0.5, sinks=2, every=2),
                                 H2O(ratio=0.5, every=2), TOVA(ratio=0.5, every=2)],
                         ids=lambda c: type(c).__name__)
def test_decode_time_eviction_keeps_the_budget(cfg):
    lm = _lm()
    ids = tiny_tokens(1, 16)
    with press(lm, cfg) as s:
        cache = lm.model(ids, use_cache=True).cache
        token = ids[:, -1:]
        lengths = []
        for _ in range(4):
            lm.model(token, cache=cache, use_cache=True)
            lengths.append(cache.layers[0].keys.shape[2])
        assert s.seen == 20
    assert lengths == [9, 8, 9, 8]


def test_evaluator_under_a_press():
    lm = _lm()
    ids = tiny_tokens(2, 16)
    plain = final_hidden(lm, ids)
    with press(lm, SnapKV(ratio=0.5, window=2), context=0.5):
        hidden = final_hidden(lm, ids)
        res = score_windows(lm, ids)
    assert hidden.shape == plain.shape
    assert torch.allclose(hidden[:, :8], plain[:, :8], atol=1e-5)  # prefill runs in full
    assert not torch.allclose(hidden[:, 8:], plain[:, 8:], atol=1e-4)
    assert math.isfinite(res["perplexity"])


def test_refusals():
    lm = _lm()
    ids = tiny_tokens(2, 8)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with press(lm, SnapKV(ratio=0.5, window=2)):
        with pytest.raises(UnsupportedOperationError, match="padded"):
            lm.model(ids, attention_mask=mask, use_cache=True)
    with pytest.raises(UnsupportedOperationError, match="layer 9"):
        with press(lm, LazyLLM(layer=9)):
            pass
    with pytest.raises(UnsupportedOperationError, match="full-attention"):
        with press(_lm("gemma3_text"), EntroPrefill()):
            pass
    with pytest.raises(UnsupportedOperationError, match="opt is not supported"):
        with press(_lm("opt"), SnapKV()):
            pass
    with pytest.raises(UnsupportedOperationError, match="gpt2"):
        with press(_lm("gpt2"), LazyLLM()):
            pass
    with press(lm, SnapKV()):
        with pytest.raises(UnsupportedOperationError, match="already active"):
            with press(lm, H2O()):
                pass
        lm.model(ids, use_cache=True)  # the outer press still works
    assert "forward" not in lm.model.model.__dict__


def test_press_for_maps_the_cli_ratio():
    assert press_for("snapkv", 0.25) == SnapKV(ratio=0.25)
    assert press_for("entroprefill", 0.5, mass_bound=0.1) == \
        EntroPrefill(max_ratio=0.5, mass_bound=0.1)
    with pytest.raises(ConfigError, match="unknown press"):
        press_for("nope", 0.5)


def test_cache_filled_outside_the_press_continues_at_its_length():
    m = tiny_model("llama")
    ids, nxt = tiny_tokens(1, 12), tiny_tokens(1, 1, seed=7)
    cache = m(ids, use_cache=True).cache
    ref = m(nxt, cache=cache, use_cache=True).logits
    cache.crop(-1)
    with press(m, H2O(ratio=0.5)):  # a bare HF model is wrapped
        out = m(nxt, cache=cache, use_cache=True).logits
    assert torch.equal(out, ref)


def test_press_for_takes_the_ratio_as_an_option_too():
    """``ratio`` among the options was a TypeError ("multiple values for argument")."""
    assert press_for("snapkv", ratio=0.5) == SnapKV(ratio=0.5)
    assert press_for("snapkv", None, ratio=0.5) == SnapKV(ratio=0.5)
    with pytest.raises(ConfigError, match="give the ratio once"):
        press_for("snapkv", 0.25, ratio=0.5)


def test_a_context_of_zero_is_refused():
    with pytest.raises(ConfigError, match="context must be > 0"):
        with press(_lm(), SnapKV(ratio=0.5), context=0.0):
            pass
