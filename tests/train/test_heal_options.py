"""Degenerate or conflicting heal options are refused in one line (issue 39, class 6): a
learning rate of 0, and a prune-while-tuning budget without its prune mode."""

from __future__ import annotations

import pytest

from prunelab.errors import ConfigError
from prunelab.train.config import HealConfig


def test_lr_zero_is_refused():
    with pytest.raises(ConfigError, match="lr must be > 0"):
        HealConfig(lr=0.0)
    assert HealConfig(lr=1e-6).peak_lr == 1e-6


@pytest.mark.parametrize(("field", "value", "mode"), [("ratio", 0.3, "rep-lie"),
                                                      ("remove", 2, "cascadeflow")])
def test_a_prune_budget_needs_its_prune_mode(field, value, mode):
    for prune in (None, *({"rep-lie", "cascadeflow"} - {mode})):
        with pytest.raises(ConfigError, match=f"applies to prune {mode} only") as info:
            HealConfig(prune=prune, **{field: value})
        assert "\n" not in str(info.value)
    assert getattr(HealConfig(prune=mode, **{field: value}), field) == value


def test_defaults_hold_for_their_own_mode_only():
    assert HealConfig(prune="rep-lie").ratio == 0.2 and HealConfig(prune="rep-lie").remove is None
    assert HealConfig(prune="cascadeflow").remove == 1
    plain = HealConfig()
    assert plain.ratio is None and plain.remove is None and plain.prune_events() == 0
    assert HealConfig.from_dict(plain.to_dict()) == plain


def test_records_written_with_the_old_defaults_still_load():
    old = {**HealConfig().to_dict(), "ratio": 0.2, "remove": 1}
    assert HealConfig.from_dict(old) == HealConfig()
    with pytest.raises(ConfigError, match="applies to prune rep-lie only"):
        HealConfig.from_dict({**old, "ratio": 0.4})  # not a default: it was asked for
