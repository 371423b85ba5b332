"""Mid-prefill token pruning (LazyLLM, EntroPrefill) and the pure maths of the presses."""

import math

import pytest
import torch

from prunelab.inference import EntroPrefill, LazyLLM, press
from prunelab.inference.scores import (
    attention_rows,
    deletion_envelope,
    group_heads,
    proposed_keep,
    renyi_entropy,
    smooth,
)
from prunelab.models.loading import wrap

from tiny_models import tiny_model, tiny_tokens


def _causal(n):
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


@torch.no_grad()
def _reference_logits(m, ids, layer, keep):
    """By hand: blocks 0..layer on every token, then the kept tokens only through blocks
    layer+1.. with their original position ids, final norm and head."""
    base = m.model
    h = base.embed_tokens(ids)
    pos = torch.arange(ids.shape[1])[None]
    pe = base.rotary_emb(h, position_ids=pos)
    for blk in base.layers[:layer + 1]:
        h = blk(h, attention_mask=_causal(ids.shape[1]), position_embeddings=pe,
                position_ids=pos)
    h = h.gather(1, keep[..., None].expand(-1, -1, h.shape[-1]))
    pe = base.rotary_emb(h, position_ids=keep)
    for blk in base.layers[layer + 1:]:
        h = blk(h, attention_mask=_causal(keep.shape[1]), position_embeddings=pe,
                position_ids=keep)
    return m.lm_head(base.norm(h))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("cfg", [LazyLLM(ratio=0.5, layer=1),
                                 EntroPrefill(layer=2, mass_bound=0.6, window=3,
                                              keep_scale=0.3)],
                         ids=lambda c: type(c).__name__)
def test_kept_tokens_equal_running_the_model_on_them_with_explicit_positions(cfg, impl):
    m = tiny_model("llama")
    m.config._attn_implementation = impl
    lm = wrap(m)
    ids = tiny_tokens(2, 20)
    with press(lm, cfg) as s:
        out = m(ids, use_cache=True)
    keep = s.report["keep"]
    assert keep is not None and 0 < s.report["removed"] == 20 - keep.shape[1]
    assert out.logits.shape[1] == keep.shape[1]
    assert torch.equal(keep[:, -1], torch.tensor([19, 19]))  # the last token stays
    ref = _reference_logits(m, ids, cfg.layer, keep)
    assert torch.allclose(out.logits, ref, atol=1e-5)
    assert all(layer.keys.shape[2] == keep.shape[1] for layer in out.cache.layers)


def test_lazyllm_removes_the_least_attended_by_the_last_token():
    m = tiny_model("llama")
    lm = wrap(m)
    ids = tiny_tokens(1, 20)
    att = m(ids, output_attentions=True).attentions[1][0, :, -1].mean(0)  # [L]
    with press(lm, LazyLLM(ratio=0.25, layer=1)) as s:
        m(ids, use_cache=True)
    removed = sorted(set(range(20)) - set(s.report["keep"][0].tolist()))
    assert removed == sorted(att[:19].topk(5, largest=False).indices.tolist())


@pytest.mark.parametrize("bound", [0.05, 0.2, 0.5])
def test_entroprefill_mass_bound_holds_on_every_head(bound):
    """Discarded mass recomputed from the plain model's attention weights."""
    m = tiny_model("llama", seed=1)
    lm = wrap(m)
    ids = tiny_tokens(2, 24, seed=2)
    cfg = EntroPrefill(layer=1, mass_bound=bound, window=4, keep_scale=0.0, max_ratio=0.9)
    att = m(ids, output_attentions=True).attentions[1]  # [B, H, L, L]
    head_mass = att[:, :, -4:].double().mean(2)  # [B, H, L]
    with press(lm, cfg) as s:
        m(ids, use_cache=True)
    keep = s.report["keep"]
    dropped = torch.ones(2, 24, dtype=torch.bool)
    if keep is not None:
        dropped.scatter_(1, keep, False)
    else:
        dropped[:] = False
    mass = (head_mass * dropped[:, None]).sum(-1)  # [B, H]
    assert (mass <= bound + 1e-9).all()
    assert torch.allclose(mass, s.report["discarded_mass"], atol=1e-6)
    assert not dropped[:, 0].any() and not dropped[:, -4:].any()  # sink and observers
    assert s.report["removed"] == int(dropped[0].sum())
    if bound >= 0.2:
        assert s.report["removed"] > 0
    # the removal is the envelope (keep_scale 0 proposes the max_ratio cap)
    assert s.report["removed"] == min(min(s.report["envelope"]), 21)


def test_evaluator_with_prefill_pruning_runs_and_keeps_the_shape():
    from prunelab.eval.perplexity import final_hidden, score_windows
    m = tiny_model("llama")
    lm = wrap(m)
    ids = tiny_tokens(2, 16)
    plain = final_hidden(lm, ids)
    with press(lm, LazyLLM(ratio=0.5, layer=1), context=0.5):
        hidden = final_hidden(lm, ids)
        res = score_windows(lm, ids)
    assert hidden.shape == plain.shape
    assert not torch.allclose(hidden[:, 8:], plain[:, 8:], atol=1e-4)
    assert math.isfinite(res["perplexity"])


# ---------------------------------------------------------------- pure maths
def test_deletion_envelope_hand_case():
    # two heads; removal order 3, 1, 2: cumulative masses h0: .125 .375 .875,
    # h1: .25 .3125 .375 (dyadic, exact in floating point)
    mass = torch.tensor([[[0.0, 0.25, 0.5, 0.125], [0.0, 0.0625, 0.0625, 0.25]]])
    order = torch.tensor([[3, 1, 2]])
    assert deletion_envelope(mass, order, 0.25).tolist() == [1]
    assert deletion_envelope(mass, order, 0.375).tolist() == [2]
    assert deletion_envelope(mass, order, 0.875).tolist() == [3]
    assert deletion_envelope(mass, order, 0.1).tolist() == [0]


def test_renyi_entropy_and_proposal():
    uniform = torch.full((1, 8), 0.125)
    assert torch.allclose(renyi_entropy(uniform, 2.0), torch.tensor([math.log(8)]).double())
    peaked = torch.tensor([[1.0, 0, 0, 0]])
    assert renyi_entropy(peaked, 2.0).item() == pytest.approx(0.0)
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])  # H2 = log 2: two effective tokens
    assert proposed_keep(p, 2.0, 1.0).tolist() == [2]
    assert proposed_keep(p, 0.5, 1.5).tolist() == [3]


def test_attention_rows_match_softmax_with_causal_mask():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 8, generator=g)
    k = torch.randn(1, 2, 6, 8, generator=g)
    rows = attention_rows(q, k, 0.35, 3, chunk=2)
    kk = k.repeat_interleave(2, 1)
    full = (q @ kk.transpose(-1, -2) * 0.35 + _causal(6)).softmax(-1)
    assert torch.allclose(rows, full[:, :, -3:], atol=1e-6)


def test_pooling_hand_cases():
    s = torch.tensor([[[1.0, 3.0], [2.0, 0.0], [4.0, 4.0], [0.0, 2.0]]])  # [1, 4, 2]
    assert group_heads(s, 2, 0.0).tolist() == [[[1.5, 1.5], [2.0, 3.0]]]
    assert group_heads(s, 2, 1.0).tolist() == [[[2.0, 3.0], [4.0, 4.0]]]
    x = torch.tensor([[[0.0, 5.0, 0.0, 0.0, 1.0]]])
    assert smooth(x, 3, "max").tolist() == [[[5.0, 5.0, 5.0, 1.0, 1.0]]]


@pytest.mark.parametrize("stability,layer", [(0.0, 1), (1.0, 3)])
def test_adaptive_layer_is_the_first_stable_block_and_keeps_positions(stability, layer):
    """Stability 0: every ranking is 'stable', the cut happens at block 1; stability 1 on
    a random model (removal sets differ between blocks): only at the last allowed block."""
    m = tiny_model("llama")
    lm = wrap(m)
    ids = tiny_tokens(2, 20)
    cfg = EntroPrefill(layer=3, adaptive=True, stability=stability, mass_bound=0.6,
                       window=3, keep_scale=0.3)
    with press(lm, cfg) as s:
        out = m(ids, use_cache=True)
    assert s.report["layer"] == layer and s.report["removed"] > 0
    ref = _reference_logits(m, ids, layer, s.report["keep"])
    assert torch.allclose(out.logits, ref, atol=1e-5)


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt_neox"])
def test_prefill_pruning_table_generates_on_the_shortened_cache(arch):
    m = tiny_model(arch)
    ids = tiny_tokens(2, 20)
    with press(m, LazyLLM(ratio=0.5, layer=1)) as s:
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert s.report["kept"] == 10 and out.sequences.shape == (2, 23)
    assert all(layer.keys.shape[2] == 12 for layer in out.past_key_values.layers)
