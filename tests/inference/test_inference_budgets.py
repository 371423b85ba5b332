"""AdaKV (head-wise budgets) and PyramidKV (layer-wise budgets) over a scoring press:
hand-computed selections and schedules, the per-head mask, ratio 0, the total kept entries
against the plain press, and the padded cache against the full cache masked in place."""

import pytest
import torch
from transformers import DynamicCache

from prunelab.errors import ConfigError
from prunelab.inference import (
    PRESSES,
    TOVA,
    AdaKV,
    KNorm,
    PyramidKV,
    SnapKV,
    StreamingLLM,
    press,
)
from prunelab.inference.budgets import adakv_keep, layer_mask, pyramid_budgets

from tiny_models import tiny_model, tiny_tokens


def test_registered_with_their_defaults_and_scorer_options():
    assert PRESSES.make("adakv") == AdaKV(ratio=0.5, scorer="snapkv", alpha_safeguard=0.2)
    assert SnapKV() == SnapKV(ratio=0.5, window=64, kernel=5, pooling="max")
    assert PRESSES.make("adakv").base == SnapKV(ratio=0.5)
    # PyramidKV's SnapKV window: half the floor unless given (the smallest blocks keep
    # `floor` entries; a window of `floor` would leave them nothing to choose)
    assert PRESSES.make("pyramidkv").base == SnapKV(ratio=0.5, window=32)
    assert PyramidKV(floor=16).base.window == 8
    assert PyramidKV(floor=512).base.window == 64
    assert PyramidKV(scorer_options=("window=64", "pooling=mean")).base == \
        SnapKV(ratio=0.5, window=64, pooling="mean")
    cfg = AdaKV(ratio=0.3, scorer_options=("window=16", "kernel=7", "pooling=mean"))
    assert cfg.base == SnapKV(ratio=0.3, window=16, kernel=7, pooling="mean")
    assert PyramidKV(scorer="knorm", ratio=0.25).base == KNorm(ratio=0.25)
    # any KV press that scores can be the scorer; a prefill press or a wrapper cannot
    assert AdaKV(scorer="streaming-llm", scorer_options=("sinks=2",)).base == \
        StreamingLLM(ratio=0.5, sinks=2)
    for bad, msg in ((dict(scorer="lazyllm"), "scorer must be one of"),
                     (dict(scorer="adakv"), "scorer must be one of"),
                     (dict(scorer="nope"), "streaming-llm, h2o, snapkv, tova, knorm, decay, "
                                             "expected-attention \\(a KV press"),
                     (dict(scorer_options=("windw=3",)), "windw"),
                     (dict(scorer_options=("ratio=0.2",)), "the ratio is the wrapper"),
                     (dict(scorer="tova", scorer_options=("every=1",)), "every must be 0"),
                     (dict(scorer_options=("window",)), "KEY=VALUE"),
                     (dict(alpha_safeguard=1.5), "alpha_safeguard")):
        with pytest.raises(ConfigError, match=msg):
            AdaKV(**bad)
    with pytest.raises(ConfigError, match="beta"):
        PyramidKV(beta=0.5)


def test_recipes_round_trip_the_wrappers():
    """A recipe stores a press as its fields (the scorer by name and options): reading it
    back gives the same wrapper, scorer included."""
    from prunelab.registry import to_dict

    for cfg in (AdaKV(ratio=0.4, scorer="h2o", scorer_options=("recent=0.25",),
                      alpha_safeguard=0.5),
                PyramidKV(ratio=0.6, beta=4.0, floor=8, scorer_options=("window=16",))):
        d = to_dict(cfg)
        assert d["name"] == cfg.registry_name and isinstance(d["scorer_options"], list)
        back = PRESSES.from_dict(d)
        assert back == cfg and back.base == cfg.base


def test_adakv_selection_by_hand():
    scores = torch.tensor([[[0.9, 0.8, 0.7, 0.6, 0.1, 0.0],
                            [0.05, 0.2, 0.02, 0.01, 0.03, 0.5]]])
    # keep 3 per head = 6 in all; safeguard int(3 * 0.34) = 1: head 1 keeps its top (token
    # 5) in any case; the other 5 by global score: 0.9 0.8 0.7 0.6 (head 0), 0.2 (head 1)
    idx, holes = adakv_keep(scores, 3, None, 0.34)
    assert idx.tolist() == [[[0, 1, 2, 3], [1, 5, 0, 0]]]
    assert holes.tolist() == [[[False] * 4, [False, False, True, True]]]
    # safeguard 1.0: every head keeps its own top 3 (the uniform selection, no holes)
    idx, holes = adakv_keep(scores, 3, None, 1.0)
    assert idx.tolist() == [[[0, 1, 2], [0, 1, 5]]] and not holes.any()
    # safeguard 0: the global top 6 only; head 1 keeps tokens 1 and 5
    idx, holes = adakv_keep(scores, 3, None, 0.0)
    assert idx.tolist() == [[[0, 1, 2, 3], [1, 5, 0, 0]]]
    # a fixed token (SnapKV's window: the last one) ranks first in every head and fills the
    # safeguard of 1; head 1 then keeps nothing else
    fixed = torch.tensor([False] * 5 + [True])
    idx, holes = adakv_keep(scores, 3, fixed, 0.34)
    assert idx.tolist() == [[[0, 1, 2, 3, 5], [5, 0, 0, 0, 0]]]
    assert holes.sum().item() == 4


def test_pyramid_budgets_by_hand():
    # L 100, keep 50, floor 10: hi = 97.5 >= 90 -> hi 90, lo 10; linear over 5 blocks
    assert pyramid_budgets(100, 50, 5, 20, 10) == [90, 70, 50, 30, 10]
    # 4 blocks: 90, 63.33, 36.67, 10 -> floors 199, one more to the largest remainder
    assert pyramid_budgets(100, 50, 4, 20, 10) == [90, 63, 37, 10]
    # no clamp: lo = 100 / 4 = 25, hi = 175
    assert pyramid_budgets(1000, 100, 3, 4, 10) == [175, 100, 25]
    # floor 60: hi = 40 < lo = 60, no pyramid: the uniform budget (kvpress' fallback)
    assert pyramid_budgets(100, 50, 4, 20, 60) == [50] * 4
    # the measured setting: SmolLM2-135M, 1,024-token prompt, ratio 0.5, kvpress' defaults
    b = pyramid_budgets(1024, 512, 30, 20, 64)
    assert b[0] == 960 and b[-1] == 64 and sum(b) == 30 * 512
    assert all(x >= y for x, y in zip(b, b[1:], strict=False))


def test_layer_mask_by_hand():
    cache = DynamicCache()
    cache.prunelab_heads = {0: torch.tensor([[[False, False, True], [False, False, False]]]),
                            1: None}
    q, k = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 5, 8)  # 4 query heads, 2 KV heads
    got = layer_mask(cache, 0, q, k, None, "sdpa")
    causal = [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # query i of 2 sees keys <= 3 + i
    hole = [[1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]  # KV head 0's entry 2 is a hole
    want = torch.tensor([[hole, hole, causal, causal]], dtype=torch.bool)
    assert torch.equal(got, want)
    eager = layer_mask(cache, 0, q, k, None, "eager")
    assert torch.equal(eager == 0, want) and eager.min() == torch.finfo(torch.float32).min
    assert torch.equal(layer_mask(cache, 1, q, k, None, "sdpa"), torch.tensor(
        [[causal]], dtype=torch.bool).expand(1, 1, 2, 5))
    assert layer_mask(cache, 2, q, k, "given", "sdpa") == "given"  # not a pressed block


@pytest.mark.parametrize("cfg", [AdaKV(ratio=0.0), PyramidKV(ratio=0.0, floor=2)],
                         ids=lambda c: type(c).__name__)
def test_ratio_zero_is_the_plain_model(cfg):
    m = tiny_model("llama")
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 3, seed=4)
    with torch.no_grad():
        plain = m(ids, use_cache=True)
        ref = m(nxt, cache=plain.cache, use_cache=True).logits
        with press(m, cfg) as s:
            out = m(ids, use_cache=True)
            step = m(nxt, cache=out.cache, use_cache=True).logits
    assert torch.equal(out.logits, plain.logits) and torch.allclose(step, ref, atol=1e-6)
    assert out.cache.get_seq_length() == 23 and not s.report["keep"]


def _pressed(m, cfg, ids):
    with torch.no_grad(), press(m, cfg) as s:
        cache = m(ids, use_cache=True).cache
    return s, cache


@pytest.mark.parametrize("scorer,options", [("snapkv", ("window=4",)), ("knorm", ()),
                                            ("tova", ())])
def test_total_kept_entries_equal_the_plain_press(scorer, options):
    """Per block (AdaKV) and over the blocks (PyramidKV), the entries kept equal the plain
    press' ``G x keep``; AdaKV's heads differ, PyramidKV's blocks decrease."""
    m = tiny_model("llama")
    ids = tiny_tokens(1, 40)
    plain = PRESSES.make(scorer, ratio=0.5, **({"window": 4} if scorer == "snapkv" else {}))
    s0, c0 = _pressed(m, plain, ids)
    per_block = 2 * 20  # 2 KV heads x 20 tokens
    assert [layer.keys.shape[2] for layer in c0.layers] == [20] * 4
    s1, c1 = _pressed(m, AdaKV(ratio=0.5, scorer=scorer, scorer_options=options), ids)
    assert s1.report["entries"] == 4 * per_block
    for i, layer in enumerate(c1.layers):
        holes = c1.prunelab_heads[i]
        n = 2 * layer.keys.shape[2] - (int(holes.sum()) if holes is not None else 0)
        assert n == per_block
    s2, c2 = _pressed(m, PyramidKV(ratio=0.5, floor=4, scorer=scorer, scorer_options=options),
                      ids)
    lengths = [layer.keys.shape[2] for layer in c2.layers]
    assert lengths == pyramid_budgets(40, 20, 4, 20.0, 4) == [36, 25, 15, 4]
    assert s2.report["entries"] == 2 * sum(lengths) == 4 * per_block


def test_adakv_with_full_safeguard_is_the_plain_press():
    m = tiny_model("llama")
    ids, nxt = tiny_tokens(1, 30), tiny_tokens(1, 3, seed=4)
    out = {}
    for cfg in (SnapKV(ratio=0.5, window=4),
                AdaKV(ratio=0.5, alpha_safeguard=1.0, scorer_options=("window=4",))):
        with torch.no_grad(), press(m, cfg) as s:
            cache = m(ids, use_cache=True).cache
            out[type(cfg)] = (m(nxt, cache=cache, use_cache=True).logits, s.report["keep"])
    (a, ka), (b, kb) = out.values()
    assert torch.equal(a, b) and all(torch.equal(ka[i], kb[i]) for i in ka)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "expected-attention"])
def test_adakv_padded_cache_equals_the_full_cache_masked_in_place(impl, scorer):
    """kvpress' way as the reference: the plain model's full cache with each head's evicted
    entries masked (original positions); prunelab's padded cache gives the same next
    tokens (3 at once: causal in the padded layout), and its holes are never read."""
    m = tiny_model("llama")
    m.config._attn_implementation = impl
    ids, nxt = tiny_tokens(1, 30), tiny_tokens(1, 3, seed=4)
    cfg = AdaKV(ratio=0.6, alpha_safeguard=0.1, scorer=scorer,
                scorer_options=("window=4",) if scorer == "snapkv" else ("sinks=2",)
                if scorer == "expected-attention" else ())
    with torch.no_grad(), press(m, cfg) as s:
        cache = m(ids, use_cache=True).cache
        for layer, holes in cache.prunelab_heads.items():  # garbage in the holes
            if holes is not None:
                cache.layers[layer].keys[holes] = 1e4
                cache.layers[layer].values[holes] = 1e4
        step = m(nxt, cache=cache, use_cache=True).logits
    heads = cache.prunelab_heads
    assert any(h is not None and h.any() for h in heads.values())  # heads really differ
    full = DynamicCache(config=m.config)
    with torch.no_grad():
        m(ids, cache=full, use_cache=True)
    full.prunelab_heads = {}
    for layer, idx in s.report["keep"].items():
        evicted = torch.ones(1, 2, 30, dtype=torch.bool)
        holes = heads[layer] if heads[layer] is not None else torch.zeros_like(idx, dtype=bool)
        for g in range(2):
            evicted[0, g, idx[0, g][~holes[0, g]]] = False
        full.prunelab_heads[layer] = evicted
    with torch.no_grad(), press(m, AdaKV(ratio=0.0)):  # masks only; positions from 30
        ref = m(nxt, cache=full, use_cache=True).logits
    assert torch.allclose(step, ref, atol=1e-5)


def test_pyramid_multi_token_step_equals_the_full_cache_masked_in_place():
    """Blocks of different lengths (the model's one mask, sized by block 0, fits none of
    the others): 3 new tokens at once equal the plain model's full cache with each block's
    evicted entries masked at their original positions."""
    m = tiny_model("llama")
    ids, nxt = tiny_tokens(1, 40), tiny_tokens(1, 3, seed=4)
    cfg = PyramidKV(ratio=0.5, floor=4, scorer_options=("window=4",))
    with torch.no_grad(), press(m, cfg) as s:
        cache = m(ids, use_cache=True).cache
        step = m(nxt, cache=cache, use_cache=True).logits
    assert [i.shape[-1] for i in s.report["keep"].values()] == [36, 25, 15, 4]
    full = DynamicCache(config=m.config)
    with torch.no_grad():
        m(ids, cache=full, use_cache=True)
    full.prunelab_heads = {}
    for i, idx in s.report["keep"].items():
        evicted = torch.ones(1, 2, 40, dtype=torch.bool)
        evicted.scatter_(2, idx, False)
        full.prunelab_heads[i] = evicted
    with torch.no_grad(), press(m, AdaKV(ratio=0.0)):  # masks only; positions from 40
        ref = m(nxt, cache=full, use_cache=True).logits
    assert torch.allclose(step, ref, atol=1e-5)


def test_evaluator_continuation_under_both_wrappers():
    """The evaluator's split (prefill pressed, continuation on the pressed cache) runs under
    both wrappers with the reported budget, and TOVA as a scorer works the same way."""
    m = tiny_model("llama")
    ids = tiny_tokens(2, 24)
    for cfg in (AdaKV(ratio=0.5, scorer="tova"), PyramidKV(ratio=0.5, floor=2)):
        with torch.no_grad(), press(m, cfg, continuation=8) as s:
            out = m(ids, use_cache=False).logits
        assert out.shape == (2, 24, 131) and torch.isfinite(out).all()
        assert s.report["prompt"] == 16 and s.report["entries"] == 2 * 4 * 2 * 8
    assert isinstance(AdaKV(scorer="tova").base, TOVA)
