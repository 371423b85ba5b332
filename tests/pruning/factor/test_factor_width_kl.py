"""Per-block slicing widths from measured KL curves (``SliceGPT(widths="kl")``): the
one-group projection equals the real slice of that group, the greedy allocation is checked
by hand, and the end-to-end allocation meets the uniform budget on tiny models."""

from __future__ import annotations

import math

import pytest
import torch

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.pruning.factor import slicing
from prunelab.pruning.factor.folding import fold_norms
from prunelab.pruning.factor.slicing import SliceGPT, params_at
from prunelab.pruning.factor.width_kl import (
    allocate_for_kl,
    interpolate,
    kl_curves,
    monotone,
    sliced_group,
    width_grid,
)
from prunelab.pruning.factor.widths import params_for_widths, width_counter

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 16, seed=1)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")
TEST = tiny_tokens(2, 12, seed=5)


def _lm(arch: str, eps_zero: bool = False):
    lm = wrap(tiny_model(arch), char_tokenizer(), spec="tiny")
    if eps_zero:  # the norms' eps would differ between width d and w
        for m in lm.model.modules():
            for attr in ("variance_epsilon", "eps"):
                if isinstance(getattr(m, attr, None), float):
                    setattr(m, attr, 0.0)
    return lm


@torch.no_grad()
def _logits(model, ids=TEST) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def test_width_grid_monotone_and_interpolation_by_hand():
    assert width_grid(576, 376, 6, 8) == [512, 440, 376, 312, 240, 176]
    assert width_grid(32, 24, 2, 4) == [24, 16]  # low = 16; 32 - 8 = 24, 32 - 16 = 16
    assert width_grid(32, 32, 4, 4) == []
    m = monotone({6: 0.3, 4: 0.2, 2: 0.5}, 8)
    assert m == {8: 0.0, 6: 0.3, 4: 0.3, 2: 0.5}
    assert interpolate(m, 7) == pytest.approx(0.15)
    assert interpolate(m, 5) == pytest.approx(0.3)
    assert interpolate(m, 3) == pytest.approx(0.4)
    assert interpolate(m, 1) == math.inf


def test_greedy_kl_allocation_by_hand():
    """Group 0: 0.1 KL per unit of width (2 params per step of 2); group 1: cheap first
    step (0.1 for 4 params), then steep (0.9 for 4)."""
    curves = [{8: 0.0, 6: 0.2, 4: 0.4}, {8: 0.0, 6: 0.1, 4: 1.0}]

    def cost(ws):
        return ws[0] + 2 * ws[1]
    assert allocate_for_kl(curves, [8, 8], cost, 24, 2) == [8, 8]
    assert allocate_for_kl(curves, [8, 8], cost, 20, 2) == [8, 6]   # 0.025 < 0.1 per param
    assert allocate_for_kl(curves, [8, 8], cost, 18, 2) == [6, 6]   # 0.1 < 0.225
    assert allocate_for_kl(curves, [8, 8], cost, 16, 2) == [4, 6]
    assert allocate_for_kl(curves, [8, 8], cost, 14, 2) == [4, 4]   # group 0 at its floor
    with pytest.raises(ValueError, match="cannot be met"):
        allocate_for_kl(curves, [8, 8], cost, 11, 2)


def test_width_counter_equals_params_for_widths():
    lm = _lm("gemma3_text")
    count = width_counter(lm)
    for ws in ([32] * 5, [28, 20, 24, 16, 24], [8, 32, 8, 32, 16]):
        assert count(ws) == params_for_widths(lm, ws)
    assert count([24] * 5) == params_at(lm, 24, "per-layer")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("group", [0, 2, 4])
def test_one_group_projection_equals_the_real_slice_of_that_group(arch, group, monkeypatch):
    """Slice only ``group`` (every other width full) for real, recording the bases the
    slicing used; the dense folded model with :func:`sliced_group` and those bases gives
    the same logits (group 4 = the final norm / head)."""
    w = 20
    widths = [32] * 5
    widths[group] = w
    bases: list[torch.Tensor] = []
    real_basis = slicing._basis

    def recording(cfg, cov, fisher, width):
        q = real_basis(cfg, cov, fisher, width)
        bases.append(q)
        return q
    monkeypatch.setattr(slicing, "_basis", recording)
    monkeypatch.setattr(slicing, "_block_widths", lambda *a, **k: list(widths))
    lm = _lm(arch, eps_zero=True)
    prunelab.prune(lm, SliceGPT(ratio=0.25, multiple=4, widths="spectrum"), CALIB,
                   batch_size=2)
    sliced = _logits(lm.model)

    dense = _lm(arch, eps_zero=True)
    before = _logits(dense.model)
    fold_norms(dense)
    ks = (8,) if group == 4 else (2 * group, 2 * group + 1)
    ps = [bases[k][:, :w] @ bases[k][:, :w].t() for k in ks]
    with sliced_group(dense, group, ps):
        hooked = _logits(dense.model)
    torch.testing.assert_close(hooked, sliced, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_logits(dense.model), before, rtol=1e-5, atol=1e-5)  # unhooked
    assert (hooked - before).abs().max() > 1e-3  # the slice changed something


def test_kl_curves_are_zero_at_full_width_and_grow_as_the_width_falls():
    lm = _lm("llama")
    fold_norms(lm)
    grams = slicing.boundary_grams(lm, IDS, 2)
    curves = kl_curves(lm, grams, IDS[:2], [32, 16, 4], damping=0.01, batch_size=2)
    assert len(curves) == 5
    for c in curves:
        assert abs(c[32]) < 1e-6  # full width: the identity
        assert c[4] > c[16] > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_kl_widths_meet_the_uniform_budget_and_report_the_curves(arch):
    lm = _lm(arch)
    budget = params_at(_lm(arch), 24, "per-layer")
    rep = prunelab.prune(lm, SliceGPT(ratio=0.25, multiple=4, widths="kl", width_levels=3),
                         CALIB, batch_size=2)
    assert rep["params_after"] <= budget
    widths = rep["block_widths"]
    assert len(widths) == 5 and all(w % 4 == 0 and 16 <= w <= 32 for w in widths)
    assert len(rep["width_kl_curves"]) == 5
    assert sorted(rep["width_kl_curves"][0]) == ["16", "20", "24", "28"]  # 32 -> 2*24-32
    # the budget is used: no group can take 4 more directions within it
    count = width_counter(_lm(arch))
    assert any(count([*widths[:g], widths[g] + 4, *widths[g + 1:]]) > budget
               for g in range(5) if widths[g] < 32)


def test_kl_width_options_are_checked_in_one_line():
    for kw, text in ((dict(widths="kl", rotation="global"), "needs rotation per-layer"),
                     (dict(widths="kl", width_levels=0), "width_levels"),
                     (dict(widths="kl", width_windows=-1), "width_windows")):
        with pytest.raises(ConfigError) as err:
            SliceGPT(**kw)
        assert text in str(err.value) and "\n" not in str(err.value)


def test_basis_selection_allocates_the_widths_once(monkeypatch):
    """``basis=sensitivity`` with ``select=kl`` slices one copy per candidate basis: the
    KL curves are measured once and every candidate (and the final slice) uses them."""
    from prunelab.pruning.factor import width_kl

    calls = []
    real = width_kl.kl_curves

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(width_kl, "kl_curves", counting)
    lm = _lm("llama")
    rep = prunelab.prune(lm, SliceGPT(ratio=0.25, multiple=4, widths="kl", width_levels=2,
                                      basis="sensitivity", select_grid="0.3"),
                         CALIB, batch_size=2)
    assert len(calls) == 1 and len(rep["selection"]) == 2
    assert len(rep["width_kl_curves"]) == 5 and len(rep["block_widths"]) == 5
    assert rep["params_after"] <= params_at(_lm("llama"), 24, "per-layer")
