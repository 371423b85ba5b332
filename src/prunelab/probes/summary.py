"""The Markdown summary of probe results: rankings, the blocks each protocol would remove,
rank agreement, swap classes and the decision rule, costs, and (with per-window values) the
reliability parts of :mod:`prunelab.probes.reliability_report`. The comparisons themselves
are in :mod:`prunelab.probes.comparison`.

All block indices are 0-based; spans and intervals ``[start, end)`` are half-open.
"""

from __future__ import annotations

from prunelab.probes import reliability_report as rr
from prunelab.probes.base import ProbeResult
from prunelab.probes.cascadeflow import fan_in_markdown
from prunelab.probes.comparison import (
    TOP,
    _direction,
    _finite,
    _span_str,
    _table,
    _uses_greedy,
    rank_correlations,
    removal_cell,
)
from prunelab.probes.head_summary import head_summary_lines


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
