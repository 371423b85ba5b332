"""``Depth.search_windows``: a search scored on the first N calibration windows only, its
cost in units of all the windows, the recovery fitted on all of them."""

from __future__ import annotations

import copy

import pytest

from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext
from prunelab.pruning import Depth
from prunelab.pruning.depth.config import select
from prunelab.pruning.depth.strategies import Beam, Sleb
from prunelab.pruning.depth.strategies.sleb import share_greedy_runs
from prunelab.pruning.depth.surgery import run_depth

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(6, 12)


def _lm(seed=0):
    return wrap(tiny_model("llama", seed=seed), char_tokenizer(), spec="tiny")


@pytest.mark.parametrize("kw", [
    {"select": Sleb(score="kl")},
    {"select": Sleb(), "granularity": "sublayer"},
    {"select": Beam(width=2, seeds=4)},
], ids=["sleb", "sublayer", "beam"])
def test_a_subset_search_equals_the_search_on_those_windows(kw):
    lm = _lm(seed=3)
    full = ProbeContext(lm, IDS, batch_size=1)
    got, how = select(lm, Depth(remove=2, search_windows=2, **kw), full, 2)
    alone_ctx = ProbeContext(lm, IDS[:2], batch_size=1)
    alone, how_alone = select(lm, Depth(remove=2, **kw), alone_ctx, 2)
    assert got == alone
    assert how["search_windows"] == 2
    # the cost is counted in units of all 6 windows: a third of the 2-window count
    assert how["block_evaluations"] == pytest.approx(how_alone["block_evaluations"] / 3)
    spent = alone_ctx.block_evaluations - alone_ctx.cache_block_evaluations
    assert full.block_evaluations == pytest.approx(
        full.cache_block_evaluations + (spent + alone_ctx.cache_block_evaluations) / 3)
    if "steps" in how:
        assert [s["block_evaluations"] for s in how["steps"]] == pytest.approx(
            [s["block_evaluations"] / 3 for s in how_alone["steps"]])


def test_all_windows_is_the_plain_search():
    lm = _lm(seed=1)
    ctx = ProbeContext(lm, IDS, batch_size=1)
    assert ctx.subset(len(IDS)) is ctx and ctx.subset(99) is ctx
    got, how = select(lm, Depth(remove=2, select=Sleb(score="kl"), search_windows=6), ctx, 2)
    plain, how_plain = select(lm, Depth(remove=2, select=Sleb(score="kl")),
                              ProbeContext(lm, IDS, batch_size=1), 2)
    assert got == plain and "search_windows" not in how
    assert how["block_evaluations"] == how_plain["block_evaluations"]


def test_shared_runs_are_scaled_once():
    """A nested answer from a shared greedy run on a subset is scaled like the run itself
    (the stored run keeps its own figures)."""
    lm = _lm(seed=2)
    ctx = ProbeContext(lm, IDS, batch_size=1)
    share_greedy_runs(ctx)
    big, how_big = select(lm, Depth(remove=3, select=Sleb(score="kl"), search_windows=3),
                          ctx, 3)
    for _ in range(2):
        small, how = select(lm, Depth(remove=1, select=Sleb(score="kl"), search_windows=3),
                            ctx, 1)
        assert how["nested"]["steps"] == 1 and small == [how_big["steps"][0]["removed"]]
        assert how["block_evaluations"] == pytest.approx(
            how_big["steps"][0]["block_evaluations"])


def test_the_recovery_fits_on_all_windows():
    """Same blocks chosen (given explicitly vs found on a subset), same recovery: the
    repaired model is the same, since the fit sees all the windows either way."""
    lm = _lm(seed=4)
    ctx = ProbeContext(lm, IDS, batch_size=1)
    a = copy.deepcopy(lm)
    rep = run_depth(a, Depth(remove=2, select=Sleb(score="kl"), search_windows=2,
                             recovery="foldable"), IDS, batch_size=1, ctx=ctx)
    b = copy.deepcopy(lm)
    ref = run_depth(b, Depth(blocks=tuple(rep.removed_blocks), recovery="foldable"), IDS,
                    batch_size=1, ctx=ProbeContext(lm, IDS, batch_size=1))
    assert rep.calib_kl_after_recovery == pytest.approx(ref.calib_kl_after_recovery,
                                                        rel=1e-6)
    assert rep.selection["search_windows"] == 2


@pytest.mark.parametrize("kw, msg", [
    ({"search_windows": 2}, "applies to --strategy sleb / beam / iterative"),
    ({"search_windows": 0, "select": Sleb()}, "search_windows"),
    ({"search_windows": 1.5, "select": Sleb()}, "search_windows"),
])
def test_invalid_search_windows(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        Depth(remove=1, **kw)


def test_cli_search_windows_errors(tmp_path, capsys):
    from prunelab.cli import cli_main

    out = tmp_path / "o"
    for extra, msg in ((["--search-windows", "2"], "--search-windows applies to --strategy"),
                       (["--strategy", "sleb", "--search-windows", "0"], "search_windows")):
        code = cli_main(["prune", "depth", "--model", str(tmp_path / "m"), "--out", str(out),
                         "--budget", "remove-blocks:1", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and msg in err[0]
        assert not out.exists()
