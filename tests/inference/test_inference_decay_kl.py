"""The blended decay press (SnapKV + learned decay prior + recency) fitted end-to-end by
the continuation KL, on tiny random models."""

import dataclasses

import pytest
import torch

from prunelab.errors import ConfigError
from prunelab.eval.divergence import kl_from_logits
from prunelab.eval.perplexity import final_hidden
from prunelab.inference import H2O, PRESSES, DecayEviction, SnapKV, press
from prunelab.inference.decay_kl import KLCalibration, coordinate_search, fit_decay_kl
from prunelab.models.loading import wrap
from prunelab.registry import to_dict

from tiny_models import tiny_model, tiny_tokens


def test_coordinate_search_reproduces_a_known_optimum():
    # separable hand-built objective: layer l's optimum (a_l, b_l) lies on the grid, layer 3
    # is not searched (not evictable); each layer its own block, one round suffices
    a = torch.tensor([0.5, 0.0, 1.0, 0.25, 0.25], dtype=torch.float64)
    b = torch.tensor([2.0, 0.25, 0.0, 1.0, 0.5], dtype=torch.float64)
    layers = [0, 1, 2, 4]
    calls = []

    def objective(p):
        calls.append(p.clone())
        return float(((p[:, 0] - a) ** 2 + (p[:, 1] - b) ** 2).sum()) + 1.0

    grid = (0.0, 0.25, 0.5, 1.0, 2.0)
    params, start, best = coordinate_search(objective, layers, 5, grid, grid, blocks=4,
                                            rounds=1)
    want = torch.stack([a, b], 1)
    want[3] = 0.0
    assert torch.equal(params, want)
    assert start == pytest.approx(1.0 + float((a ** 2 + b ** 2).sum()))
    assert best == pytest.approx(1.0 + 0.25 ** 2 + 1.0 ** 2)  # layer 3 stays at zero
    assert all(bool((c[3] == 0).all()) for c in calls)
    # a shared optimum is found by the shared grid alone
    shared, _, best = coordinate_search(
        lambda p: float(((p[:2] - torch.tensor([1.0, 0.5])) ** 2).sum()), [0, 1], 2, blocks=1)
    assert torch.equal(shared, torch.tensor([[1.0, 0.5], [1.0, 0.5]], dtype=torch.float64))
    assert best == 0.0


def test_zero_blend_evicts_exactly_as_snapkv():
    m = tiny_model("llama")
    lm = wrap(m)
    ids = tiny_tokens(1, 30, seed=4)
    n = 4
    cfg = DecayEviction(ratio=0.6, window=5, observe=5, kernel=3, blend=(0.0,) * (2 * n))
    with press(lm, cfg) as s:
        m(ids, use_cache=True)
    with press(lm, SnapKV(ratio=0.6, window=5, kernel=3)) as r:
        m(ids, use_cache=True)
    assert s.report["keep"].keys() == r.report["keep"].keys()
    for i in s.report["keep"]:
        assert torch.equal(s.report["keep"][i], r.report["keep"][i])


def test_blend_recency_weight_turns_it_into_a_recent_window():
    # a huge rho: the recency term dominates, so every head keeps the most recent tokens
    m = tiny_model("llama")
    lm = wrap(m)
    cfg = DecayEviction(ratio=0.5, window=2, observe=2, blend=(0.0, 1e6) * 4)
    with press(lm, cfg) as s:
        cache = m(tiny_tokens(1, 20), use_cache=True).cache
    assert all(layer.keys.shape == (1, 2, 10, 8) for layer in cache.layers)
    for idx in s.report["keep"].values():
        assert torch.equal(idx, torch.arange(10, 20).expand(1, 2, 10))


@torch.no_grad()
def test_fit_is_consistent_with_the_real_press_and_not_worse_than_snapkv_on_calibration():
    m = tiny_model("llama")
    lm = wrap(m)
    calib = tiny_tokens(3, 28, seed=7)
    kl = KLCalibration(lm, calib, horizon=6, observe=4, kernel=3)
    assert len(kl.prior) == 4 * 2 * 5 and kl.layers == [0, 1, 2, 3]
    cfg = kl.fit(0.75, blocks=2)
    hist = kl.history[0.75]
    assert cfg.blend is not None and len(cfg.blend) == 8 and cfg.window == 4
    assert hist["kl_fitted"] <= hist["kl_snapkv"]
    assert PRESSES.from_dict(to_dict(cfg)) == cfg
    # the fast objective (cached prompt, copied cache) equals the real press path: prefill
    # the 22-token prompt under the press, then the 6 continuation tokens on its cache
    for c, want in ((cfg, hist["kl_fitted"]), (kl.config(0.75), hist["kl_snapkv"])):
        total = 0.0
        for row in calib.split(1):
            ref = lm.adapter.logits(final_hidden(lm, row)[:, -6:])
            with press(lm, c, context=22.5 / 28) as s:
                got = lm.adapter.logits(final_hidden(lm, row)[:, -6:])
            assert s.report["kept"] == 22 - int(22 * 0.75)
            total += float(kl_from_logits(ref, got).mean())
        assert total / 3 == pytest.approx(want, rel=1e-4, abs=1e-7)
    # zero blend: the SnapKV objective equals the snapkv press itself
    total = 0.0
    for row in calib.split(1):
        ref = lm.adapter.logits(final_hidden(lm, row)[:, -6:])
        with press(lm, SnapKV(ratio=0.75, window=4, kernel=3), context=22.5 / 28):
            got = lm.adapter.logits(final_hidden(lm, row)[:, -6:])
        total += float(kl_from_logits(ref, got).mean())
    assert total / 3 == pytest.approx(hist["kl_snapkv"], rel=1e-4, abs=1e-7)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_fitted_blend_ratio_zero_is_exact_and_the_cache_shrinks(arch):
    m = tiny_model(arch)
    lm = wrap(m)
    cfg = fit_decay_kl(lm, tiny_tokens(2, 24, seed=1), ratio=0.5, horizon=4, observe=3,
                       kernel=1, lams=(0.0, 1.0), rhos=(0.0, 1.0), blocks=1)
    ids = tiny_tokens(2, 16)
    ref = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with press(lm, dataclasses.replace(cfg, ratio=0.0)):
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0),
                           ref)
    with press(lm, cfg) as s:
        cache = m(ids, use_cache=True).cache
    full = [i for i, layer in enumerate(cache.layers) if not getattr(layer, "is_sliding", False)]
    assert full and all(cache.layers[i].keys.shape[2] == 8 for i in full)
    assert sorted(s.report["keep"]) == full


def test_blend_config_is_validated():
    with pytest.raises(ConfigError, match="observe > 0"):
        DecayEviction(blend=(0.0, 0.0))
    with pytest.raises(ConfigError, match="multiple of 2"):
        DecayEviction(observe=4, blend=(0.0,))
    with pytest.raises(ConfigError, match="multiple of 5"):  # blend: the 5-feature prior
        DecayEviction(observe=4, blend=(0.0, 0.0), weights=(0.0,) * 6)
    with pytest.raises(ConfigError, match="too short"):
        KLCalibration(wrap(tiny_model("llama")), tiny_tokens(1, 10), horizon=5, observe=4)


def test_share_reserves_snapkv_top_tokens_before_the_blend():
    # recency dominates the blend; share 1 gives all of the budget outside the window to
    # SnapKV (so it evicts exactly as SnapKV), share 0.5 the top 6 of keep = 12, and the
    # one remaining slot goes to the most recent token not yet kept (computed independently)
    m = tiny_model("llama")
    lm = wrap(m)
    ids = tiny_tokens(1, 30, seed=4)
    cfg = dict(ratio=0.6, window=5, observe=5, kernel=3, blend=(0.0, 1e6) * 4)
    with press(lm, SnapKV(ratio=0.6, window=5, kernel=3)) as r:
        m(ids, use_cache=True)
    with press(lm, DecayEviction(**cfg, share=1.0)) as s:
        m(ids, use_cache=True)
    for i in r.report["keep"]:
        assert torch.equal(s.report["keep"][i], r.report["keep"][i])
    with press(lm, DecayEviction(**cfg, share=0.5)) as s:
        m(ids, use_cache=True)
    att = m(ids, output_attentions=True).attentions
    for i, kept in s.report["keep"].items():
        snap = torch.nn.functional.max_pool1d(att[i][0, :, -5:].sum(1)[:, None], 3, 1, 1)
        snap = snap[:, 0].view(2, 2, 30).mean(1)  # [G, 30]
        for g in range(2):
            order = torch.sort(snap[g, :25], descending=True, stable=True).indices
            top = set(order[:6].tolist())
            rest = max(set(range(25)) - top)
            assert kept[0, g].tolist() == sorted(top | {rest} | set(range(25, 30)))


def test_mix_one_with_half_recent_evicts_exactly_as_h2o():
    m = tiny_model("llama")
    lm = wrap(m)
    ids = tiny_tokens(1, 40, seed=6)
    cfg = DecayEviction(ratio=0.5, window=4, observe=4, kernel=3, blend=(0.0,) * 8,
                        recent=0.5, mix=1.0)
    with press(lm, cfg) as s:
        m(ids, use_cache=True)
    with press(lm, H2O(ratio=0.5, recent=0.5)) as r:
        m(ids, use_cache=True)
    for i in r.report["keep"]:
        assert torch.equal(s.report["keep"][i], r.report["keep"][i])


def test_fitted_share_is_chosen_from_the_grid_and_consistent():
    """``fit(shares=...)``: the share of the budget kept for SnapKV's top tokens joins the
    grid; the returned press carries it, and its real objective is the recorded KL."""
    lm = wrap(tiny_model("llama"))
    kl = KLCalibration(lm, tiny_tokens(2, 28, seed=3), horizon=6, observe=4, kernel=3)
    only = kl.fit(0.75, blocks=2, shares=(0.5,))
    assert only.share == 0.5 and kl.history[0.75]["share"] == 0.5
    assert kl.objective(only) == pytest.approx(kl.history[0.75]["kl_fitted"], rel=1e-6)
    # a one-value grid at share 0.5 scores the same configurations as a calibration
    # built with share 0.5
    fixed = KLCalibration(lm, tiny_tokens(2, 28, seed=3), horizon=6, observe=4, kernel=3,
                          share=0.5)
    assert fixed.fit(0.75, blocks=2) == only
    cfg = kl.fit(0.75, blocks=2, shares=(0.0, 0.25, 0.5, 0.75))
    hist = kl.history[0.75]
    assert cfg.share == hist["share"] in (0.0, 0.25, 0.5, 0.75)
    assert hist["kl_fitted"] <= hist["kl_snapkv"]
    assert kl.objective(cfg) == pytest.approx(hist["kl_fitted"], rel=1e-6)
    for bad in ((), (1.5,), (-0.1, 0.0)):
        with pytest.raises(ConfigError, match="share"):
            kl.fit(0.75, shares=bad)


def test_fit_reports_progress_once_per_objective_within_its_bound(monkeypatch):
    import prunelab.inference.decay_kl as dk

    made = []

    class Recording(dk.Ticker):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(dk, "Ticker", Recording)
    lm = wrap(tiny_model("llama"))
    kl = KLCalibration(lm, tiny_tokens(2, 20, seed=3), horizon=4, observe=4, kernel=3)
    calls = []
    real = kl.objective
    monkeypatch.setattr(kl, "objective", lambda cfg: calls.append(1) or real(cfg))
    kl.fit(0.5, blocks=2, shares=(0.0, 0.5))
    (ticker,) = made
    assert ticker.done == len(calls) > 0
    assert ticker.total >= len(calls)
    assert ticker.total == 1 + 2 * 3 * 3 + 5 * 5 + 2 * (5 + 5)
