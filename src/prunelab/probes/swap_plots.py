"""The swap probes' diagonals as lines: each measured diagonal ``(i, i + d)`` of the
replacement and interchange results against the block index ``i``, both protocols on one
axis, with their bootstrap intervals (:mod:`prunelab.probes.reliability`) as bands and the
decision rule's threshold (0.10, :func:`prunelab.probes.comparison.rule_for`) dotted. Block
indices are 0-based."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from prunelab.probes.plots import _finish, _new_figure, _no_data, _pair_entries, pair_norm

if TYPE_CHECKING:
    from prunelab.probes.base import ProbeResult


def diagonal_offsets(result: ProbeResult) -> list[int]:
    """The measured diagonals ``d = j - i`` of a pair result (``[1]`` for ``--window 1``)."""
    return sorted({abs(s["layers"][1] - s["layers"][0])
                   for s in _pair_entries(result, ("pair",))} - {0})


def _diagonal_axis(ax, results: dict[str, ProbeResult], d: int, threshold: float) -> None:
    """One diagonal ``(i, i + d)``: value against ``i`` per protocol, bootstrap band where
    present, the decision-rule threshold dotted; log y when the values span a decade."""
    allv = []
    for k, (name, res) in enumerate(results.items()):
        entries = sorted((s for s in _pair_entries(res, ("pair",))
                          if abs(s["layers"][1] - s["layers"][0]) == d
                          and s.get("value") is not None),
                         key=lambda s: min(s["layers"]))
        if not entries:
            continue
        xs = [min(s["layers"]) for s in entries]
        ys = [float(s["value"]) for s in entries]
        allv += ys
        ax.plot(xs, ys, marker="o", markersize=3, color=f"C{k}", label=name)
        band = [(x, s) for x, s in zip(xs, entries, strict=True)
                if s.get("ci_low") is not None and s.get("ci_high") is not None]
        if band:
            ax.fill_between([x for x, _ in band], [float(s["ci_low"]) for _, s in band],
                            [float(s["ci_high"]) for _, s in band], color=f"C{k}",
                            alpha=0.2, linewidth=0)
    if not allv:
        _no_data(ax, f"pairs (i, i+{d})")
        return
    if isinstance(pair_norm(np.array(allv)), LogNorm):
        ax.set_yscale("log")
    ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel(f"block i (0-based; pair (i, i+{d}))")
    ax.set_ylabel("mean KL (value)")
    ax.set_title(f"diagonal d = {d}: pairs (i, i+{d})")
    ax.legend(fontsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_swap_diagonals(results: dict[str, ProbeResult], path: str | Path | None = None,
                        threshold: float = 0.10) -> Figure:
    """Each measured diagonal ``(i, i + d)`` of the pair results (name -> result, e.g.
    replacement and interchange) as lines against ``i`` on one axis per ``d``, with the
    bootstrap intervals (``ci_low``/``ci_high``, :mod:`prunelab.probes.reliability`) as
    bands and the decision rule's threshold dotted."""
    offsets = sorted({d for r in results.values() for d in diagonal_offsets(r)}) or [1]
    cols = min(2, len(offsets))
    rows = -(-len(offsets) // cols)
    fig = _new_figure(6.0 * cols, 3.4 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, d in zip(axes, offsets, strict=False):
        _diagonal_axis(ax, results, d, threshold)
    for ax in axes[len(offsets):]:
        ax.set_axis_off()
    return _finish(fig, path)
