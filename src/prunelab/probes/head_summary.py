"""Comparing head scores: Spearman correlations between head probes, and their Markdown.

Every head probe (kind ``"head"``: ``dla``, ``head-ablation``, ``stable-rank``,
``induction``) gives one value per (block, query head). Two results are compared on the
heads both measured, each oriented so that a low value means "removable" (the
``lower_is_removable`` flag of the result). The width score ``ablation-kl`` at query-head
level is the mean per-token ``KL(p_dense || p_masked)`` of each head masked alone on the
first ``samples`` windows, which is ``head-ablation`` (``ablation="zero"``) on those windows;
:func:`ablation_kl_result` computes it as a head result so that it can join the table.
"""

from __future__ import annotations

import math
import warnings
from itertools import combinations

import torch
from scipy import stats

from prunelab.calib.ablation import Unit, ablation_kl
from prunelab.probes.base import ProbeResult
from prunelab.probes.heads import head_columns

TOP_HEADS = 5


def head_values(result: ProbeResult, key: str = "value") -> dict[tuple[int, int], float]:
    """``{(block, head): value}`` of a head result, oriented so that low = removable
    (NaN and missing values left out)."""
    sign = 1.0 if result.lower_is_removable else -1.0
    out = {}
    for s in result.scores:
        v = s.get(key)
        if "head" in s and isinstance(v, (int, float)) and math.isfinite(v):
            out[(s["layers"][0], s["head"])] = sign * float(v)
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (NaN when a side is constant)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant input: scipy warns and returns NaN
        return float(stats.spearmanr(x, y).statistic)


def head_correlations(results: dict[str, ProbeResult]) -> list[dict]:
    """Spearman correlation of the head values of every two head results with at least 3
    common heads: ``{"a", "b", "spearman", "n"}``."""
    heads = {name: head_values(r) for name, r in results.items() if r.kind == "head"}
    out = []
    for a, b in combinations(heads, 2):
        common = sorted(heads[a].keys() & heads[b].keys())
        if len(common) < 3:
            continue
        rho = spearman([heads[a][k] for k in common], [heads[b][k] for k in common])
        out.append({"a": a, "b": b, "spearman": rho, "n": len(common)})
    return out


def _fmt(v: float) -> str:
    return "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.4g}"


def _heads_cell(vals: dict, keys: list) -> str:
    return ", ".join(f"{i}.{h} ({_fmt(vals[(i, h)])})" for i, h in keys)


def head_summary_lines(results: dict[str, ProbeResult]) -> list[str]:
    """The summary's head section (Markdown lines; empty without a head result): the most
    removable and the least removable heads of each head result, and the correlations."""
    named = {n: r for n, r in results.items() if r.kind == "head"}
    if not named:
        return []
    lines = ["## Attention heads", "",
             "Heads as `block.head` (0-based query heads); each probe oriented so that "
             "low = removable.", ""]
    lines += ["| probe | most removable | least removable |", "|---|---|---|"]
    for name, r in named.items():
        vals = head_values(r)
        order = sorted(vals, key=lambda k: (vals[k], k))
        lines.append(f"| {name} | {_heads_cell(vals, order[:TOP_HEADS])} | "
                     f"{_heads_cell(vals, order[::-1][:TOP_HEADS])} |")
    lines.append("")
    corr = head_correlations(named)
    lines += ["### Head-score agreement (Spearman)", ""]
    if not corr:
        return lines + ["Fewer than two head probes with at least 3 common heads.", ""]
    lines += ["| a | b | heads | Spearman |", "|---|---|---|---|"]
    lines += [f"| {c['a']} | {c['b']} | {c['n']} | {_fmt(c['spearman'])} |" for c in corr]
    ablation = named.get("head-ablation")
    if ablation is not None and (ablation.config or {}).get("ablation", "zero") == "zero" \
            and "ablation-kl" not in named:
        lines += ["", "`head-ablation` (zero) is the width score `ablation-kl` at query-head "
                  "level (the same KLs), so its rows are the agreement with `ablation-kl`."]
    return lines + [""]


def ablation_kl_result(lm, input_ids: torch.Tensor, batch_size: int = 4) -> ProbeResult:
    """The width score ``ablation-kl`` per query head (each head masked alone on
    ``input_ids``; :func:`prunelab.calib.ablation.ablation_kl`) as a head result
    named ``ablation-kl``, for :func:`head_correlations`."""
    ad = lm.adapter
    units, where = [], []
    for i in range(ad.num_blocks):
        geo = ad.head_geometry(i)
        for h in range(geo.num_heads):
            units.append(Unit(i, ad.attn_projections(i)["o"], head_columns(h, geo.head_dim)))
            where.append((i, h))
    kl = ablation_kl(lm, torch.as_tensor(input_ids), units, batch_size)
    scores = [{"layers": [i], "head": h, "value": float(v)}
              for (i, h), v in zip(where, kl.tolist(), strict=True)]
    return ProbeResult("ablation-kl", {"heads": "query"}, scores, kind="head",
                       num_blocks=ad.num_blocks,
                       meta={"value": "mean per-token KL(p_dense || p_masked), head alone"})
