"""Probe summaries (selections, rank agreement, decision rule, Markdown) and report plots."""

from __future__ import annotations

import math

import pytest

from prunelab.probes.base import ProbeResult
from prunelab.probes.comparison import (
    decision_rule,
    greedy_no_adjacent,
    lowest_n,
    rank_correlations,
)
from prunelab.probes.plots import plot_result, plot_swap_pair
from prunelab.probes.summary import write_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- hand-made results
def layer_result(values, probe="leave-one-out", lower=True, meta=None) -> ProbeResult:
    return ProbeResult(probe=probe, config={}, kind="layer", lower_is_removable=lower,
                       num_blocks=len(values), meta=meta or {},
                       scores=[{"layers": [i], "value": v} for i, v in enumerate(values)])


def pair_result(probe: str, values: dict[tuple[int, int], float], n: int) -> ProbeResult:
    return ProbeResult(probe=probe, config={}, kind="pair", num_blocks=n,
                       scores=[{"layers": list(p), "value": v} for p, v in values.items()])


def sublayer_result() -> ProbeResult:
    scores = [{"layers": [i], "sublayer": part, "value": v}
              for i, (a, m) in enumerate([(0.3, 0.2), (0.01, 0.02), (0.5, 0.4), (0.1, 0.1)])
              for part, v in (("attention", a), ("mlp", m))]
    return ProbeResult("sublayer-ablation", {}, scores, kind="sublayer", num_blocks=4)


def span_result() -> ProbeResult:
    vals = [0.4, 0.1, 0.3]
    scores = [{"layers": [s, s + 2], "value": v} for s, v in enumerate(vals)]
    return ProbeResult("span-angular", {"span": 2}, scores, kind="span", num_blocks=4,
                       meta={"best_span": [1, 3]})


def interval_result() -> ProbeResult:
    costs = {(0, 1): 0.5, (1, 2): 0.02, (2, 3): 0.3, (3, 4): 0.04, (4, 5): 0.6,
             (0, 2): 0.7, (1, 3): 0.35, (2, 4): 0.25, (3, 5): 0.8}
    pairs = [{"removed_blocks": 2, "intervals": [[1, 2], [3, 4]], "predicted_cost": 0.06},
             {"removed_blocks": 3, "intervals": [[0, 1], [2, 4]], "predicted_cost": 0.75}]
    return ProbeResult("interval", {"max_length": 2},
                       [{"layers": list(k), "value": v} for k, v in costs.items()],
                       kind="interval", num_blocks=5, meta={"best_interval_pairs": pairs})


REPL = {(0, 1): 0.2, (1, 2): 0.01, (2, 3): 0.3, (3, 4): 0.07, (0, 2): 0.5}
INTER = {(0, 1): 0.03, (1, 2): 0.04, (2, 3): 0.2, (3, 4): 0.15, (0, 2): 0.02}


# ---------------------------------------------------------------- selections
def test_greedy_no_adjacent():
    vals = [0.1, 0.05, 0.2, 0.01, 0.3]
    assert greedy_no_adjacent(vals, 1) == [3]
    assert greedy_no_adjacent(vals, 2) == [1, 3]
    # 0 touches 1, 2 touches 1 and 3, 4 touches 3: nothing else is legal
    assert greedy_no_adjacent(vals, 3) == [1, 3]
    assert greedy_no_adjacent([0.1, 0.5, 0.3, 0.9, 0.2], 3) == [0, 2, 4]
    assert greedy_no_adjacent([None, 0.2, None, 0.1], 5) == [1, 3]
    assert greedy_no_adjacent([0.1, 0.2], 0) == []


def test_lowest_n():
    assert lowest_n([0.1, 0.05, 0.2, 0.01, 0.3], 2) == [1, 3]
    assert lowest_n([0.1, 0.05, 0.2, 0.01, 0.3], 3) == [0, 1, 3]
    assert lowest_n([None, 0.5, None, 0.1], 3) == [1, 3]
    assert lowest_n([0.3, float("nan"), 0.1], 2) == [0, 2]


# ---------------------------------------------------------------- rank correlations
def test_rank_correlations_identical_and_reversed():
    vals = [0.1, 0.4, 0.2, 0.3, 0.5]
    res = {"a": layer_result(vals),
           "b": layer_result([v * 10 for v in vals], probe="block-influence"),
           # cka-like: higher = removable, so equal raw values give reversed removability
           "c": layer_result(vals, probe="cka", lower=False)}
    corr = {(c["a"], c["b"]): c for c in rank_correlations(res)}
    assert set(corr) == {("a", "b"), ("a", "c"), ("b", "c")}
    assert corr[("a", "b")]["spearman"] == pytest.approx(1.0)
    assert corr[("a", "b")]["kendall"] == pytest.approx(1.0)
    assert corr[("a", "c")]["spearman"] == pytest.approx(-1.0)
    assert corr[("a", "c")]["kendall"] == pytest.approx(-1.0)
    assert corr[("a", "b")]["n"] == 5


def test_rank_correlations_constant_and_too_few():
    res = {"a": layer_result([0.1, 0.2, 0.3]), "flat": layer_result([1.0, 1.0, 1.0]),
           "two": layer_result([0.1, None, 0.2]), "span": span_result()}
    corr = {(c["a"], c["b"]): c for c in rank_correlations(res)}
    assert set(corr) == {("a", "flat")}  # "two" and the span probe share < 3 blocks
    assert math.isnan(corr[("a", "flat")]["spearman"])
    assert math.isnan(corr[("a", "flat")]["kendall"])
    assert "| a | flat | 3 | nan | nan |" in write_summary(res)


# ---------------------------------------------------------------- decision rule
def test_decision_rule():
    rep = pair_result("replacement", REPL, 5)
    inter = pair_result("interchange", {**INTER, (1, 4): 0.01}, 5)
    rules = {tuple(d["layers"]): d for d in decision_rule(rep, inter)}
    assert list(rules) == [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4)]  # only pairs in both
    assert rules[(0, 1)]["rule"] == "trust interchange"
    assert rules[(1, 2)]["rule"] == "either"
    assert rules[(2, 3)]["rule"] == "more calibration or another signal"
    assert rules[(3, 4)]["rule"] == "trust replacement (unusual)"
    assert rules[(1, 2)]["replacement_class"] == "strongly swap-similar"
    assert rules[(3, 4)]["replacement_class"] == "conditional"
    assert rules[(3, 4)]["interchange_class"] == "not swap-similar"
    assert rules[(3, 4)]["replacement"] == 0.07
    # the threshold moves the boundary
    assert decision_rule(rep, inter, threshold=0.05)[-1]["rule"] == (
        "more calibration or another signal")


# ---------------------------------------------------------------- Markdown summary
def test_write_summary():
    loo = layer_result([0.3, 0.02, 0.5, 0.01, 0.04], meta={"block_evaluations": 15.0,
                                                              "seconds": 1.23456})
    bi = layer_result([0.3, 0.02, 0.5, 0.01, 0.04], probe="block-influence")
    res = {"leave-one-out": loo, "block-influence": bi,
           "replacement": pair_result("replacement", REPL, 5),
           "interchange": pair_result("interchange", INTER, 5),
           "span-angular": span_result(), "interval": interval_result()}
    md = write_summary(res, max_remove=4, model="tiny-llama", data="wikitext")
    for section in ("# prunelab probe summary", "## Removability rankings",
                    "## Layers each protocol would remove",
                    "## Rank agreement (Spearman / Kendall)", "## Swap-pair classes",
                    "### Decision rule (adjacent pairs)", "## Cost"):
        assert section in md
    assert "- Model: tiny-llama" in md and "- Data: wikitext" in md and "0-based" in md
    assert "r(l) = min(d(l, l-1), d(l, l+1))" in md
    # top of the leave-one-out ranking: block 3 (0.01), then block 1 (0.02)
    assert "| 1 | 3 | 0.01 |" in md and "| 2 | 1 | 0.02 |" in md
    # replacement r(l): block 1 -> min(0.2, 0.01) = 0.01 via pair 1-2
    assert "| 1 | 1 | 0.01 | 1-2 |" in md
    # removal table: columns in the order of `results`
    # leave-one-out greedy: 3, then 1; n=3: 4 touches 3, 0 touches 1, 2 touches both -> "-"
    # block-influence lowest-n: 3; 1, 3; 1, 3, 4
    # replacement r = [0.2, 0.01, 0.01, 0.07, 0.07] greedy: 1; 1, 3; then "-"
    # interchange r = [0.03, 0.03, 0.04, 0.15, 0.15] greedy: 0; 0, 2; 0, 2, 4
    # span-angular (span 2): only n = 2; interval (max_length 2): best single interval of
    # length 1 and 2, then the best pair for 3 ([0, 1) + [2, 4)); none listed for 4
    assert "| 1 | 3 | 3 | 1 | 0 | - | 1 = [1, 2) |" in md
    assert "| 2 | 1, 3 | 1, 3 | 1, 3 | 0, 2 | 1, 2 = [1, 3) | 2, 3 = [2, 4) |" in md
    assert "| 3 | - | 1, 3, 4 | - | 0, 2, 4 | - | 0, 2, 3 = [0, 1) + [2, 4) |" in md
    assert "| 4 | - | 0, 1, 3, 4 | - | - | - | - |" in md
    assert "| leave-one-out | block-influence | 5 | 1 | 1 |" in md
    # class counts: replacement 0.01 | 0.07 | 0.2, 0.3, 0.5 ; interchange 0.03, 0.04, 0.02 | -
    assert "| replacement | 5 | 1 | 1 | 3 |" in md
    assert "| interchange | 5 | 3 | 0 | 2 |" in md
    # decision rule only on adjacent pairs (0-2 left out), values to 4 significant digits
    assert "| 0-1 | 0.2 | not swap-similar | 0.03 | strongly swap-similar | trust interchange |" \
        in md
    assert "| 3-4 | 0.07 | conditional | 0.15 | not swap-similar | trust replacement " \
        "(unusual) |" in md
    assert "0-2 |" not in md.split("### Decision rule")[1]
    assert "| leave-one-out | 15 | 1.235 |" in md
    # span and interval rankings list spans best first
    assert "| 1 | [1, 3) | 0.1 |" in md and "| 1 | [1, 2) | 0.02 |" in md


def test_write_summary_higher_is_removable_and_sublayer():
    cka = layer_result([0.9, 0.99, 0.5], probe="cka", lower=False)
    md = write_summary({"cka": cka, "sublayer": sublayer_result()}, max_remove=2)
    assert "higher = more removable" in md
    assert "| 1 | 1 | 0.99 |" in md and "| 2 | 0 | 0.9 |" in md  # raw values shown
    assert "| 1 | 1 | 0.03 | 0.01 | 0.02 |" in md  # sublayer: sum, attention, mlp
    assert "## Swap-pair classes" not in md and "## Cost" not in md


# ---------------------------------------------------------------- plots
def _check_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_plot_result_every_kind(tmp_path):
    wr = layer_result([0.3, 0.1, 0.2], probe="weight-redundancy")
    wr.scores += [{"layers": [0, 1], "value": 0.8, "kind": "pair"},
                  {"layers": [1, 2], "value": 0.6, "kind": "pair"}]
    cka = layer_result([0.9, 0.95, 0.7], probe="cka", lower=False)
    cka.scores += [{"layers": [i, j], "value": 0.5, "kind": "boundary-pair"}
                   for i in range(4) for j in range(i + 1, 4)]
    results = {"layer": layer_result([0.3, 0.02, 0.5, 0.01]), "sublayer": sublayer_result(),
               "pair": pair_result("interchange", INTER, 5), "span": span_result(),
               "interval": interval_result(), "weights": wr, "cka": cka}
    for name, res in results.items():
        path = tmp_path / "plots" / f"{name}.png"
        fig = plot_result(res, path)
        _check_png(path)
        assert "removable" in fig.axes[0].get_title()
    assert len(plot_result(wr).axes) == 3  # bars, pair heatmap, its colourbar
    assert len(plot_result(cka).axes) == 3
    assert "block (0-based)" in plot_result(results["layer"]).axes[0].get_xlabel()
    assert plot_result(results["pair"]).axes[0].images[0].get_array().shape == (5, 5)
    assert plot_result(cka).axes[1].images[0].get_array().shape == (4, 4)  # boundaries 0..3


def test_plot_swap_pair_one_colour_scale(tmp_path):
    rep, inter = pair_result("replacement", REPL, 5), pair_result("interchange", INTER, 5)
    path = tmp_path / "swap.png"
    fig = plot_swap_pair(rep, inter, path)
    _check_png(path)
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert len(images) == 2
    assert images[0].get_clim() == images[1].get_clim() == (0.01, 0.5)
    assert [ax.get_title() for ax in fig.axes if ax.images] == ["replacement", "interchange"]
    assert len(fig.axes) == 3  # two heatmaps and one colourbar
