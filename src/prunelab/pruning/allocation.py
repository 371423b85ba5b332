"""Per-block (layerwise) sparsity allocation.

A "layer" here is one transformer block. Every allocator returns one sparsity per block in
``[0, 1)`` whose mean weighted by ``weights`` (parameter counts per block; default equal)
equals ``target``: each ends with :func:`rescale_to_target`. Sources: OWL (Yin et al.
2024, "Outlier Weighed Layerwise Sparsity"); PALS (derived in prunelab: sparsity from
the 99th-percentile input activation of each block); linear depth ramps (a depth schedule).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from prunelab.errors import ConfigError

__all__ = ["outlier_ratio", "owl", "pals", "ramp", "rescale_to_target", "uniform"]


def _weights(n: int, weights: Sequence[float] | None) -> np.ndarray:
    if weights is None:
        return np.ones(n)
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError(f"allocation weights must be {n} non-negative numbers, not all zero")
    return w


def _minmax(values: Sequence[float]) -> np.ndarray:
    """Min-max normalise to ``[0, 1]``; all zeros when the values are all equal."""
    a = np.asarray(values, dtype=np.float64).reshape(-1)
    if a.size == 0 or not np.all(np.isfinite(a)):
        raise ConfigError("allocation statistics must be a non-empty list of finite numbers")
    span = a.max() - a.min()
    return (a - a.min()) / span if span > 0 else np.zeros_like(a)


def rescale_to_target(
    sparsities: Sequence[float],
    weights: Sequence[float] | None,
    target: float,
    low: float = 0.0,
    high: float = 0.99,
) -> list[float]:
    """Shift ``sparsities`` by one constant ``c`` so that ``sum_l w_l clip(s_l + c, low, high)
    / sum_l w_l == target`` (to 1e-9), returning the clipped, shifted values.

    ``weights``: per-block parameter counts (``None`` = equal). The weighted mean of the
    clipped values is monotone in ``c``: bisection brackets it, then ``c`` is solved exactly
    on the set of unclipped blocks. Needs ``0 <= low <= target <= high < 1``.
    """
    t = float(target)
    if not (0.0 <= low <= t <= high < 1.0):
        raise ConfigError(f"target sparsity {target!r} must lie in [{low}, {high}] within [0, 1)")
    s = np.asarray(sparsities, dtype=np.float64).reshape(-1)
    if s.size == 0 or not np.all(np.isfinite(s)):
        raise ConfigError("sparsities must be a non-empty list of finite numbers")
    w = _weights(s.size, weights)
    total = w.sum()

    def mean_at(c: float) -> float:
        return float(np.dot(w, np.clip(s + c, low, high)) / total)

    if abs(mean_at(0.0) - t) <= 1e-12:
        return [float(v) for v in np.clip(s, low, high)]
    lo_c, hi_c = low - s.max(), high - s.min()  # mean_at(lo_c) == low, mean_at(hi_c) == high
    for _ in range(200):
        mid = 0.5 * (lo_c + hi_c)
        if mean_at(mid) < t:
            lo_c = mid
        else:
            hi_c = mid
    c = 0.5 * (lo_c + hi_c)
    shifted = s + c
    free = (shifted > low) & (shifted < high)
    if free.any() and w[free].sum() > 0:
        clipped = np.clip(shifted, low, high)
        fixed = float(np.dot(w[~free], clipped[~free]))
        c_exact = (t * total - fixed - float(np.dot(w[free], s[free]))) / w[free].sum()
        trial = np.clip(s + c_exact, low, high)
        if abs(float(np.dot(w, trial)) / total - t) <= abs(mean_at(c) - t):
            c = c_exact
    return [float(v) for v in np.clip(s + c, low, high)]


def uniform(num_layers: int, target: float,
            weights: Sequence[float] | None = None) -> list[float]:
    """The same sparsity ``target`` for each of ``num_layers`` blocks."""
    if num_layers < 1:
        raise ConfigError(f"num_layers={num_layers} must be >= 1")
    return rescale_to_target([float(target)] * num_layers, weights, target)


def outlier_ratio(scores_list: Sequence[torch.Tensor], m: float = 5.0) -> float:
    """OWL's layerwise outlier distribution entry for one block: the fraction of scores
    greater than ``m`` times the mean score of their own matrix (means per matrix, counts
    and sizes summed over the block's matrices). ``scores_list``: the block's Wanda score
    matrices (any shapes). Default ``m = 5`` (Yin et al. 2024)."""
    count, total = 0, 0
    for scores in scores_list:
        x = scores.detach().double()
        if x.numel() == 0:
            continue
        count += int((x > m * x.mean()).sum())
        total += x.numel()
    if total == 0:
        raise ConfigError("outlier_ratio needs at least one non-empty score matrix")
    return count / total


def owl(outlier_ratios: Sequence[float], target: float, lam: float = 0.08,
        weights: Sequence[float] | None = None) -> list[float]:
    """OWL sparsities: more outliers -> less sparsity.

    ``outlier_ratios``: ``D_l`` per block (see :func:`outlier_ratio`). ``D`` is min-max
    normalised to ``[0, 2 lam]`` (``D~``), then ``s_l = 1 - (D~_l - mean(D~) + 1 - target)
    = target - (D~_l - mean(D~))`` (unweighted mean, as in the paper); finally
    :func:`rescale_to_target` makes the ``weights``-weighted mean exactly ``target``.
    Default ``lam = 0.08`` (Yin et al. 2024).
    """
    d = _minmax(outlier_ratios) * (2.0 * lam)
    s = float(target) - (d - d.mean())
    return rescale_to_target(s, weights, target)


def pals(act_p99: Sequence[float], target: float, delta: float = 0.05, tol: float = 1e-4,
         weights: Sequence[float] | None = None, max_iter: int = 1000) -> list[float]:
    """PALS sparsities (derived): blocks with larger activations get less sparsity.

    ``act_p99``: per block, the 99th percentile of ``|activation|`` entering its linears.
    ``z = minmax(a)``, ``s_l = target + delta (1 - 2 z_l)``, then repeat "re-centre to mean
    ``target`` and clip to ``[target - delta, target + delta]``" until ``|mean - target| <
    tol`` (unweighted mean; at most ``max_iter`` rounds); finally :func:`rescale_to_target`
    makes the ``weights``-weighted mean exactly ``target`` (which may move values slightly
    past the clip box when weights are unequal). Defaults ``delta = 0.05``, ``tol = 1e-4``.
    """
    t = float(target)
    z = _minmax(act_p99)
    s = t + delta * (1.0 - 2.0 * z)
    lo, hi = max(t - delta, 0.0), min(t + delta, 0.99)
    for _ in range(max_iter):
        s = np.clip(s - (s.mean() - t), lo, hi)
        if abs(s.mean() - t) < tol:
            break
    return rescale_to_target(s, weights, t)


def ramp(num_layers: int, target: float, span: float = 0.1, increasing: bool = True,
         weights: Sequence[float] | None = None) -> list[float]:
    """Linear depth ramp from ``target - span`` (first block) to ``target + span`` (last
    block), or the reverse with ``increasing=False``; mean ``target`` (then
    :func:`rescale_to_target` for the ``weights``-weighted mean and the ``[0, 0.99]``
    bounds). One block gets ``target``."""
    if num_layers < 1:
        raise ConfigError(f"num_layers={num_layers} must be >= 1")
    s = np.linspace(target - span, target + span, num_layers) if num_layers > 1 else np.array(
        [float(target)])
    if not increasing:
        s = s[::-1]
    return rescale_to_target(s, weights, target)
