"""How far a probe's ranking can be trusted: bootstrap intervals over calibration windows
and split-half rank stability (pure functions; numpy only).

A probe's value is a mean over N calibration windows, so its sampling error is that of a
mean over windows. Every probe with per-window values stores them in its scores
(``windows`` and, for the KL probes, ``windows_all_positions``; replacement:
``windows_i_from_j`` / ``windows_j_from_i``, its value being the larger of the two means;
contraction: ``windows_rho``, its value ``|mean - 1|``); :func:`window_table` reads them
back as an array ``[scores, parts, windows]`` and a rule (``combine``) turning the parts'
means into the value.

* **Intervals** (:func:`bootstrap_intervals`): percentile bootstrap (Efron & Tibshirani,
  "An Introduction to the Bootstrap", 1993, ch. 13) of each score's value, resampling the
  N windows with replacement. One resample of window indices is shared by every score of a
  replicate (:func:`window_counts`), so a replicate is a whole probe result on a resampled
  calibration set and rankings or removal sets can be re-derived from it.
* **Rank stability** (:func:`split_half_stability`): the windows are split at random into
  two halves (many seeded splits); the Spearman correlation between the rankings the two
  halves give, averaged over the splits, is the reliability of a ranking from N/2 windows;
  the Spearman-Brown formula (Spearman 1910; Brown 1910) ``r_k = k r / (1 + (k - 1) r)``
  with ``k = N / (N/2)`` corrects it to the full N (:func:`spearman_brown`), and its
  inverse, the prophecy formula, gives the windows needed for a target (:func:`windows_for`).

The ranking is the one users act on (:func:`ranked_values`): per block for layer,
sublayer and pair probes (:meth:`ProbeResult.layer_values`: pair probes
``r(l) = min(d(l, l-1), d(l, l+1))``, sublayer probes the sum of the two branches), and the
spans / intervals themselves for span and interval probes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from prunelab.errors import PrunelabError
from prunelab.probes.base import ProbeResult
from prunelab.probes.interval import best_interval_pairs

LEVEL = 0.95
TARGET = 0.9
SPLITS = 100
COMBINES = ("mean", "max", "abs-1")


# ---------------------------------------------------------------- per-window tables
@dataclass
class WindowTable:
    """Per-window values of a result's scores: ``data[s, p, w]`` for score
    ``result.scores[index[s]]``, part ``p``, window ``w``; the value of a score is
    ``combine`` of its parts' means (``mean``: one part; ``max``: the larger part mean;
    ``abs-1``: ``|mean - 1|``)."""

    index: list[int]
    data: np.ndarray
    combine: str

    @property
    def windows(self) -> int:
        return self.data.shape[-1]


def _parts(score: dict, all_positions: bool) -> tuple[list, str] | None:
    suffix = "_all_positions" if all_positions else ""
    if f"windows_i_from_j{suffix}" in score:
        return [score[f"windows_i_from_j{suffix}"], score[f"windows_j_from_i{suffix}"]], "max"
    if "windows_rho" in score:
        return ([score["windows_rho"]], "abs-1") if not all_positions else None
    if f"windows{suffix}" in score:
        return [score[f"windows{suffix}"]], "mean"
    return None


def window_table(result: ProbeResult, all_positions: bool = False) -> WindowTable | None:
    """The per-window values of ``result`` (``all_positions``: of
    ``value_all_positions``), or ``None`` when no score has them. Scores without them (a
    resumed partial from an older version) are left out; so are scores whose window count
    differs from the first one's."""
    index, rows, combine = [], [], None
    for k, score in enumerate(result.scores):
        got = _parts(score, all_positions)
        if got is None:
            continue
        parts, how = got
        if rows and (np.shape(parts) != rows[0].shape or how != combine):
            continue
        index.append(k)
        rows.append(np.asarray(parts, dtype=np.float64))
        combine = how
    if not rows or rows[0].shape[-1] < 1:
        return None
    return WindowTable(index, np.stack(rows), combine)


def combine_means(means: np.ndarray, combine: str = "mean") -> np.ndarray:
    """Values from part means ``[..., parts]`` -> ``[...]`` (see :class:`WindowTable`)."""
    if combine == "max":
        return means.max(-1)
    if combine == "abs-1":
        return np.abs(means[..., 0] - 1.0)
    if combine == "mean":
        return means[..., 0]
    raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")


def _as_parts(per_window: np.ndarray) -> np.ndarray:
    a = np.asarray(per_window, dtype=np.float64)
    if a.ndim == 2:
        return a[:, None, :]
    if a.ndim != 3:
        raise ValueError(f"per_window must be [scores, windows] or [scores, parts, windows], "
                         f"got shape {a.shape}")
    return a


# ---------------------------------------------------------------- bootstrap
def window_counts(windows: int, n: int, seed: int) -> np.ndarray:
    """``[n, windows]``: how often each window is drawn in each of ``n`` resamples (with
    replacement, ``windows`` draws each; numpy's PCG64 seeded with ``seed``). The same
    arguments give the same resamples, so results of one probe session on the same
    windows are resampled alike (paired)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, windows, size=(n, windows))
    return np.stack([np.bincount(row, minlength=windows) for row in idx]) if n else \
        np.zeros((0, windows), dtype=np.int64)


def bootstrap_values(per_window, n: int = 200, seed: int = 0,
                     combine: str = "mean") -> np.ndarray:
    """``[n, scores]``: every score's value on each of ``n`` resamples of the windows, one
    resample shared by all scores. ``per_window``: ``[scores, windows]`` or ``[scores,
    parts, windows]`` (see :class:`WindowTable`)."""
    data = _as_parts(per_window)
    counts = window_counts(data.shape[-1], n, seed).astype(np.float64)
    means = np.einsum("spw,nw->nsp", data, counts) / data.shape[-1]
    return combine_means(means, combine)


def bootstrap_intervals(per_window, n: int = 200, seed: int = 0, level: float = LEVEL,
                        combine: str = "mean") -> tuple[np.ndarray, np.ndarray]:
    """Percentile bootstrap interval of each score's value over the windows: ``(low,
    high)``, each ``[scores]``, the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of
    :func:`bootstrap_values`. ``n = 0`` or one window: the value itself at both ends."""
    data = _as_parts(per_window)
    if n < 1 or data.shape[-1] < 2:
        value = combine_means(data.mean(-1), combine)
        return value.copy(), value.copy()
    reps = bootstrap_values(data, n, seed, combine)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(reps, [tail, 1.0 - tail], axis=0)
    return low, high


# ---------------------------------------------------------------- stability
def spearman(x, y) -> float:
    """Spearman's rank correlation of two equal-length sequences (average ranks for ties;
    NaN when either is constant or shorter than 3)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3:
        return float("nan")
    rx, ry = rankdata(x) - (len(x) + 1) / 2, rankdata(y) - (len(y) + 1) / 2
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else float("nan")


def spearman_brown(r: float, factor: float = 2.0) -> float:
    """Reliability of a measurement ``factor`` times as long as one of reliability ``r``:
    ``factor * r / (1 + (factor - 1) * r)`` (Spearman-Brown; -1 where the denominator is
    not positive, r near -1)."""
    den = 1.0 + (factor - 1.0) * r
    return factor * r / den if den > 0 else -1.0


def windows_for(r: float | None, windows: int, target: float = TARGET) -> int | None:
    """Windows at which a ranking of reliability ``r`` at ``windows`` windows would reach
    ``target``, by the Spearman-Brown prophecy formula: the length factor
    ``m = target (1 - r) / (r (1 - target))``, windows ``ceil(m * windows)``. ``r >=
    target``: ``windows`` (already there); ``r <= 0`` or unknown: ``None`` (not reachable
    by adding windows)."""
    if r is None or not math.isfinite(r) or r <= 0:
        return None
    if r >= target:
        return windows
    m = target * (1.0 - r) / (r * (1.0 - target))
    return math.ceil(round(m * windows, 9))


def split_half_stability(per_window, rank_values: Callable[[np.ndarray], list] | None = None,
                         splits: int = SPLITS, seed: int = 0,
                         combine: str = "mean") -> dict | None:
    """Split-half rank stability of the scores in ``per_window`` (``[scores, windows]`` or
    ``[scores, parts, windows]``).

    Each of ``splits`` seeded splits permutes the windows and takes two disjoint halves of
    ``h = N // 2`` windows; ``rank_values`` maps the scores' values on a half to the values
    that are ranked (default: the values themselves); Spearman between the two halves,
    averaged over the splits (NaN splits skipped), is ``half``; ``stability`` is
    :func:`spearman_brown` of it with factor ``N / h`` (2 for even N). ``None`` with fewer
    than 2 windows or no finite split."""
    data = _as_parts(per_window)
    n_win = data.shape[-1]
    if n_win < 2:
        return None
    rank_values = rank_values or (lambda v: list(v))
    h = n_win // 2
    rng = np.random.default_rng(seed)
    rs = []
    for _ in range(splits):
        perm = rng.permutation(n_win)
        a = rank_values(combine_means(data[:, :, perm[:h]].mean(-1), combine))
        b = rank_values(combine_means(data[:, :, perm[h:2 * h]].mean(-1), combine))
        both = [(x, y) for x, y in zip(a, b, strict=True) if _finite(x) and _finite(y)]
        r = spearman([x for x, _ in both], [y for _, y in both]) if both else float("nan")
        if math.isfinite(r):
            rs.append(r)
    if not rs:
        return None
    half = float(np.mean(rs))
    return {"half": half, "stability": spearman_brown(half, n_win / h), "splits": len(rs),
            "half_windows": h}


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


# ---------------------------------------------------------------- on probe results
def ranking_note(result: ProbeResult) -> str:
    """Which ranking the stability of ``result`` is about (see the module docstring)."""
    if result.kind == "pair":
        return "per block r(l) = min(d(l, l-1), d(l, l+1))"
    if result.kind == "sublayer":
        return "per block, attention + mlp"
    if result.kind in ("span", "interval"):
        return f"the {result.kind}s themselves"
    return "per block"


def replicate_result(result: ProbeResult, index: list[int], values) -> ProbeResult:
    """``result`` with only the scores ``index`` (window-table order), their ``value``
    replaced by ``values`` (e.g. one bootstrap replicate); an interval probe's
    ``best_interval_pairs`` is re-derived from them, a span probe's ``best_span`` left out
    (the summary then takes the lowest span)."""
    scores = [dict(result.scores[k], value=float(v)) for k, v in zip(index, values,
                                                                     strict=True)]
    meta = {}
    if result.kind == "interval":
        max_len = result.config.get("max_length") or max(
            (s["layers"][1] - s["layers"][0] for s in scores), default=0)
        costs = {tuple(s["layers"]): s["value"] for s in scores}
        meta["best_interval_pairs"] = best_interval_pairs(costs, 2 * max_len)
    return ProbeResult(result.probe, result.config, scores, kind=result.kind,
                       lower_is_removable=result.lower_is_removable,
                       num_blocks=result.num_blocks, meta=meta)


def ranked_values(result: ProbeResult, index: list[int], values) -> list[float | None]:
    """The values that are ranked when the scores ``index`` of ``result`` take ``values``:
    per block (:meth:`ProbeResult.layer_values`), or the spans' / intervals' own values
    (signed so that low = removable)."""
    if result.kind in ("span", "interval"):
        sign = 1.0 if result.lower_is_removable else -1.0
        return [sign * float(v) for v in values]
    return replicate_result(result, index, values).layer_values()


def add_reliability(result: ProbeResult, bootstrap: int = 200, seed: int = 0,
                    splits: int = SPLITS, level: float = LEVEL) -> dict | None:
    """Add the intervals (``ci_low``, ``ci_high``; ``ci_low_all_positions``,
    ``ci_high_all_positions``) to every score of ``result`` with per-window values
    (``bootstrap`` resamples; 0: none) and the stability to ``result.meta["reliability"]``:
    ``stability`` (and ``stability_all_positions``), ``windows``, ``windows_for_0.9`` (and
    ``_all_positions``; ``None``: not reachable), ``bootstrap``, ``seed``, ``level``,
    ``splits``, ``ranking``. Returns that dict, or ``None`` when the result has no
    per-window values (nothing is added)."""
    info: dict = {}
    for all_pos, suffix in ((False, ""), (True, "_all_positions")):
        table = window_table(result, all_pos)
        if table is None:
            continue
        if bootstrap > 0:
            low, high = bootstrap_intervals(table.data, bootstrap, seed, level, table.combine)
            for k, lo, hi in zip(table.index, low, high, strict=True):
                result.scores[k][f"ci_low{suffix}"] = float(lo)
                result.scores[k][f"ci_high{suffix}"] = float(hi)
        split = split_half_stability(
            table.data, lambda v, t=table: ranked_values(result, t.index, v), splits, seed,
            table.combine)
        stability = split["stability"] if split else None
        info[f"stability{suffix}"] = stability
        info.setdefault("windows", table.windows)
        info[f"windows_for_0.9{suffix}"] = windows_for(stability, table.windows)
    if not info:
        return None
    order = ["stability", "stability_all_positions", "windows", "windows_for_0.9",
             "windows_for_0.9_all_positions"]
    info = {k: info[k] for k in order if k in info}
    info.update({"bootstrap": bootstrap, "seed": seed, "level": level, "splits": splits,
                 "ranking": ranking_note(result)})
    result.meta["reliability"] = info
    return info


def selection_stability(result: ProbeResult, pick: Callable[[ProbeResult], list[int]],
                        chosen: list[int], n: int = 200, seed: int = 0) -> dict | None:
    """How stable a removal set chosen from ``result`` is under the bootstrap of windows:
    ``pick`` (result -> blocks) is re-run on ``n`` replicates (:func:`replicate_result`
    over :func:`bootstrap_values`); ``share_same`` is the share of replicates giving the set
    ``chosen``, ``inclusion[b]`` the share including block ``b``. A replicate where
    ``pick`` raises a :class:`~prunelab.errors.PrunelabError` counts as different. ``None``
    when some score has no per-window values, with fewer than 2 windows, or ``n < 1``."""
    table = window_table(result)
    if table is None or len(table.index) != len(result.scores) or n < 1 \
            or table.windows < 2:
        return None
    target = sorted(chosen)
    same, counts = 0, [0] * result.num_blocks
    for values in bootstrap_values(table.data, n, seed, table.combine):
        try:
            got = sorted(pick(replicate_result(result, table.index, values)))
        except PrunelabError:
            continue
        same += got == target
        for b in got:
            counts[b] += 1
    return {"share_same": same / n, "inclusion": [c / n for c in counts], "bootstrap": n,
            "seed": seed, "windows": table.windows}
