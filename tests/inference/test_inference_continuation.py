"""A press judged on its continuation (the tokens scored on the pressed cache), and a
pressed cache continued outside its press (refused, or right positions inside a press)."""

import math

import pytest
import torch
from transformers import DynamicCache

from prunelab import api
from prunelab.data.batches import TokenBatches
from prunelab.errors import ConfigError, PressedCacheError
from prunelab.eval.divergence import kl_from_logits, token_nll, top1_agreement
from prunelab.eval.perplexity import final_hidden, score_windows
from prunelab.inference import H2O, LazyLLM, SnapKV, StreamingLLM, press
from prunelab.models.loading import wrap

from tiny_models import tiny_model, tiny_tokens

T, C = 24, 8  # window, continuation: the press compresses the first 16 tokens


def _lm(seed=0):
    return wrap(tiny_model("llama", seed=seed))


def _batches(ids):
    n, t = ids.shape
    return TokenBatches(ids, spec="tiny", seqlen=t, samples=n, seed=0, mode="test",
                        total_windows=n, sha256="")


@pytest.mark.parametrize("cfg", [SnapKV(ratio=0.0, window=2), StreamingLLM(ratio=0.0),
                                 LazyLLM(ratio=0.0)], ids=lambda c: type(c).__name__)
def test_a_press_keeping_everything_has_the_dense_continuation(cfg):
    lm, ref = _lm(), _lm()  # the reference: the same weights, another instance
    ids = tiny_tokens(3, T)
    dense = score_windows(lm, ids, reference=ref, continuation=C)
    with press(lm, cfg, continuation=C):
        got = score_windows(lm, ids, reference=ref, continuation=C)
    assert got["continuation_kl_to_reference"] == 0.0
    assert got["continuation_top1_agreement"] == 1.0
    assert got["continuation_perplexity"] == dense["continuation_perplexity"]
    assert got["continuation_tokens"] == 3 * (C - 1) and got["continuation"] == C


def test_continuation_figures_are_a_hand_built_pressed_cache():
    """StreamingLLM (sinks 2) on the first 16 tokens keeps 0, 1 and 10..15; the 8 tokens
    after them run on that cache at positions 16..23. KL, top-1 and the perplexity of the
    continuation are those positions' figures, computed here by hand from the plain model;
    the whole-window figures average over every position."""
    lm, ref = _lm(), _lm(seed=1)
    ids = tiny_tokens(2, T)
    with press(lm, StreamingLLM(ratio=0.5, sinks=2), continuation=C):
        got = score_windows(lm, ids, reference=ref, continuation=C)
    keep = torch.tensor([0, 1, *range(10, 16)])
    kl = agree = nll = 0.0
    kl_all = 0.0
    for row in range(2):
        x = ids[row:row + 1]
        cache = DynamicCache(config=lm.model.config)
        with torch.no_grad():
            first = lm.model(x[:, :16], cache=cache, use_cache=True).logits
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            rest = lm.model(x[:, 16:], cache=cache, use_cache=True,
                            position_ids=torch.arange(16, T)[None]).logits
            ref_logits = ref.model(x).logits
        k = kl_from_logits(ref_logits[:, 16:], rest)
        kl += float(k.sum())
        agree += float(top1_agreement(ref_logits[:, 16:], rest).sum())
        nll += float(token_nll(rest, x[:, 16:]).sum())  # tokens 17..23
        kl_all += float(k.sum() + kl_from_logits(ref_logits[:, :16], first).sum())
    assert got["continuation_kl_to_reference"] == pytest.approx(kl / (2 * C), rel=1e-5)
    assert got["continuation_top1_agreement"] == agree / (2 * C)
    assert got["continuation_perplexity"] == pytest.approx(math.exp(nll / (2 * (C - 1))),
                                                           rel=1e-5)
    assert got["kl_to_reference"] == pytest.approx(kl_all / (2 * T), rel=1e-5)
    assert got["continuation_kl_to_reference"] != pytest.approx(got["kl_to_reference"])


def test_a_kv_press_leaves_the_prompt_positions_alone():
    """The prefill runs in full, so against the dense model itself all the KL of the
    window is in the continuation: whole-window KL x T = continuation KL x C, i.e. the
    whole-window figure reads T / C times smaller."""
    lm, ref = _lm(), _lm()
    ids = tiny_tokens(2, T)
    with press(lm, SnapKV(ratio=0.5, window=2), continuation=C):
        got = score_windows(lm, ids, reference=ref, continuation=C)
    assert got["continuation_kl_to_reference"] > 0
    assert got["kl_to_reference"] * T == pytest.approx(got["continuation_kl_to_reference"] * C,
                                                       rel=1e-4)


def test_api_evaluate_takes_the_continuation_from_the_active_press():
    lm, ref = _lm(), _lm()
    data = _batches(tiny_tokens(2, T))
    plain = api.evaluate(lm, data=data, reference=ref)
    assert "continuation" not in plain
    with press(lm, H2O(ratio=0.5), context=0.75):  # prompt 18 of 24: continuation 6
        got = api.evaluate(lm, data=data, reference=ref)
        with pytest.raises(ConfigError, match="differs from the 6 tokens"):
            api.evaluate(lm, data=data, reference=ref, continuation=8)
    assert got["continuation"] == 6 and got["continuation_tokens"] == 2 * 5
    dense = api.evaluate(lm, data=data, reference=ref, continuation=6)
    assert dense["continuation_kl_to_reference"] == 0.0
    assert got["continuation_perplexity"] != dense["continuation_perplexity"]
    with pytest.raises(ConfigError, match="does not fit a window of 24 tokens"):
        api.evaluate(lm, data=data, continuation=24)


def test_continuation_and_context_are_one_split():
    lm = _lm()
    with pytest.raises(ConfigError, match="not both"):
        with press(lm, SnapKV(), context=0.5, continuation=4):
            pass
    with pytest.raises(ConfigError, match="continuation must be"):
        with press(lm, SnapKV(), continuation=0):
            pass
    with press(lm, SnapKV(ratio=0.5), continuation=30):  # longer than the window
        with pytest.raises(ConfigError, match="does not fit a window of 24"):
            final_hidden(lm, tiny_tokens(1, T))
    for bad in (1, T, 2.5):
        with pytest.raises(ConfigError, match="does not fit"):
            score_windows(lm, tiny_tokens(1, T), continuation=bad)


def _prefill_and_next(lm, cfg, ids, nxt):
    with torch.no_grad(), press(lm, cfg):
        cache = lm.model(ids, use_cache=True).cache
        inside = lm.model(nxt, cache=cache, use_cache=True).logits
        kept = lm.model(ids, use_cache=True).cache  # a second cache, continued later
    return inside, kept


@pytest.mark.parametrize("cfg", [StreamingLLM(ratio=0.5, sinks=2), SnapKV(ratio=0.5, window=2),
                                 LazyLLM(ratio=0.5, layer=1)], ids=lambda c: type(c).__name__)
def test_a_pressed_cache_outside_its_press(cfg):
    """Reproduction first: the plain model on the pressed cache, with the positions it
    derives from the shrunken length, gives other logits than the press (which numbers
    the new tokens from the tokens seen). Outside a press the cache refuses in one line;
    inside a new press (any press) it continues at the right positions."""
    lm = _lm()
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 3, seed=4)
    inside, kept = _prefill_and_next(lm, cfg, ids, nxt)
    assert kept.get_seq_length() < 20 and kept.prunelab_seen == 20
    plain = DynamicCache(config=lm.model.config)  # the same entries, unguarded
    with torch.no_grad():
        lm.model(ids[:, :1], cache=plain, use_cache=True)  # creates the layers
        for src, dst in zip(kept.layers, plain.layers, strict=True):
            dst.keys, dst.values = src.keys.clone(), src.values.clone()
        wrong = lm.model(nxt, cache=plain, use_cache=True).logits  # positions from length
    assert not torch.allclose(wrong, inside, atol=1e-4)  # (b): silently wrong
    with pytest.raises(PressedCacheError) as err:
        lm.model(nxt, cache=kept, use_cache=True)
    msg = str(err.value)
    assert "\n" not in msg and "20 tokens seen" in msg and "with press(...)" in msg
    assert kept.get_seq_length() < 20  # the refused forward changed nothing
    with torch.no_grad(), press(lm, H2O(ratio=0.5)):
        again = lm.model(nxt, cache=kept, use_cache=True).logits
    assert torch.equal(again, inside) and kept.prunelab_seen == 23


def test_caches_interleaved_in_one_session_keep_their_positions():
    lm = _lm()
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 3, seed=4)
    cfg = StreamingLLM(ratio=0.5, sinks=2)
    with torch.no_grad(), press(lm, cfg):
        a = lm.model(ids, use_cache=True).cache
        b = lm.model(ids, use_cache=True).cache
        on_a = lm.model(nxt, cache=a, use_cache=True).logits  # a is not the latest cache
        on_b = lm.model(nxt, cache=b, use_cache=True).logits
    assert torch.equal(on_a, on_b)


def test_an_uncompressed_cache_stays_a_plain_cache():
    lm = _lm()
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 3, seed=4)
    with torch.no_grad():
        with press(lm, SnapKV(ratio=0.0)):
            cache = lm.model(ids, use_cache=True).cache
        assert type(cache) is DynamicCache
        ref = lm.model(torch.cat([ids, nxt], 1)).logits[:, 20:]
        out = lm.model(nxt, cache=cache, use_cache=True).logits
    assert torch.allclose(out, ref, atol=1e-5)


def test_a_cache_first_shrunk_while_decoding_is_guarded_too():
    """A 1-token prompt keeps its token; decode-time eviction then shrinks the cache, which
    from then on refuses to be continued outside a press."""
    lm = _lm()
    ids, nxt = tiny_tokens(1, 1), tiny_tokens(1, 1, seed=4)
    with torch.no_grad(), press(lm, StreamingLLM(ratio=0.5, sinks=0, every=1)):
        cache = lm.model(ids, use_cache=True).cache
        assert type(cache) is DynamicCache
        lm.model(nxt, cache=cache, use_cache=True)
    assert cache.get_seq_length() == 1 and cache.prunelab_seen == 2
    with pytest.raises(PressedCacheError, match="2 tokens seen"):
        lm.model(nxt, cache=cache, use_cache=True)
