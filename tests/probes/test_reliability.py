"""Probe reliability: bootstrap intervals over windows, split-half rank stability,
Spearman-Brown, per-window values of real probes, the summary's lines and flags, error
bars, and the stability of a depth selection."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from prunelab.data import TokenBatches
from prunelab.errors import ConfigError
from prunelab.eval.divergence import kl_from_logits, kl_from_logits_float64
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext, ProbeResult, probe_names, run_probes
from prunelab.probes.comparison import lowest_n
from prunelab.probes.plots import plot_result
from prunelab.probes.reliability import (
    add_reliability,
    bootstrap_intervals,
    bootstrap_values,
    selection_stability,
    spearman,
    spearman_brown,
    split_half_stability,
    window_counts,
    window_table,
    windows_for,
)
from prunelab.probes.reliability_report import interval_class
from prunelab.probes.summary import write_summary
from prunelab.pruning import Depth

from tiny_models import tiny_model, tiny_tokens

IDS = tiny_tokens(6, 12)


# ---------------------------------------------------------------- bootstrap
def test_intervals_contain_the_value_and_shrink_with_more_windows():
    rng = np.random.default_rng(1)
    means = np.linspace(0.0, 1.0, 12)[:, None]
    widths = {}
    for w in (16, 256):
        data = means + rng.normal(0.0, 0.5, size=(12, w))
        low, high = bootstrap_intervals(data, n=400, seed=3)
        value = data.mean(1)
        assert np.all(low <= value) and np.all(value <= high) and np.all(low < high)
        widths[w] = float(np.mean(high - low))
    # the width of a mean's interval goes as 1/sqrt(windows): 4x narrower at 16x windows
    assert widths[256] < 0.4 * widths[16]
    assert widths[256] == pytest.approx(widths[16] / 4, rel=0.3)


def test_resamples_are_shared_seeded_and_exact_on_hand_cases():
    counts = window_counts(5, 7, seed=2)
    assert counts.shape == (7, 5) and counts.sum(1).tolist() == [5] * 7
    assert np.array_equal(counts, window_counts(5, 7, seed=2))
    assert not np.array_equal(counts, window_counts(5, 7, seed=3))
    # one resample of window indices for all scores: equal rows give equal replicates
    row = np.arange(5.0)
    reps = bootstrap_values(np.stack([row, row, 2 * row]), n=50, seed=0)
    assert np.array_equal(reps[:, 0], reps[:, 1]) and np.allclose(reps[:, 2], 2 * reps[:, 0])
    assert np.allclose(reps[:, 0], counts_mean(row, window_counts(5, 50, seed=0)))
    # constant windows: the interval is the value; max of two parts; |mean - 1|
    low, high = bootstrap_intervals([[0.25] * 6], n=30)
    assert low[0] == high[0] == 0.25
    low, high = bootstrap_intervals([[[1.0] * 4, [3.0] * 4]], n=30, combine="max")
    assert low[0] == high[0] == 3.0
    low, high = bootstrap_intervals([[[1.5] * 4]], n=30, combine="abs-1")
    assert low[0] == high[0] == 0.5
    # no resamples, or one window: the value at both ends
    low, high = bootstrap_intervals([[0.1, 0.3]], n=0)
    assert low[0] == high[0] == pytest.approx(0.2)


def counts_mean(row: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return (counts * row).sum(1) / len(row)


# ---------------------------------------------------------------- stability
def test_split_half_is_one_for_a_deterministic_probe():
    data = np.repeat(np.array([0.3, 0.1, 0.7, 0.2, 0.9, 0.5])[:, None], 16, axis=1)
    got = split_half_stability(data, splits=20, seed=0)
    assert got["half"] == 1.0 and got["stability"] == 1.0 and got["half_windows"] == 8


def test_split_half_is_about_zero_for_a_random_probe():
    rng = np.random.default_rng(0)
    halves, stabs = [], []
    for _ in range(5):
        got = split_half_stability(rng.normal(size=(30, 32)), splits=50, seed=1)
        halves.append(got["half"])
        stabs.append(got["stability"])
    assert abs(np.mean(halves)) < 0.2 and abs(np.mean(stabs)) < 0.2
    assert split_half_stability(np.ones((4, 1))) is None  # one window: no halves


def test_spearman_brown_and_prophecy_hand_computed():
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6*2/(4*15)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3])) and math.isnan(spearman([1, 2], [1, 2]))
    assert spearman_brown(0.5) == pytest.approx(2 / 3)  # 2r / (1 + r)
    assert spearman_brown(0.6, 3.0) == pytest.approx(1.8 / 2.2)
    assert spearman_brown(-1.0) == -1.0
    # m = 0.9 (1 - r) / (r (1 - 0.9)): r = 0.5 -> m = 9; r = 0.75 -> m = 3
    assert windows_for(0.5, 16) == 144 and windows_for(0.75, 10) == 30
    assert spearman_brown(0.5, 144 / 16) == pytest.approx(0.9)
    assert windows_for(0.55, 16) == 118  # 16 * 7.3636... = 117.8
    assert windows_for(0.9, 16) == 16 and windows_for(0.97, 8) == 8  # already there
    assert windows_for(0.0, 16) is None and windows_for(-0.2, 16) is None  # not reachable
    assert windows_for(None, 16) is None and windows_for(float("nan"), 16) is None


def test_pair_stability_is_of_the_per_block_ranking():
    # pairs 0-1, 1-2, 2-3 with constant windows: r(l) = [a, min(a, b), min(b, c), c];
    # halves agree exactly, so the per-block ranking's stability is 1
    scores = [{"layers": [i, i + 1], "value": v, "windows": [v] * 6}
              for i, v in enumerate([0.3, 0.1, 0.2])]
    res = ProbeResult("interchange", {}, scores, kind="pair", num_blocks=4)
    info = add_reliability(res, bootstrap=50, seed=0)
    assert info["stability"] == 1.0 and info["windows"] == 6
    assert info["ranking"] == "per block r(l) = min(d(l, l-1), d(l, l+1))"
    assert info["windows_for_0.9"] == 6
    for s in res.scores:
        assert s["ci_low"] == pytest.approx(s["value"]) == s["ci_high"]


# ---------------------------------------------------------------- real probes
@pytest.fixture(scope="module")
def llama_results():
    lm = wrap(tiny_model("llama"))
    return lm, run_probes(lm, probe_names(), IDS, batch_size=4, window=1, span=2,
                          max_length=2)


def test_per_window_values_average_to_the_value(llama_results):
    _, res = llama_results
    n = IDS.shape[0]
    mean = lambda xs: float(np.mean(xs))  # noqa: E731
    for name in ("interchange", "leave-one-out", "sublayer-ablation", "interval"):
        for s in res[name].scores:
            assert len(s["windows"]) == len(s["windows_all_positions"]) == n
            assert mean(s["windows"]) == pytest.approx(s["value"], rel=1e-12, abs=1e-15)
            assert mean(s["windows_all_positions"]) == pytest.approx(
                s["value_all_positions"], rel=1e-12, abs=1e-15)
    for s in res["replacement"].scores:
        a, b = mean(s["windows_i_from_j"]), mean(s["windows_j_from_i"])
        assert a == pytest.approx(s["i_from_j"], rel=1e-12, abs=1e-15)
        assert max(a, b) == pytest.approx(s["value"], rel=1e-12, abs=1e-15)
        assert max(mean(s["windows_i_from_j_all_positions"]),
                   mean(s["windows_j_from_i_all_positions"])) == pytest.approx(
            s["value_all_positions"], rel=1e-12, abs=1e-15)
    for name in ("block-influence", "span-angular"):
        for s in res[name].scores:
            assert len(s["windows"]) == n
            assert mean(s["windows"]) == pytest.approx(s["value"], rel=1e-9, abs=1e-15)
    for s in res["contraction"].scores:
        assert abs(mean(s["windows_rho"]) - 1) == pytest.approx(s["value"], rel=1e-9,
                                                                abs=1e-12)
    # intervals around the value; CKA and weight redundancy have no per-window value
    for name in ("interchange", "leave-one-out", "block-influence", "span-angular"):
        for s in res[name].scores:
            assert s["ci_low"] <= s["value"] <= s["ci_high"]
            assert s.get("ci_low_all_positions", 0) <= s.get("ci_high_all_positions", 1)
        rel = res[name].meta["reliability"]
        assert rel["windows"] == n and rel["bootstrap"] == 200 and rel["seed"] == 0
        assert -1.0 <= rel["stability"] <= 1.0
    assert "reliability" not in res["cka"].meta and "ci_low" not in res["cka"].scores[0]
    assert "stability_all_positions" in res["interchange"].meta["reliability"]
    assert "stability_all_positions" not in res["block-influence"].meta["reliability"]


@torch.no_grad()
def test_divergence_is_unchanged_bit_for_bit(llama_results):
    lm, _ = llama_results
    ctx = ProbeContext(lm, IDS, batch_size=4)
    final = ctx.run_stack(1, range(2, ctx.num_blocks))
    # the accumulation divergence() always used (before the per-window values)
    last_sum = all_sum = 0.0
    n_rows = n_tok = 0
    for b, h in enumerate(final):
        ref, logits = ctx._ref(b), lm.adapter.logits(ctx._final(h))
        last_sum += float(kl_from_logits_float64(ref[:, -1], logits[:, -1]).sum())
        for r in range(h.shape[0]):
            all_sum += float(kl_from_logits(ref[r], logits[r]).double().sum())
        n_rows += h.shape[0]
        n_tok += h.shape[0] * h.shape[1]
    assert ctx.divergence(final) == (last_sum / n_rows, all_sum / n_tok)
    per = ctx.divergence_windows(final)
    assert len(per.last) == len(per.all_positions) == IDS.shape[0]
    ctx.close()


def test_bootstrap_option(tmp_path):
    lm = wrap(tiny_model("llama"))
    res = run_probes(lm, ["leave-one-out"], IDS, batch_size=4, bootstrap=0, seed=5)
    s = res["leave-one-out"]
    assert "ci_low" not in s.scores[0] and s.meta["reliability"]["bootstrap"] == 0
    assert s.meta["reliability"]["seed"] == 5 and "stability" in s.meta["reliability"]
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="bootstrap"):
            run_probes(lm, ["leave-one-out"], IDS, bootstrap=bad)


def test_json_round_trip_and_resume_keep_windows_and_intervals(tmp_path):
    lm = wrap(tiny_model("llama"))
    out = tmp_path / "p"
    full = run_probes(lm, ["interchange"], IDS, batch_size=4, out_dir=out,
                      window=1)["interchange"]
    loaded = ProbeResult.load(out / "interchange.json")
    assert loaded.scores == full.scores and loaded.meta["reliability"] == \
        full.meta["reliability"]
    assert "ci_high" in loaded.scores[0] and len(loaded.scores[0]["windows"]) == 6
    header = (out / "interchange.csv").read_text().splitlines()[0]
    assert "ci_low" in header and "windows" not in header
    # bootstrapped again from the JSON alone, with the same seed: the same intervals
    again = ProbeResult.load(out / "interchange.json")
    for s in again.scores:
        del s["ci_low"], s["ci_high"]
    assert add_reliability(again, 200, 0) == full.meta["reliability"]
    assert again.scores == full.scores
    # resume from a partial holding the first pair (with its windows)
    first = {k: v for k, v in full.scores[0].items() if not k.startswith("ci_")}
    partial = {"config": full.config, "fingerprint": full.meta["fingerprint"],
               "scores": [first]}
    (out / "interchange.partial.json").write_text(json.dumps(partial))
    resumed = run_probes(lm, ["interchange"], IDS, batch_size=4, out_dir=out, window=1,
                         overwrite=True)["interchange"]
    assert resumed.meta["block_evaluations"] == 3 + 2
    assert resumed.scores == full.scores
    assert resumed.meta["reliability"] == full.meta["reliability"]


# ---------------------------------------------------------------- summary
def pair_with_ci(probe, entries, n=4, rel=None):
    scores = [{"layers": list(p), "value": v, "ci_low": lo, "ci_high": hi}
              for p, (v, lo, hi) in entries.items()]
    return ProbeResult(probe, {}, scores, kind="pair", num_blocks=n,
                       meta={"reliability": rel} if rel else {})


def test_summary_stability_lines():
    rel = {"stability": 0.55, "stability_all_positions": 0.95, "windows": 16,
           "windows_for_0.9": windows_for(0.55, 16),
           "windows_for_0.9_all_positions": 16, "bootstrap": 200, "seed": 0, "splits": 100}
    inter = pair_with_ci("interchange", {(0, 1): (0.02, 0.01, 0.03)}, rel=rel)
    loo = ProbeResult("leave-one-out", {}, [{"layers": [0], "value": 0.1}], kind="layer",
                      num_blocks=1, meta={"reliability": {
                          "stability": -0.1, "windows": 8, "windows_for_0.9": None}})
    md = write_summary({"interchange": inter, "leave-one-out": loo})
    assert "## Ranking stability" in md
    assert "- interchange (last position): stability 0.55 at 16 windows; about 118 windows " \
        "for 0.9" in md
    assert "- interchange (all positions): stability 0.95 at 16 windows (at least 0.9)" in md
    assert "- leave-one-out: stability -0.10 at 8 windows; 0.9 not reachable by adding " \
        "windows" in md
    flags = md.split("## Conclusions the intervals do not support")[1]
    assert "interchange: the order of its ranking (stability 0.55 at 16 windows" in flags
    assert "## Ranking stability" not in write_summary({"loo": ProbeResult(
        "leave-one-out", {}, [{"layers": [0], "value": 0.1}], kind="layer", num_blocks=1)})


def test_classes_and_decision_rule_use_the_intervals():
    assert interval_class(0.01, 0.049) == "strongly swap-similar"
    assert interval_class(0.01, 0.07) == "conditional"  # < 0.10 holds, < 0.05 does not
    assert interval_class(0.10, 0.3) == "not swap-similar"
    assert interval_class(0.04, 0.12) == "undecided"
    rep = pair_with_ci("replacement", {(0, 1): (0.2, 0.15, 0.3), (1, 2): (0.12, 0.08, 0.2),
                                       (2, 3): (0.01, 0.005, 0.02)})
    inter = pair_with_ci("interchange", {(0, 1): (0.03, 0.01, 0.07),
                                         (1, 2): (0.02, 0.01, 0.03),
                                         (2, 3): (0.08, 0.04, 0.12)})
    md = write_summary({"replacement": rep, "interchange": inter})
    # replacement: 0.01 strongly; 0.2 not; 0.12 [0.08, 0.2] undecided
    assert "| replacement | 3 | 1 | 0 | 1 | 1 |" in md
    # interchange: 0.02 strongly; 0.03 [0.01, 0.07] conditional by its upper bound;
    # 0.08 [0.04, 0.12] undecided
    assert "| interchange | 3 | 1 | 1 | 0 | 1 |" in md
    assert "| 0-1 | 0.2 | [0.15, 0.3] | 0.03 | [0.01, 0.07] | trust interchange | " \
        "trust interchange |" in md
    assert "| 1-2 | 0.12 | [0.08, 0.2] | 0.02 | [0.01, 0.03] | trust interchange | " \
        "undecided |" in md
    flags = md.split("## Conclusions the intervals do not support")[1]
    assert "replacement: the class by value of 1 of 3 pairs: 1-2 (0.12, [0.08, 0.2])" in flags
    assert "interchange: the class by value of 2 of 3 pairs: 0-1 (0.03, [0.01, 0.07]), " \
        "2-3 (0.08, [0.04, 0.12])" in flags
    assert "decision rule 1-2: 'trust interchange' (by the intervals: undecided)" in flags
    assert "decision rule 2-3: 'either' (by the intervals: undecided)" in flags
    assert "decision rule 0-1" not in flags


def layer_with_windows(windows: list[list[float]], probe="leave-one-out") -> ProbeResult:
    scores = [{"layers": [i], "value": float(np.mean(w)), "windows": w}
              for i, w in enumerate(windows)]
    return ProbeResult(probe, {}, scores, kind="layer", num_blocks=len(windows))


def test_removal_support_in_the_summary():
    steady = layer_with_windows([[0.1] * 8, [0.5] * 8, [0.2] * 8, [0.9] * 8])
    add_reliability(steady, 200, 0)
    md = write_summary({"steady": steady}, max_remove=2)
    assert "Share of the bootstrap resamples" in md and "| 1 | 1 |" in md
    assert "None: every ranking, removal set" in md
    # blocks 0, 1 and 2 tie on average and trade places between resamples
    tied = layer_with_windows([[0.0, 1.0, 1.0] * 3, [1.0, 0.0, 1.0] * 3, [1.0, 1.0, 0.0] * 3,
                               [3.0] * 9])
    add_reliability(tied, 200, 0)
    md = write_summary({"tied": tied}, max_remove=1)
    assert "- tied, n = 1: removing 0 (the same blocks in" in md


# ---------------------------------------------------------------- plots
def test_error_bars_on_bar_plots():
    res = layer_with_windows([[0.1, 0.3] * 4, [0.5, 0.6] * 4, [0.2] * 8])
    assert not plot_result(res).axes[0].containers[1:]  # bars only, no interval yet
    add_reliability(res, 100, 0)
    ax = plot_result(res).axes[0]
    bars = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 1
    segs = bars[0].lines[2][0].get_segments()  # one whisker per block
    assert len(segs) == 3
    assert segs[0][:, 1].tolist() == pytest.approx([res.scores[0]["ci_low"],
                                                    res.scores[0]["ci_high"]])


# ---------------------------------------------------------------- depth
def test_selection_stability_exact_cases():
    steady = layer_with_windows([[0.1] * 8, [0.5] * 8, [0.2] * 8, [0.9] * 8])
    stab = selection_stability(steady, lambda r: lowest_n(r.layer_values(), 2), [0, 2],
                               n=50, seed=0)
    assert stab["share_same"] == 1.0 and stab["inclusion"] == [1.0, 0.0, 1.0, 0.0]
    tied = layer_with_windows([[0.0, 1.0] * 4, [1.0, 0.0] * 4, [2.0] * 8, [3.0] * 8])
    stab = selection_stability(tied, lambda r: lowest_n(r.layer_values(), 1), [0], n=200)
    assert 0.2 < stab["share_same"] < 0.8
    assert stab["inclusion"][0] == stab["share_same"]
    assert stab["inclusion"][0] + stab["inclusion"][1] == pytest.approx(1.0)
    assert window_table(ProbeResult("cka", {}, [{"layers": [0], "value": 1.0}],
                                    kind="layer", num_blocks=1)) is None


def _calib():
    return TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=6, seed=0,
                        mode="calib", total_windows=6, sha256="0")


def test_depth_records_the_selection_stability_and_warns(tmp_path, capsys):
    import prunelab

    lm = wrap(tiny_model("llama"))
    rep = prunelab.prune(lm, Depth(remove=1, probe="leave-one-out"), _calib(), batch_size=4)
    stab = rep["selection"]["selection_stability"]
    assert stab["bootstrap"] == 200 and stab["windows"] == 6 and len(stab["inclusion"]) == 4
    assert sum(stab["inclusion"]) == pytest.approx(1.0)  # one block per resample
    assert stab["inclusion"][rep["removed_blocks"][0]] >= stab["share_same"] > 0
    capsys.readouterr()
    # a saved result where blocks 0 and 1 trade places: the set is unstable -> one warning
    tied = layer_with_windows([[0.0, 1.0] * 3, [1.0, 0.0] * 3, [2.0] * 6, [3.0] * 6])
    path = tmp_path / "tied.json"
    path.write_text(json.dumps(tied.to_dict()))
    rep = prunelab.prune(wrap(tiny_model("llama")), Depth(remove=1, from_probe=str(path),
                         max_instability=0.1), _calib(), batch_size=4)
    err = capsys.readouterr().err
    assert rep["selection"]["selection_stability"]["share_same"] < 0.9
    assert err.count("warning: blocks [0] are not stable") == 1
    off = prunelab.prune(wrap(tiny_model("llama")), Depth(remove=1, from_probe=str(path),
                         bootstrap=0), _calib(), batch_size=4)
    assert "selection_stability" not in off["selection"]
    for bad in ({"bootstrap": -1}, {"max_instability": 1.5}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            Depth(remove=1, **bad)
    assert torch.is_tensor(IDS)


def test_warnings_show_even_when_quiet(capsys):
    from prunelab import log

    log.set_quiet(True)
    try:
        log.info("a status line")
        log.warn("something may not be what was asked")
    finally:
        log.set_quiet(False)
    err = capsys.readouterr().err
    assert "a status line" not in err
    assert err.count("prunelab: warning: something may not be what was asked") == 1


def test_ticker_reports_counts_and_a_bound_and_is_silent_when_quiet(capsys):
    from prunelab import log

    t = log.Ticker(4, "fit", every=0.0)
    t.tick()
    t.tick()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("fit: 1 of at most 4 after ")
    assert lines[1].startswith("fit: 2 of at most 4 after ") and lines[1].endswith(" s left")
    log.set_quiet(True)
    try:
        t.tick()
    finally:
        log.set_quiet(False)
    assert capsys.readouterr().err == "" and t.done == 3
    slow = log.Ticker(4, "fit", every=3600.0)
    slow.tick()
    assert capsys.readouterr().err == ""  # at most one line per `every` seconds
