"""The summary's reliability parts: stability lines, swap classes and the decision rule by
the bootstrap intervals, and the list of conclusions the intervals do not support.

Used by :func:`prunelab.probes.summary.write_summary`; every part is empty (or the table
it has always been) for results without per-window values or intervals, e.g. results
saved by an older prunelab. See :mod:`prunelab.probes.reliability` for the statistics.
"""

from __future__ import annotations

import math

import numpy as np

from prunelab.probes.base import ProbeResult
from prunelab.probes.comparison import (
    PAIR_CLASSES,
    _pair_values,
    _table,
    decision_rule,
    fmt,
    rank_correlations,
    removal_cell,
    rule_for,
)
from prunelab.probes.reliability import (
    TARGET,
    bootstrap_values,
    replicate_result,
    spearman,
    window_table,
)
from prunelab.probes.swap import pair_class

#: a removal set reproduced by fewer than this share of the resamples is flagged
UNSTABLE_SHARE = 0.5
UNDECIDED = "undecided"


# ---------------------------------------------------------------- stability lines
def _label(result: ProbeResult, all_positions: bool) -> str:
    if all_positions:
        return "all positions"
    if "reliability" in result.meta and "stability_all_positions" in result.meta["reliability"]:
        pooled = "mean-pooled" in str(result.meta.get("value_protocol", ""))
        return "mean-pooled" if pooled else "last position"
    return ""


def stability_text(name: str, result: ProbeResult, all_positions: bool = False) -> str | None:
    """``"interchange (last position): stability 0.55 at 16 windows; about 118 windows for
    0.9"`` from ``result.meta["reliability"]`` (``None`` when absent)."""
    rel = result.meta.get("reliability") or {}
    suffix = "_all_positions" if all_positions else ""
    if f"stability{suffix}" not in rel:
        return None
    label = _label(result, all_positions)
    head = f"{name} ({label})" if label else name
    r, w = rel[f"stability{suffix}"], rel.get("windows")
    if r is None:
        return f"{head}: stability not measurable at {w} windows (constant values or " \
               "too few windows)"
    text = f"{head}: stability {r:.2f} at {w} windows"
    need = rel.get(f"windows_for_0.9{suffix}")
    if r >= TARGET:
        return text + f" (at least {TARGET})"
    if need is None:
        return text + f"; {TARGET} not reachable by adding windows"
    return text + f"; about {need} windows for {TARGET}"


def stability_section(results: dict[str, ProbeResult]) -> list[str]:
    """``## Ranking stability``: one line per probe and protocol (empty when no result has
    ``meta["reliability"]``)."""
    lines = [t for name, r in results.items() for t in
             (stability_text(name, r), stability_text(name, r, True)) if t]
    if not lines:
        return []
    rel = next(r.meta["reliability"] for r in results.values() if "reliability" in r.meta)
    return ["## Ranking stability", "",
            "Expected Spearman correlation between the rankings of two independent "
            "calibration sets of the same size (split-half over the windows, "
            f"{rel.get('splits', '?')} seeded splits, corrected to the full count by "
            "Spearman-Brown), and the windows at which it would reach 0.9 (Spearman-Brown "
            "prophecy). Pair probes: of the per-block ranking r(l); span and interval probes: "
            "of the spans themselves. Intervals: percentile bootstrap over windows "
            f"({rel.get('bootstrap', '?')} resamples, seed {rel.get('seed', '?')}).", "",
            *[f"- {t}" for t in lines], ""]


# ---------------------------------------------------------------- swap classes
def interval_class(low: float, high: float) -> str:
    """A pair's class when its whole interval supports it: upper bound < 0.05 strongly
    swap-similar, < 0.10 conditional, lower bound >= 0.10 not swap-similar; otherwise
    ``undecided`` (the interval spans 0.10)."""
    if high < 0.05:
        return "strongly swap-similar"
    if high < 0.10:
        return "conditional"
    if low >= 0.10:
        return "not swap-similar"
    return UNDECIDED


def _intervals(result: ProbeResult) -> dict[tuple[int, int], tuple[float, float]]:
    out = {}
    for s in result.scores:
        if len(s["layers"]) == 2 and s.get("kind", "pair") == "pair" and "ci_high" in s:
            i, j = s["layers"]
            out[(min(i, j), max(i, j))] = (float(s["ci_low"]), float(s["ci_high"]))
    return out


def pair_class_lines(pair_results: dict[str, ProbeResult]) -> list[str]:
    """The swap-pair class table: by the intervals where every result has them (a pair is
    ``< 0.05`` only when its upper bound is; an ``undecided`` column), else by value."""
    by_ci = all(_intervals(r) for r in pair_results.values())
    rows = []
    for name, r in pair_results.items():
        vals, cis = _pair_values(r), _intervals(r)
        counts = dict.fromkeys((*PAIR_CLASSES, UNDECIDED), 0)
        for pair, v in vals.items():
            counts[interval_class(*cis[pair]) if by_ci and pair in cis else pair_class(v)] += 1
        extra = [str(counts[UNDECIDED])] if by_ci else []
        rows.append([name, str(len(vals)), *(str(counts[c]) for c in PAIR_CLASSES), *extra])
    if not by_ci:
        return _table(["probe", "pairs", "< 0.05 (strongly swap-similar)",
                       "< 0.10 (conditional)", ">= 0.10 (not swap-similar)"], rows)
    return ["By the 95% bootstrap intervals: a pair counts as < 0.05 or < 0.10 only when its "
            "upper bound is, as >= 0.10 only when its lower bound is.", "",
            *_table(["probe", "pairs", "< 0.05 (strongly swap-similar)",
                     "< 0.10 (conditional)", ">= 0.10 (not swap-similar)",
                     "undecided (interval spans 0.10)"], rows)]


# ---------------------------------------------------------------- decision rule
def _side(low: float, high: float, threshold: float) -> bool | None:
    """``True`` (high) when the whole interval is >= threshold, ``False`` when below it."""
    if low >= threshold:
        return True
    if high < threshold:
        return False
    return None


def decision_rule_intervals(replacement: ProbeResult, interchange: ProbeResult,
                            threshold: float = 0.10) -> list[dict]:
    """:func:`~prunelab.probes.comparison.decision_rule` plus, for pairs with intervals on
    both sides, ``replacement_ci``, ``interchange_ci`` and ``rule_by_intervals`` (the rule
    when both sides are decided by their whole interval, else ``undecided``)."""
    rep_ci, int_ci = _intervals(replacement), _intervals(interchange)
    out = decision_rule(replacement, interchange, threshold)
    for d in out:
        pair = tuple(d["layers"])
        if pair in rep_ci and pair in int_ci:
            d["replacement_ci"], d["interchange_ci"] = list(rep_ci[pair]), list(int_ci[pair])
            r, x = _side(*rep_ci[pair], threshold), _side(*int_ci[pair], threshold)
            d["rule_by_intervals"] = UNDECIDED if r is None or x is None else rule_for(
                threshold + 1 if r else threshold - 1, threshold + 1 if x else threshold - 1,
                threshold)
    return out


def _ci(ci) -> str:
    return f"[{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "-"


def decision_lines(adjacent: list[dict]) -> list[str]:
    """The decision-rule table of ``adjacent`` (dicts of :func:`decision_rule_intervals`);
    with the intervals and the rule they support where every pair has them."""
    if not all("rule_by_intervals" in d for d in adjacent):
        return _table(["pair", "replacement", "class", "interchange", "class", "rule"],
                      [[f"{d['layers'][0]}-{d['layers'][1]}", d["replacement"],
                        d["replacement_class"], d["interchange"], d["interchange_class"],
                        d["rule"]] for d in adjacent])
    return _table(["pair", "replacement", "95% interval", "interchange", "95% interval",
                   "rule", "rule by the intervals"],
                  [[f"{d['layers'][0]}-{d['layers'][1]}", d["replacement"],
                    _ci(d["replacement_ci"]), d["interchange"], _ci(d["interchange_ci"]),
                    d["rule"], d["rule_by_intervals"]] for d in adjacent])


# ---------------------------------------------------------------- bootstrap of conclusions
def _resampling(result: ProbeResult) -> tuple[int, int]:
    rel = result.meta.get("reliability") or {}
    return int(rel.get("bootstrap", 200)), int(rel.get("seed", 0))


def removal_support(result: ProbeResult, max_remove: int) -> dict[int, float]:
    """For each ``n`` whose removal :func:`removal_cell` lists: the share of bootstrap
    replicates of the windows listing the same blocks (empty without per-window values)."""
    table = window_table(result)
    n_boot, seed = _resampling(result)
    if table is None or len(table.index) != len(result.scores) or n_boot < 1:
        return {}
    chosen = {n: removal_cell(result, n) for n in range(1, max_remove + 1)}
    chosen = {n: c for n, c in chosen.items() if c != "-"}
    same = dict.fromkeys(chosen, 0)
    for values in bootstrap_values(table.data, n_boot, seed, table.combine):
        rep = replicate_result(result, table.index, values)
        for n, cell in chosen.items():
            same[n] += removal_cell(rep, n) == cell
    return {n: same[n] / n_boot for n in chosen}


def agreement_interval(a: ProbeResult, b: ProbeResult, level: float = 0.95) -> list | None:
    """Paired bootstrap interval of the Spearman correlation between the rankings of ``a``
    and ``b`` (the same window resamples for both), or ``None`` when they cannot be
    resampled together (no per-window values, other window counts)."""
    ta, tb = window_table(a), window_table(b)
    if ta is None or tb is None or ta.windows != tb.windows:
        return None
    n_boot, seed = _resampling(a)
    if n_boot < 1:
        return None
    reps_a = bootstrap_values(ta.data, n_boot, seed, ta.combine)
    reps_b = bootstrap_values(tb.data, n_boot, seed, tb.combine)
    rhos = []
    for va, vb in zip(reps_a, reps_b, strict=True):
        xa = replicate_result(a, ta.index, va).layer_values()
        xb = replicate_result(b, tb.index, vb).layer_values()
        both = [(x, y) for x, y in zip(xa, xb, strict=False)
                if x is not None and y is not None]
        rho = spearman([x for x, _ in both], [y for _, y in both])
        if math.isfinite(rho):
            rhos.append(rho)
    if len(rhos) < n_boot / 2:
        return None
    tail = (1 - level) / 2
    return [float(q) for q in np.quantile(rhos, [tail, 1 - tail])]


def removal_supports(results: dict[str, ProbeResult], max_remove: int) -> dict[str, dict]:
    """:func:`removal_support` of every result that has per-window values."""
    out = {name: removal_support(r, max_remove) for name, r in results.items()}
    return {name: s for name, s in out.items() if s}


def support_lines(support: dict[str, dict], names: list[str], max_remove: int) -> list[str]:
    """A table under the removal table: the share of bootstrap resamples of the windows
    that give the same blocks (empty when no result can be resampled)."""
    if not support:
        return []
    rows = [[str(n)] + [fmt(support.get(name, {}).get(n)) for name in names]
            for n in range(1, max_remove + 1)]
    return [f"Share of the bootstrap resamples of the windows that give the same blocks "
            f"(below {UNSTABLE_SHARE:g}: flagged at the end):", "", *_table(["n", *names], rows)]


# ---------------------------------------------------------------- flags
def _ranking_flags(results: dict[str, ProbeResult]) -> list[str]:
    out = []
    for name, r in results.items():
        rel = r.meta.get("reliability") or {}
        if "stability" in rel and (rel["stability"] is None or rel["stability"] < TARGET):
            st = "not measurable" if rel["stability"] is None else f"{rel['stability']:.2f}"
            out.append(f"{name}: the order of its ranking (stability {st} at "
                       f"{rel.get('windows')} windows, below {TARGET}); blocks whose "
                       "intervals overlap may swap places on other calibration text")
    return out


def _removal_flags(support: dict[str, dict], results: dict[str, ProbeResult]) -> list[str]:
    return [f"{name}, n = {n}: removing {removal_cell(results[name], n)} (the same blocks in "
            f"{share:.0%} of the resamples)"
            for name, shares in support.items() for n, share in shares.items()
            if share < UNSTABLE_SHARE]


def _agreement_flags(results: dict[str, ProbeResult]) -> list[str]:
    out = []
    for c in rank_correlations(results):
        ci = agreement_interval(results[c["a"]], results[c["b"]])
        if ci is not None and ci[0] <= 0 <= ci[1]:
            out.append(f"rank agreement {c['a']} / {c['b']}: Spearman {fmt(c['spearman'])}, "
                       f"95% interval {_ci(ci)} includes 0")
    return out


def _class_flags(results: dict[str, ProbeResult]) -> list[str]:
    out = []
    for name, r in results.items():
        if r.kind != "pair":
            continue
        cis, vals = _intervals(r), _pair_values(r)
        bad = [p for p in sorted(cis) if p in vals and
               interval_class(*cis[p]) != pair_class(vals[p])]
        if bad:
            shown = ", ".join(f"{i}-{j} ({fmt(vals[(i, j)])}, {_ci(cis[(i, j)])})"
                              for i, j in bad[:10])
            more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
            out.append(f"{name}: the class by value of {len(bad)} of {len(vals)} pairs: "
                       f"{shown}{more}")
    return out


def flags_section(results: dict[str, ProbeResult], support: dict[str, dict],
                  adjacent: list[dict] | None = None) -> list[str]:
    """``## Conclusions the intervals do not support``: rankings below 0.9 stability,
    removal sets reproduced by fewer than half the resamples, rank agreements whose
    interval includes 0, pair classes and decision rules (``adjacent``: dicts of
    :func:`decision_rule_intervals`) that the intervals leave undecided or contradict.
    Empty when no result has per-window values or intervals."""
    if not support and not any("reliability" in r.meta or any("ci_high" in s for s in r.scores)
                               for r in results.values()):
        return []
    flags = _ranking_flags(results) + _removal_flags(support, results)
    flags += _agreement_flags(results) + _class_flags(results)
    flags += [f"decision rule {d['layers'][0]}-{d['layers'][1]}: {d['rule']!r} (by the "
              f"intervals: {d['rule_by_intervals']})" for d in adjacent or []
              if d.get("rule_by_intervals", d["rule"]) != d["rule"]]
    lines = ["## Conclusions the intervals do not support", ""]
    if not flags:
        return lines + ["None: every ranking, removal set, agreement, class and rule above "
                        "holds under the bootstrap over windows.", ""]
    return lines + [f"- {f}" for f in flags] + [""]
