"""Tapered width (CascadeFormer's taper) as a width and a sparsity allocation."""

from __future__ import annotations

import pytest

import prunelab
from prunelab.data.batches import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.pruning.sparsity.config import ALLOCATIONS
from prunelab.pruning.width import WIDTH_ALLOCATIONS, Width, width_from_cli
from prunelab.pruning.width.allocation.taper import Taper, taper_fractions
from prunelab.registry import to_dict

from tiny_models import char_tokenizer, tiny_model, tiny_tokens


def test_taper_fractions_average_to_the_budget_and_follow_the_slope():
    r = taper_fractions(4, 0.5, 0.3)
    assert r == pytest.approx([0.35, 0.45, 0.55, 0.65], abs=1e-12)
    assert sum(r) / 4 == pytest.approx(0.5, abs=1e-12)
    # weighted mean with unequal block sizes, and clipping at 0 then one shift
    w = [1.0, 2.0, 1.0, 4.0]
    r = taper_fractions(4, 0.2, 0.8, w)
    assert sum(a * b for a, b in zip(r, w, strict=True)) / sum(w) == pytest.approx(0.2, abs=1e-9)
    assert r[0] == 0.0 and all(b >= a for a, b in zip(r, r[1:], strict=False)) and r[-1] > r[1]
    assert taper_fractions(5, 0.4, -0.2)[0] > taper_fractions(5, 0.4, -0.2)[-1]


def test_taper_width_pruning_keeps_narrower_blocks_deeper():
    lm = wrap(tiny_model("llama"), char_tokenizer())
    ids = tiny_tokens(2, 8)
    calib = TokenBatches(input_ids=ids, spec="tiny", seqlen=8, samples=2, seed=0,
                         mode="calib", total_windows=2, sha256="0")
    cfg = width_from_cli(unit="ffn", score="magnitude-profile", ratio=0.5,
                         allocation="taper", taper_slope=0.4, round_to=1)
    assert cfg.allocation == Taper(slope=0.4)
    assert WIDTH_ALLOCATIONS.name_of(cfg.allocation) == "taper"
    assert prunelab.pruning.METHODS.from_dict(to_dict(cfg)) == cfg
    prunelab.prune(lm, cfg, calib)
    widths = [lm.adapter.ffn_width(i) for i in range(4)]
    # removal 0.5 + 0.4 (x - 1/2): kept 48 * [0.7, 0.5667, 0.4333, 0.3]
    assert widths == [34, 27, 21, 14]
    assert sum(widths) == 96  # mean kept fraction = 1 - budget
    with pytest.raises(ConfigError):
        Width(unit="ffn", ratio=0.5, allocation=Taper(slope=2.0))
    with pytest.raises(ConfigError, match="taper-slope applies"):
        width_from_cli(unit="ffn", ratio=0.5, taper_slope=0.3)


def test_taper_sparsity_allocation_is_a_ramp():
    alloc = ALLOCATIONS.make("taper", slope=0.2)
    s = alloc.sparsities(0.5, [1.0] * 5, None)
    assert s == pytest.approx([0.4, 0.45, 0.5, 0.55, 0.6], abs=1e-12)
    down = ALLOCATIONS.make("taper", slope=-0.2).sparsities(0.5, [1.0] * 5, None)
    assert down == pytest.approx(s[::-1], abs=1e-12)


def test_taper_sparsity_prunes_deeper_blocks_more():
    from prunelab.pruning import Wanda

    lm = wrap(tiny_model("llama"), char_tokenizer())
    calib = TokenBatches(input_ids=tiny_tokens(4, 16), spec="tiny", seqlen=16, samples=4,
                         seed=0, mode="calib", total_windows=4, sha256="0")
    rep = prunelab.prune(lm, Wanda(sparsity=0.5, allocation=ALLOCATIONS.make("taper",
                                                                              slope=0.3)),
                         calib, batch_size=2)
    s = rep["per_block_sparsity"]
    assert s == pytest.approx([0.35, 0.45, 0.55, 0.65], abs=1e-9)
