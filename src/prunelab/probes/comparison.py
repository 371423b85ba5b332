"""Comparing probe results: removal selections, rank agreement, the swap decision rule, and
the table pieces the Markdown summary (:mod:`prunelab.probes.summary`) is made of.

All block indices are 0-based; spans and intervals ``[start, end)`` are half-open. Per-block
removability comes from :meth:`ProbeResult.layer_values` (lower = more removable; for pair
probes ``r(l) = min(d(l, l-1), d(l, l+1))``).
"""

from __future__ import annotations

import math
import warnings
from itertools import combinations

from scipy import stats

from prunelab.probes.base import ProbeResult
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
