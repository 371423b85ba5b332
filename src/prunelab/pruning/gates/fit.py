"""The maths of static sublayer gates (CausalGate), on tensors only: bootstrap rounds of the
measured importances, their exponential moving average, the pairwise ranking loss, the
gate fit, and the budget cover. No model in here; :mod:`prunelab.pruning.gates.config` feeds it.

Notation: ``S`` sublayers, ``N`` calibration windows, ``R`` rounds. ``kl[s, n]`` is the
KL to the dense model of window ``n`` with sublayer ``s`` zeroed.

* Rounds (:func:`bootstrap_rounds`): ``R = 1`` is the mean over all windows. ``R > 1``:
  round ``r`` draws ``N`` windows with replacement (``torch.Generator`` seeded with
  ``seed``) and takes the mean KL over them, ``k_r[s]``.
* EMA (:func:`ema_smooth`): ``m_1 = k_1``, ``m_r = decay * m_{r-1} + (1 - decay) * k_r``;
  the importance is ``m_R``. Over exchangeable bootstrap rounds this is a weighted bootstrap
  mean (expectation: the full-sample mean); it smooths the resampling noise.
* Target (:func:`log_target`): ``t = (log(m + eps) - mu) / sd`` with ``eps = 1e-9 max(m)
  + 1e-30`` and ``mu, sd`` the mean and standard deviation of ``log(m + eps)`` over the
  sublayers (``sd = 1`` when they are all equal).
* Ranking loss (:func:`ranking_loss`): over the ordered pairs ``P = {(i, j) : m_i > m_j}``
  (ties left out), ``l(g) = mean_{(i, j) in P} log(1 + exp(-(g_i - g_j) / tau))``; zero
  when ``P`` is empty.
* Objective (:func:`gate_objective`): ``J(g) = mean_s (g_s - t_s)^2 + w * l(g)``, fitted
  from ``g = 0`` (every gate equal) with Adam, float64, ``steps`` full-batch steps.
* Budget cover (:func:`cover_budget`): take items in ascending ``key`` until their cost
  reaches ``need``, then drop, most important (highest key) first, every taken item the
  cover does not need; the result reaches ``need`` and no single item can be left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def bootstrap_rounds(kl: torch.Tensor, rounds: int, seed: int = 0) -> torch.Tensor:
    """``[R, S]`` round importances from per-window KLs ``kl`` ``[S, N]`` (module doc)."""
    kl = kl.double()
    if rounds <= 1:
        return kl.mean(1, keepdim=True).t()
    g = torch.Generator().manual_seed(int(seed))
    n = kl.shape[1]
    picks = torch.randint(0, n, (rounds, n), generator=g)
    return torch.stack([kl[:, p].mean(1) for p in picks])


def ema_smooth(rounds: torch.Tensor, decay: float) -> torch.Tensor:
    """EMA of the rows of ``rounds`` ``[R, S]``: ``m_1 = k_1``, ``m_r = decay m_{r-1} +
    (1 - decay) k_r``; returns ``m_R`` ``[S]``."""
    m = rounds[0].double().clone()
    for k in rounds[1:]:
        m = decay * m + (1.0 - decay) * k.double()
    return m


@dataclass(frozen=True)
class LogScale:
    """``t = (log(m + eps) - mu) / sd``: the map from importances to gate targets."""

    eps: float
    mu: float
    sd: float

    def to_log_importance(self, gates: torch.Tensor) -> torch.Tensor:
        """``log(importance + eps)`` that a gate value stands for: ``mu + sd * g``."""
        return self.mu + self.sd * gates.double()


def log_target(importance: torch.Tensor) -> tuple[torch.Tensor, LogScale]:
    """Standardised log importances ``t`` ``[S]`` and the scale that made them."""
    m = importance.double().clamp_min(0.0)
    eps = 1e-9 * float(m.max()) + 1e-30 if m.numel() else 1e-30
    logm = torch.log(m + eps)
    mu = float(logm.mean()) if m.numel() else 0.0
    sd = float(logm.std(unbiased=False)) if m.numel() > 1 else 0.0
    sd = sd if sd > 0 else 1.0
    return (logm - mu) / sd, LogScale(eps, mu, sd)


def ordered_pairs(importance: torch.Tensor) -> torch.Tensor:
    """``[P, 2]`` index pairs ``(i, j)`` with ``importance[i] > importance[j]``."""
    m = importance.double()
    mask = m[:, None] > m[None, :]
    return mask.nonzero()


def ranking_loss(gates: torch.Tensor, importance: torch.Tensor, tau: float = 1.0,
                 pairs: torch.Tensor | None = None) -> torch.Tensor:
    """Pairwise logistic ranking loss ``mean_{m_i > m_j} log(1 + exp(-(g_i - g_j)/tau))``
    (0 without ordered pairs); differentiable in ``gates``."""
    pairs = ordered_pairs(importance) if pairs is None else pairs
    if pairs.numel() == 0:
        return gates.sum() * 0.0
    diff = (gates[pairs[:, 0]] - gates[pairs[:, 1]]) / tau
    return torch.nn.functional.softplus(-diff).mean()


def gate_objective(gates: torch.Tensor, target: torch.Tensor, importance: torch.Tensor,
                   rank_weight: float, tau: float = 1.0,
                   pairs: torch.Tensor | None = None) -> torch.Tensor:
    """``J(g) = mean_s (g_s - t_s)^2 + rank_weight * ranking_loss(g)``."""
    fit = (gates - target).square().mean()
    return fit + rank_weight * ranking_loss(gates, importance, tau, pairs)


@dataclass(frozen=True)
class GateFit:
    """Fitted gates ``[S]``, their targets, the final objective and the log scale."""

    gates: torch.Tensor
    target: torch.Tensor
    importance: torch.Tensor
    objective: float
    scale: LogScale


def fit_gates(importance: torch.Tensor, *, rank_weight: float = 1.0, tau: float = 1.0,
              steps: int = 300, lr: float = 0.05) -> GateFit:
    """Minimise :func:`gate_objective` from ``g = 0`` with Adam (float64, full batch)."""
    m = importance.double()
    target, scale = log_target(m)
    pairs = ordered_pairs(m)
    g = torch.zeros_like(target, requires_grad=True)
    opt = torch.optim.Adam([g], lr=lr)
    with torch.enable_grad():
        for _ in range(int(steps)):
            opt.zero_grad()
            loss = gate_objective(g, target, m, rank_weight, tau, pairs)
            loss.backward()
            opt.step()
    with torch.no_grad():
        final = float(gate_objective(g, target, m, rank_weight, tau, pairs))
    return GateFit(g.detach(), target, m, final, scale)


def cover_budget(keys: Sequence[float], costs: Sequence, need) -> list[int]:
    """Indices (ascending) whose total cost reaches ``need``: greedy in ascending ``keys``
    (ties by index), then drop taken items from the highest key down while the rest still
    reach ``need``. ``need <= 0``: none. Raises ``ValueError`` if all of them fall short.
    Costs and ``need`` are compared exactly (ints and a ``Fraction`` stay exact)."""
    if need <= 0:
        return []
    order = sorted(range(len(keys)), key=lambda s: (float(keys[s]), s))
    taken, total = [], 0
    for s in order:
        if total >= need:
            break
        taken.append(s)
        total += costs[s]
    if total < need:
        raise ValueError(f"all items cost {total}, short of {need}")
    for s in sorted(taken, key=lambda s: (-float(keys[s]), -s)):
        if total - costs[s] >= need:
            taken.remove(s)
            total -= costs[s]
    return sorted(taken)
