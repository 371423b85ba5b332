"""Matplotlib figures of probe results (Agg canvas, no global pyplot state).

* layer / sublayer probes: bars of ``value`` per block (sublayer: attention and MLP side by
  side); ``weight-redundancy`` and ``cka`` add a heatmap of their pair entries;
* pair probes: an ``L x L`` heatmap of ``value`` (blank where not measured) on a log
  colour scale when the values span more than a decade (:func:`pair_norm`): a few pairs
  at KL 5-7 next to the first and last blocks would otherwise paint every middle pair
  (0.07-0.6) one colour; the two swap protocols also get one line per diagonal
  ``(i, i + d)`` against ``i`` (:func:`prunelab.probes.swap_plots.plot_swap_diagonals`);
* span probes: bars of ``value`` against the span start; interval probes: a heatmap of
  ``value`` by start and length;
* head probes: a blocks x heads heatmap of ``value`` (``dla`` adds its sublayer bars).

Bars get whiskers from the scores' bootstrap intervals (``ci_low``, ``ci_high``) where
present. Every block index is 0-based. With ``path`` the PNG is written atomically (a temporary file
in the same folder, then :func:`os.replace`).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:  # annotations only: plots never import the probes (no import cycle)
    from prunelab.probes.base import ProbeResult

DPI = 120
CMAP = "viridis"


# ---------------------------------------------------------------- helpers
def direction(result: ProbeResult) -> str:
    """``"lower = more removable"`` or ``"higher = more removable"``."""
    return "lower = more removable" if result.lower_is_removable else "higher = more removable"


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Figure, path: str | Path, dpi: int = DPI) -> Path:
    """Write ``fig`` as PNG to ``path`` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png", dpi=dpi)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _finish(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        save_figure(fig, path)
    return fig


def _block_entries(result: ProbeResult) -> list[dict]:
    """Per-block entries (one layer index, no pair ``kind``)."""
    return [s for s in result.scores
            if len(s["layers"]) == 1 and s.get("kind", "layer") == "layer"]


def _pair_entries(result: ProbeResult, kinds: tuple[str, ...]) -> list[dict]:
    return [s for s in result.scores if len(s["layers"]) == 2 and s.get("kind", "pair") in kinds]


def pair_array(entries: list[dict], size: int) -> np.ndarray:
    """Symmetric ``size x size`` array of the entries' ``value`` (NaN where absent)."""
    mat = np.full((size, size), np.nan)
    for s in entries:
        i, j = s["layers"]
        if s["value"] is not None:
            mat[i, j] = mat[j, i] = float(s["value"])
    return mat


def pair_norm(values: np.ndarray, decade: float = 10.0):
    """The colour scale of a pair heatmap: :class:`~matplotlib.colors.LogNorm` over the
    finite positive values when they are all positive and span more than ``decade``
    (max / min), else a linear :class:`~matplotlib.colors.Normalize` over the finite
    values (min == max widened by 1e-12)."""
    from matplotlib.colors import LogNorm, Normalize

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return Normalize(0.0, 1.0)
    lo, hi = float(v.min()), float(v.max())
    if lo > 0 and hi / lo > decade:
        return LogNorm(lo, hi)
    return Normalize(lo, hi if hi > lo else lo + 1e-12)


def _heatmap(fig: Figure, ax, mat: np.ndarray, label: str, title: str,
             vmin: float | None = None, vmax: float | None = None, colorbar: bool = True,
             norm=None):
    """Draw ``mat`` on ``ax`` (NaN cells shown light grey); returns the image."""
    scale = {"norm": norm} if norm is not None else {"vmin": vmin, "vmax": vmax}
    im = ax.imshow(np.ma.masked_invalid(mat), cmap=_cmap(), origin="upper",
                   interpolation="nearest", **scale)
    ax.set_xlabel(label)
    ax.set_ylabel(label)
    ax.set_title(title)
    _integer_ticks(ax, mat.shape[1], "x")
    _integer_ticks(ax, mat.shape[0], "y")
    if colorbar:
        fig.colorbar(im, ax=ax)
    return im


def _cmap():
    return colormaps[CMAP].with_extremes(bad="#dddddd")


def _integer_ticks(ax, n: int, axis: str, offset: int = 0) -> None:
    step = max(1, int(np.ceil(n / 16)))
    ticks = list(range(0, n, step))
    labels = [str(t + offset) for t in ticks]
    if axis == "x":
        ax.set_xticks(ticks, labels)
    else:
        ax.set_yticks(ticks, labels)


def _no_data(ax, title: str) -> None:
    ax.text(0.5, 0.5, "no scores", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_axis_off()


def error_bars(ax, xs: list[float], entries: list[dict]) -> None:
    """Whiskers from each entry's bootstrap interval (``ci_low``, ``ci_high``; see
    :mod:`prunelab.probes.reliability`) around its ``value`` at ``xs``; entries without an
    interval get none."""
    pts = [(x, s) for x, s in zip(xs, entries, strict=True)
           if s.get("ci_low") is not None and s.get("ci_high") is not None
           and s.get("value") is not None]
    if not pts:
        return
    v = np.array([float(s["value"]) for _, s in pts])
    low = np.array([float(s["ci_low"]) for _, s in pts])
    high = np.array([float(s["ci_high"]) for _, s in pts])
    yerr = np.vstack([np.clip(v - low, 0, None), np.clip(high - v, 0, None)])
    ax.errorbar([x for x, _ in pts], v, yerr=yerr, fmt="none", ecolor="black",
                elinewidth=0.8, capsize=2)


# ---------------------------------------------------------------- per kind
def _layer_bars(ax, result: ProbeResult, title: str) -> None:
    entries = _block_entries(result)
    if not entries:
        _no_data(ax, title)
        return
    x = [s["layers"][0] for s in entries]
    ax.bar(x, [s["value"] for s in entries], color="C0")
    error_bars(ax, x, entries)
    ax.set_xlabel("block (0-based)")
    ax.set_ylabel("value")
    ax.set_title(title)
    _integer_ticks(ax, result.num_blocks or max(x) + 1, "x")


def _sublayer_bars(ax, result: ProbeResult, title: str) -> None:
    parts: dict[str, dict[int, float]] = {}
    found: dict[str, dict[int, dict]] = {}
    for s in result.scores:
        parts.setdefault(s.get("sublayer", "value"), {})[s["layers"][0]] = s["value"]
        found.setdefault(s.get("sublayer", "value"), {})[s["layers"][0]] = s
    if not parts:
        _no_data(ax, title)
        return
    order = [p for p in ("attention", "mlp") if p in parts] + sorted(
        p for p in parts if p not in ("attention", "mlp"))
    width = 0.8 / len(order)
    for k, part in enumerate(order):
        blocks = sorted(parts[part])
        offset = (k - (len(order) - 1) / 2) * width
        ax.bar([b + offset for b in blocks], [parts[part][b] for b in blocks], width=width,
               label=part, color=f"C{k}")
        error_bars(ax, [b + offset for b in blocks], [found[part][b] for b in blocks])
    ax.set_xlabel("block (0-based)")
    ax.set_ylabel("value")
    ax.set_title(title)
    ax.legend()
    n = result.num_blocks or 1 + max(max(p) for p in parts.values())
    _integer_ticks(ax, n, "x")


def _span_bars(ax, result: ProbeResult, title: str) -> None:
    entries = [s for s in result.scores if len(s["layers"]) == 2]
    if not entries:
        _no_data(ax, title)
        return
    lengths = sorted({s["layers"][1] - s["layers"][0] for s in entries})
    ax.bar([s["layers"][0] for s in entries], [s["value"] for s in entries], color="C0")
    error_bars(ax, [s["layers"][0] for s in entries], entries)
    span = ", ".join(str(n) for n in lengths)
    ax.set_xlabel(f"span start l (0-based; span [l, l+{span}))")
    ax.set_ylabel("value")
    ax.set_title(title)
    _integer_ticks(ax, result.num_blocks or 1 + max(s["layers"][0] for s in entries), "x")


def interval_array(result: ProbeResult) -> np.ndarray:
    """``max_length x L`` array: row ``k - 1`` = length ``k``, column = start (NaN if absent)."""
    entries = [s for s in result.scores if len(s["layers"]) == 2]
    max_len = max((s["layers"][1] - s["layers"][0] for s in entries), default=0)
    n = result.num_blocks or max((s["layers"][1] for s in entries), default=0)
    mat = np.full((max_len, n), np.nan)
    for s in entries:
        start, end = s["layers"]
        if s["value"] is not None:
            mat[end - start - 1, start] = float(s["value"])
    return mat


def _interval_heatmap(fig: Figure, ax, result: ProbeResult, title: str) -> None:
    mat = interval_array(result)
    if mat.size == 0:
        _no_data(ax, title)
        return
    im = ax.imshow(np.ma.masked_invalid(mat), cmap=_cmap(), origin="lower", aspect="auto",
                   interpolation="nearest")
    ax.set_xlabel("interval start (0-based; removes [start, start+length))")
    ax.set_ylabel("length (blocks)")
    ax.set_title(title)
    _integer_ticks(ax, mat.shape[1], "x")
    _integer_ticks(ax, mat.shape[0], "y", offset=1)
    fig.colorbar(im, ax=ax, label="value")


def _extra_pairs(result: ProbeResult) -> tuple[np.ndarray, str, str] | None:
    """Pair heatmap of a layer probe that also lists pairs (weight-redundancy, cka)."""
    boundary = _pair_entries(result, ("boundary-pair",))
    if boundary:
        size = max(result.num_blocks + 1, 1 + max(max(s["layers"]) for s in boundary))
        return (pair_array(boundary, size), "boundary (0-based; i = input of block i)",
                f"{result.probe}: boundary pairs")
    pairs = [s for s in result.scores if len(s["layers"]) == 2 and s.get("kind") == "pair"]
    if pairs:
        size = max(result.num_blocks, 1 + max(max(s["layers"]) for s in pairs))
        return pair_array(pairs, size), "block (0-based)", f"{result.probe}: pair similarity"
    return None


# ---------------------------------------------------------------- public
def plot_result(result: ProbeResult, path: str | Path | None = None) -> Figure:
    """A figure of ``result`` (see the module docstring); saved as PNG when ``path`` is set."""
    title = f"{result.probe} ({direction(result)})"
    if result.kind == "pair":
        n = result.num_blocks or 1 + max((max(s["layers"]) for s in result.scores), default=0)
        fig = _new_figure(6.5, 5.5)
        ax = fig.add_subplot()
        mat = pair_array(_pair_entries(result, ("pair",)), n)
        norm = pair_norm(mat)
        _heatmap(fig, ax, mat, "block (0-based)", title + _scale_note(norm), norm=norm)
        return _finish(fig, path)
    if result.kind == "interval":
        fig = _new_figure(8, 4.5)
        _interval_heatmap(fig, fig.add_subplot(), result, title)
        return _finish(fig, path)
    if result.kind == "span":
        fig = _new_figure(8, 4.5)
        _span_bars(fig.add_subplot(), result, title)
        return _finish(fig, path)
    if result.kind == "head":
        return plot_heads(result, path)
    if result.kind == "sublayer":
        fig = _new_figure(max(6.0, 0.35 * result.num_blocks + 2), 4.5)
        _sublayer_bars(fig.add_subplot(), result, title)
        return _finish(fig, path)
    extra = _extra_pairs(result) if result.kind == "layer" else None
    width = max(6.0, 0.3 * result.num_blocks + 2)
    if extra is None:
        fig = _new_figure(width, 4.5)
        _layer_bars(fig.add_subplot(), result, title)
        return _finish(fig, path)
    fig = _new_figure(width + 6, 5)
    ax_bar, ax_map = fig.subplots(1, 2, width_ratios=[width, 6])
    _layer_bars(ax_bar, result, title)
    mat, label, map_title = extra
    _heatmap(fig, ax_map, mat, label, map_title)
    return _finish(fig, path)


def head_array(result: ProbeResult, key: str = "value") -> np.ndarray:
    """``blocks x heads`` array of a head result's ``key`` (NaN where absent)."""
    entries = [s for s in result.scores if "head" in s]
    n = result.num_blocks or 1 + max((s["layers"][0] for s in entries), default=-1)
    heads = 1 + max((s["head"] for s in entries), default=-1)
    mat = np.full((n, heads), np.nan)
    for s in entries:
        if s.get(key) is not None:
            mat[s["layers"][0], s["head"]] = float(s[key])
    return mat


def plot_heads(result: ProbeResult, path: str | Path | None = None) -> Figure:
    """Heatmap of a head result (rows: blocks, columns: query heads, both 0-based); a
    result that also lists sublayer entries (``dla``) gets their bars beside it."""
    title = f"{result.probe} per head ({direction(result)})"
    mat = head_array(result)
    parts = [s for s in result.scores if "sublayer" in s]
    fig = _new_figure(5.0 + 0.25 * mat.shape[1] + (6.0 if parts else 0.0),
                      max(4.0, 0.22 * mat.shape[0] + 1.5))
    axes = fig.subplots(1, 2 if parts else 1, squeeze=False)[0]
    if mat.size == 0:
        _no_data(axes[0], title)
    else:
        im = axes[0].imshow(np.ma.masked_invalid(mat), cmap=_cmap(), aspect="auto",
                            interpolation="nearest")
        axes[0].set_xlabel("head (0-based)")
        axes[0].set_ylabel("block (0-based)")
        axes[0].set_title(title)
        _integer_ticks(axes[0], mat.shape[1], "x")
        _integer_ticks(axes[0], mat.shape[0], "y")
        fig.colorbar(im, ax=axes[0], label="value")
    if parts:
        _sublayer_bars(axes[1], replace(result, scores=parts), f"{result.probe} per sublayer")
    return _finish(fig, path)


def _scale_note(norm) -> str:
    from matplotlib.colors import LogNorm

    return " [log colour]" if isinstance(norm, LogNorm) else ""


def _swap_mats(results: list[ProbeResult]) -> list[np.ndarray]:
    mats = []
    for res in results:
        n = res.num_blocks or 1 + max((max(s["layers"]) for s in res.scores), default=0)
        mats.append(pair_array(_pair_entries(res, ("pair",)), n))
    return mats


def plot_swap_pair(replacement: ProbeResult, interchange: ProbeResult,
                   path: str | Path | None = None) -> Figure:
    """Replacement and interchange heatmaps side by side on one colour scale (one
    colourbar; log when the values span more than a decade, :func:`pair_norm`). The
    diagonals as lines: :func:`prunelab.probes.swap_plots.plot_swap_diagonals`."""
    mats = _swap_mats([replacement, interchange])
    norm = pair_norm(np.concatenate([m.ravel() for m in mats]))
    fig = _new_figure(12, 5.5)
    axes = fig.subplots(1, 2)
    images = [_heatmap(fig, ax, mat, "block (0-based)", name, norm=norm, colorbar=False)
              for ax, mat, name in zip(axes, mats, ("replacement", "interchange"), strict=True)]
    label = "mean KL (value" + (", log scale)" if _scale_note(norm) else ")")
    fig.colorbar(images[0], ax=list(axes), label=label)
    return _finish(fig, path)


def plot_sweep(points: list[dict], dense: dict, path: str | Path | None = None) -> Figure:
    """Depth-pruning curve: test perplexity (log scale) and KL to dense against blocks
    removed, one line per probe x recovery; the dense perplexity as a dashed line."""
    fig = _new_figure(11.0, 4.2)
    ax_ppl, ax_kl = fig.subplots(1, 2)
    lines = sorted({(p["probe"], p["recovery"]) for p in points})
    for probe, rec in lines:
        pts = sorted((p for p in points if p["probe"] == probe and p["recovery"] == rec
                      and p.get("test_perplexity") is not None),
                     key=lambda p: p["removed_count"])
        if not pts:
            continue
        xs = [0] + [p["removed_count"] for p in pts]
        style = "-" if rec == "none" else "--"
        ax_ppl.plot(xs, [dense["perplexity"]] + [p["test_perplexity"] for p in pts], style,
                    marker="o", label=f"{probe} / {rec}")
        ax_kl.plot(xs, [0.0] + [p["test_kl"] for p in pts], style, marker="o",
                   label=f"{probe} / {rec}")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_ppl, ax_kl):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_ppl.axhline(dense["perplexity"], color="grey", linestyle=":", linewidth=1)
    ax_ppl.set_yscale("log")
    ax_ppl.set_xlabel("blocks removed")
    ax_ppl.set_ylabel("test perplexity")
    ax_kl.set_xlabel("blocks removed")
    ax_kl.set_ylabel("KL to dense (mean over positions)")
    ax_ppl.set_title("test perplexity")
    ax_kl.set_title("KL to the dense model")
    if lines:
        ax_kl.legend(fontsize=7, loc="upper left")
    return _finish(fig, path)
