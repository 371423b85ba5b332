"""Comparing probe results: removal selections, rank agreement, the swap decision rule, and
a Markdown summary.

All block indices are 0-based; spans and intervals ``[start, end)`` are half-open. Per-block
removability comes from :meth:`ProbeResult.layer_values` (lower = more removable; for pair
probes ``r(l) = min(d(l, l-1), d(l, l+1))``).
"""

from __future__ import annotations

import math
import warnings
from itertools import combinations

from prunelab.probes.base import ProbeResult
from prunelab.probes.head_summary import head_summary_lines
from prunelab.probes.swap import pair_class

PAIR_CLASSES = ("strongly swap-similar", "conditional", "not swap-similar")
TOP = 10


# ---------------------------------------------------------------- selections
def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def lowest_n(values: list[float | None], n: int) -> list[int]:
    """Sorted indices of the ``n`` lowest values (``None``/NaN skipped; ties: lower index)."""
    order = sorted((i for i, v in enumerate(values) if _finite(v)), key=lambda i: values[i])
    return sorted(order[:max(n, 0)])


def greedy_no_adjacent(values: list[float | None], n: int) -> list[int]:
    """Up to ``n`` indices taken lowest value first, skipping any index next to (``|i - j|
    == 1``) one already taken; sorted (fewer than ``n`` when no legal index is left)."""
    taken: list[int] = []
    for i in sorted((i for i, v in enumerate(values) if _finite(v)), key=lambda i: values[i]):
        if len(taken) >= n:
            break
        if all(abs(i - j) != 1 for j in taken):
            taken.append(i)
    return sorted(taken)


# ---------------------------------------------------------------- rank agreement
def _correlations(x: list[float], y: list[float]) -> tuple[float, float]:
    from scipy import stats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant input: scipy warns and returns NaN
        rho = stats.spearmanr(x, y).statistic
        tau = stats.kendalltau(x, y).statistic
    return float(rho), float(tau)


def rank_correlations(results: dict[str, ProbeResult]) -> list[dict]:
    """Spearman and Kendall correlation of per-block removability between every two results
    with at least 3 common blocks: ``{"a", "b", "spearman", "kendall", "n"}`` (NaN when a
    side is constant)."""
    values = {name: r.layer_values() for name, r in results.items()}
    out = []
    for a, b in combinations(results, 2):
        va, vb = values[a], values[b]
        common = [i for i in range(min(len(va), len(vb))) if _finite(va[i]) and _finite(vb[i])]
        if len(common) < 3:
            continue
        rho, tau = _correlations([va[i] for i in common], [vb[i] for i in common])
        out.append({"a": a, "b": b, "spearman": rho, "kendall": tau, "n": len(common)})
    return out


# ---------------------------------------------------------------- swap decision rule
def _pair_values(result: ProbeResult) -> dict[tuple[int, int], float]:
    out = {}
    for s in result.scores:
        if len(s["layers"]) == 2 and s.get("kind", "pair") == "pair" and _finite(s["value"]):
            i, j = s["layers"]
            out[(min(i, j), max(i, j))] = float(s["value"])
    return out


def rule_for(replacement: float, interchange: float, threshold: float = 0.10) -> str:
    """The paper's advice for one pair from its replacement and interchange KL."""
    repl_high, int_high = replacement >= threshold, interchange >= threshold
    if repl_high and not int_high:
        return "trust interchange"
    if not repl_high and not int_high:
        return "either"
    if repl_high and int_high:
        return "more calibration or another signal"
    return "trust replacement (unusual)"


def decision_rule(replacement: ProbeResult, interchange: ProbeResult,
                  threshold: float = 0.10) -> list[dict]:
    """For every pair measured by both probes: both values, their classes
    (:func:`~prunelab.probes.swap.pair_class`) and the rule (:func:`rule_for`)."""
    rep, inter = _pair_values(replacement), _pair_values(interchange)
    out = []
    for pair in sorted(rep.keys() & inter.keys()):
        r, x = rep[pair], inter[pair]
        out.append({"layers": list(pair), "replacement": r, "interchange": x,
                    "replacement_class": pair_class(r), "interchange_class": pair_class(x),
                    "rule": rule_for(r, x, threshold)})
    return out


# ---------------------------------------------------------------- formatting
def fmt(v) -> str:
    """A number with 4 significant digits (``-`` for missing, ``nan`` for NaN)."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return f"{v:.4g}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |"
              for row in rows]
    return lines + [""]


def _blocks(blocks: list[int]) -> str:
    return ", ".join(str(b) for b in blocks)


def _span_str(start: int, end: int) -> str:
    return f"[{start}, {end})"


def _direction(result: ProbeResult) -> str:
    return "lower = more removable" if result.lower_is_removable else "higher = more removable"


# ---------------------------------------------------------------- removal per protocol
def _uses_greedy(result: ProbeResult) -> bool:
    return result.kind in ("pair", "sublayer") or result.probe == "leave-one-out"


def _best_span(result: ProbeResult) -> list[int] | None:
    if "best_span" in result.meta:
        return list(result.meta["best_span"])
    spans = [s for s in result.scores if len(s["layers"]) == 2 and _finite(s["value"])]
    if not spans:
        return None
    sign = 1 if result.lower_is_removable else -1
    return list(min(spans, key=lambda s: sign * s["value"])["layers"])


def _interval_max_length(result: ProbeResult) -> int:
    if isinstance(result.config.get("max_length"), int):
        return result.config["max_length"]
    return max((s["layers"][1] - s["layers"][0] for s in result.scores), default=0)


def _best_interval(result: ProbeResult, length: int) -> list[int] | None:
    cands = [s for s in result.scores if len(s["layers"]) == 2 and _finite(s["value"])
             and s["layers"][1] - s["layers"][0] == length]
    return list(min(cands, key=lambda s: s["value"])["layers"]) if cands else None


def removal_cell(result: ProbeResult, n: int) -> str:
    """The blocks ``result``'s protocol would remove for ``n`` blocks (``-`` if none)."""
    if result.kind == "span":
        span = _best_span(result)
        if span is None or span[1] - span[0] != n:
            return "-"
        return f"{_blocks(list(range(*span)))} = {_span_str(*span)}"
    if result.kind == "interval":
        if n <= _interval_max_length(result):
            best = _best_interval(result, n)
            if best is None:
                return "-"
            return f"{_blocks(list(range(*best)))} = {_span_str(*best)}"
        for entry in result.meta.get("best_interval_pairs", []):
            if entry.get("removed_blocks") == n:
                ivs = entry["intervals"]
                blocks = [b for s, e in ivs for b in range(s, e)]
                return f"{_blocks(blocks)} = " + " + ".join(_span_str(s, e) for s, e in ivs)
        return "-"
    values = result.layer_values()
    picked = greedy_no_adjacent(values, n) if _uses_greedy(result) else lowest_n(values, n)
    return _blocks(picked) if len(picked) == n else "-"


def _selection_note(result: ProbeResult) -> str:
    if result.kind == "span":
        return "its best span [l, l+n), only for its own span length"
    if result.kind == "interval":
        return ("best single interval of length n up to max_length, then the best pair of "
                "disjoint, non-touching intervals (interval additivity)")
    if _uses_greedy(result):
        return "greedy, lowest first, never two adjacent blocks"
    return "the n most removable blocks"


# ---------------------------------------------------------------- rankings
def _ranking_lines(name: str, result: ProbeResult) -> list[str]:
    head = f"### {name} (`{result.probe}`, {result.kind}; {_direction(result)})"
    lines = [head, ""]
    if result.kind in ("span", "interval"):
        sign = 1 if result.lower_is_removable else -1
        spans = sorted((s for s in result.scores if len(s["layers"]) == 2
                        and _finite(s["value"])), key=lambda s: sign * s["value"])
        what = "spans" if result.kind == "span" else "intervals"
        lines.append(f"Top {min(TOP, len(spans))} {what} `[start, end)`, most removable first.")
        lines.append("")
        rows = [[str(k + 1), _span_str(*s["layers"]), s["value"]]
                for k, s in enumerate(spans[:TOP])]
        return lines + _table(["rank", what[:-1], "value"], rows)
    values = result.layer_values()
    ranking = result.ranking()[:TOP]
    sign = -1 if not result.lower_is_removable and result.kind in ("layer", "pair") else 1
    if result.kind == "pair":
        lines.append("Per block `r(l) = min(d(l, l-1), d(l, l+1))` over the measured "
                     "neighbouring pairs: a block is removable when it can be swapped with a "
                     "neighbour at small cost.")
        lines.append("")
        mat = result.pair_matrix()
        rows = []
        for k, i in enumerate(ranking):
            nb = [j for j in (i - 1, i + 1) if 0 <= j < result.num_blocks
                  and mat[i][j] is not None and mat[i][j] * sign == values[i]]
            pair = f"{min(i, nb[0])}-{max(i, nb[0])}" if nb else "-"
            rows.append([str(k + 1), str(i), sign * values[i], pair])
        return lines + _table(["rank", "block", "r(l)", "pair"], rows)
    if result.kind == "sublayer":
        parts: dict[int, dict[str, float]] = {}
        for s in result.scores:
            parts.setdefault(s["layers"][0], {})[s.get("sublayer", "?")] = s["value"]
        lines += ["Per block: the sum of the attention and MLP ablation values.", ""]
        rows = [[str(k + 1), str(i), values[i], parts[i].get("attention"), parts[i].get("mlp")]
                for k, i in enumerate(ranking)]
        return lines + _table(["rank", "block", "attention + mlp", "attention", "mlp"], rows)
    rows = [[str(k + 1), str(i), sign * values[i]] for k, i in enumerate(ranking)]
    if not rows:
        return lines + ["No per-block values.", ""]
    return lines + _table(["rank", "block", "value"], rows)


# ---------------------------------------------------------------- summary
def _find(results: dict[str, ProbeResult], probe: str) -> ProbeResult | None:
    for name, r in results.items():
        if r.probe == probe or name == probe:
            return r
    return None


def write_summary(results: dict[str, ProbeResult], max_remove: int = 5, model: str = "",
                  data: str = "") -> str:
    """A Markdown report comparing ``results`` (name -> result): rankings, the blocks each
    protocol would remove for ``n = 1..max_remove``, rank agreement, swap classes and the
    decision rule, and costs where recorded; with per-window values, the ranking stability,
    classes and rule by the bootstrap intervals, and the conclusions the intervals do not
    support (:mod:`prunelab.probes.reliability_report`)."""
    from prunelab.probes import reliability_report as rr

    lines = ["# prunelab probe summary", ""]
    lines += [f"- Model: {model or '-'}", f"- Data: {data or '-'}",
              "- Probes: " + (", ".join(f"{n} (`{r.probe}`)" for n, r in results.items())
                              or "-"),
              "- Block indices are 0-based; spans and intervals `[start, end)` are half-open.",
              ""]
    lines += rr.stability_section(results)

    lines += ["## Removability rankings", ""]
    for name, result in results.items():
        lines += _ranking_lines(name, result)

    lines += ["## Layers each protocol would remove", ""]
    names = list(results)
    if names:
        for name in names:
            lines.append(f"- {name}: {_selection_note(results[name])}")
        lines.append("")
        rows = [[str(n)] + [removal_cell(results[name], n) for name in names]
                for n in range(1, max_remove + 1)]
        lines += _table(["n", *names], rows)
    support = rr.removal_supports(results, max_remove)
    lines += rr.support_lines(support, names, max_remove)

    lines += ["## Rank agreement (Spearman / Kendall)", ""]
    corr = rank_correlations(results)
    if corr:
        lines += _table(["a", "b", "blocks", "Spearman", "Kendall"],
                        [[c["a"], c["b"], str(c["n"]), c["spearman"], c["kendall"]]
                         for c in corr])
    else:
        lines += ["Fewer than two protocols with at least 3 common per-block values.", ""]

    lines += head_summary_lines(results)  # attention-head probes, if any
    if "gradient-flow" in results:  # CascadeFlow's fan-in profile against the post-hoc probes
        from prunelab.probes.cascadeflow import fan_in_markdown

        lines += fan_in_markdown(results).rstrip("\n").split("\n") + [""]

    pair_results = {n: r for n, r in results.items() if r.kind == "pair"}
    adjacent: list[dict] = []
    if pair_results:
        lines += ["## Swap-pair classes", ""]
        lines += rr.pair_class_lines(pair_results)
        rep, inter = _find(results, "replacement"), _find(results, "interchange")
        if rep is not None and inter is not None:
            adjacent = [d for d in rr.decision_rule_intervals(rep, inter)
                        if d["layers"][1] - d["layers"][0] == 1]
            lines += ["### Decision rule (adjacent pairs)", "",
                      "Threshold 0.10: replacement high and interchange low -> trust "
                      "interchange; both low -> either; both high -> more calibration or "
                      "another signal; replacement low and interchange high -> trust "
                      "replacement (unusual).", ""]
            if adjacent:
                lines += rr.decision_lines(adjacent)
            else:
                lines += ["No adjacent pair measured by both.", ""]

    costs = [(n, r.meta) for n, r in results.items()
             if "block_evaluations" in r.meta or "seconds" in r.meta]
    if costs:
        lines += ["## Cost", ""]
        lines += _table(["probe", "block evaluations", "seconds"],
                        [[n, m.get("block_evaluations"), m.get("seconds")] for n, m in costs])
    lines += rr.flags_section(results, support, adjacent)
    return "\n".join(lines).rstrip() + "\n"
