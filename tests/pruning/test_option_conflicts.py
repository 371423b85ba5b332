"""Conflicting or degenerate options of the pruning configs are refused in one line, in
Python as on the command line (issue 39, class 6): a budget given two ways is never
silently resolved, and a figure that would make a model larger or train nothing is an
error."""

from __future__ import annotations

import warnings

import pytest

from prunelab.data.batches import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.models.size import model_size
from prunelab.pruning import METHODS
from prunelab.pruning.factor.slicing import choose_width, config_refuses, params_at

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 16, seed=1)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def _lm(arch: str = "llama"):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


@pytest.mark.parametrize("name", ["slicegpt", "basis-sharing", "shared-dict", "svd-llm"])
def test_factor_ratio_and_target_params_together_are_refused(name):
    with pytest.raises(ConfigError, match="not both|not ratio and target_params") as info:
        METHODS.make(name, ratio=0.3, target_params=0.8)
    assert "\n" not in str(info.value)
    # either alone works; neither: the method's default ratio
    assert METHODS.make(name, target_params=0.8).target_params == 0.8
    assert METHODS.make(name, ratio=0.3).ratio == 0.3
    assert METHODS.make(name).ratio == {"slicegpt": 0.25}.get(name, 0.2)


@pytest.mark.parametrize("name", ["basis-sharing", "shared-dict"])
def test_shared_rank_with_a_budget_is_refused(name):
    for other in ({"ratio": 0.3}, {"target_params": 0.8}):
        with pytest.raises(ConfigError, match="give one of"):
            METHODS.make(name, rank=4, **other)
    cfg = METHODS.make(name, rank=4)
    assert cfg.rank == 4 and cfg.ratio is None  # no ratio reported that did not apply


@pytest.mark.parametrize(("name", "budget"), [("svd-llm", "remove-weights:0"),
                                              ("shared-dict", "remove-weights:0"),
                                              ("basis-sharing", "remove-weights:0")])
def test_a_removal_ratio_of_zero_is_refused(name, budget):
    from prunelab.budget import budget_options

    opts = budget_options(METHODS.get(name), budget, name)
    with pytest.raises(ConfigError, match="ratio must be"):
        METHODS.make(name, **opts)


@pytest.mark.parametrize("ratio", [0.0, 0.01])
def test_slicegpt_ratio_that_would_grow_the_model_is_refused_before_calibration(ratio):
    """Ratio 0 (or one that rounds to d' = d) would store the shortcut maps on top of the
    dense weights: a larger model; refused before any data (the rotation alone stays
    available to slice_stream, where tests check it leaves the logits unchanged)."""
    import prunelab

    lm = _lm()
    dense = model_size(lm.model)["params"]
    cfg = METHODS.make("slicegpt", ratio=ratio, multiple=2)  # d' = 32 = d
    assert params_at(lm, 32, "per-layer") > dense  # the shortcut maps
    with pytest.raises(ConfigError, match="not fewer than the dense") as info:
        prunelab.prune(lm, cfg, CALIB, batch_size=2)
    assert f"{dense:,}" in str(info.value)
    assert model_size(lm.model)["params"] == dense and not lm.history  # nothing touched


def test_slicegpt_width_is_one_the_family_config_accepts():
    """Llama's config wants hidden_size % num_attention_heads == 0: 26 (ratio 0.1875 of
    32, multiple 2) cannot be a plain checkpoint; the nearest width that can (24) is
    chosen before any calibration, with a warning saying so."""
    lm = _lm()
    assert "multiple of the number of attention heads" in config_refuses(lm, 26)
    assert config_refuses(lm, 24) == ""
    cfg = METHODS.make("slicegpt", ratio=0.1875, multiple=2, rotation="global")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert choose_width(cfg, lm) == 24
    # target_params: the largest accepted width under the target, never 26 / 30
    cfg = METHODS.make("slicegpt", target_params=0.99, multiple=2, rotation="global")
    assert choose_width(cfg, lm) % 4 == 0


def test_slicegpt_width_warning_and_the_sliced_model_loads(capsys):
    import prunelab

    lm = _lm()
    cfg = METHODS.make("slicegpt", ratio=0.1875, multiple=2, rotation="global")
    rep = prunelab.prune(lm, cfg, CALIB, batch_size=2)
    assert rep["d_kept"] == 24 and lm.model.config.hidden_size == 24
    err = capsys.readouterr().err
    assert err.count("slicing to the nearest one that can, 24") == 1  # said once


def test_gates_steps_zero_is_refused():
    with pytest.raises(ConfigError, match=r"steps must be in \[1"):
        METHODS.make("gates", steps=0)
    assert METHODS.make("gates", steps=1).steps == 1


def test_elastic_t_end_above_t_start_is_refused():
    with pytest.raises(ConfigError, match="t_end 2 is above t_start 1"):
        METHODS.make("elastic", t_start=1.0, t_end=2.0)
    assert METHODS.make("elastic", t_start=1.0, t_end=1.0).t_end == 1.0
