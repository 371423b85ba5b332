"""Pure maths of structured width pruning: unit scores, selection orders, refits, QP.

Everything takes tensors and returns tensors (no model, no hooks). Notation: a consumer
projection (``o_proj`` for heads, ``down_proj`` for FFN channels) has weight ``W`` of shape
``[d_out, d_in]``; its calibration input ``X`` is ``[tokens, d_in]``; a unit owns a set of
input columns of the consumer. Each function cites its method's paper (FLAP, An et al.
2024; Wanda, Sun et al. 2024; SparseGPT, Frantar & Alistarh 2023) or says "derived".
"""

from __future__ import annotations

import torch

from prunelab import linalg
from prunelab.lstsq import ridge_solve


# ---------------------------------------------------------------- per-column scores
def wanda_sp_columns(w: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
    """Wanda-sp (An et al. 2024, "Fluctuation-based Adaptive Structured Pruning", baseline
    after Sun et al. 2024): ``mean_i |W[i, j]| * sqrt(norm_j)`` with ``norm_j = ||X_j||^2``
    (sum of squares over calibration tokens). ``w``: ``[d_out, d_in]``; returns ``[d_in]``."""
    return w.double().abs().mean(0) * sum_sq.double().clamp_min(0).sqrt()


def flap_columns(w: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """FLAP WIFV (An et al. 2024, AAAI): ``var(X_j) * sum_i W[i, j]^2``. Returns ``[d_in]``."""
    return var.double() * w.double().pow(2).sum(0)


def magnitude_columns(w: torch.Tensor) -> torch.Tensor:
    """``sum_i W[i, j]^2``: squared norm of column ``j``'s contribution (weight only)."""
    return w.double().pow(2).sum(0)


def putri_columns(w: torch.Tensor, gram: torch.Tensor, damp: float = 1e-2) -> torch.Tensor:
    """Putri curvature-weighted saliency (derived; SparseGPT-style OBS term, Frantar &
    Alistarh 2023, weighted by output-channel energy): ``s_j = sum_i c_i W_ij^2 / U_jj^2``
    where ``U`` is the upper Cholesky factor of ``(H + lambda I)^{-1}``, ``H = X^T X``,
    ``lambda = damp * mean(diag H)``, and ``c_i = (W H W^T)_ii / mean_k (W H W^T)_kk`` is
    output channel ``i``'s share of the output energy. Returns ``[d_in]``."""
    h = gram.double()
    w = w.double()
    d = h.shape[0]
    lam = damp * float(h.diagonal().mean()) if d else 0.0
    hd = h + torch.eye(d, dtype=h.dtype) * max(lam, 1e-12)
    for _ in range(7):
        chol, info = linalg.cholesky_ex(hd)
        if int(info) == 0:
            break
        lam = max(lam * 10, 1e-8)
        hd = h + torch.eye(d, dtype=h.dtype) * lam
    hinv = torch.cholesky_inverse(chol)
    u = linalg.cholesky(hinv, upper=True)
    energy = ((w @ h) * w).sum(1)
    c = energy / energy.mean().clamp_min(1e-30)
    return (c[:, None] * w.pow(2)).sum(0) / u.diagonal().pow(2)


# ---------------------------------------------------------------- units
def head_units(num_heads: int, num_kv_heads: int, head_dim: int, mode: str = "groups"
               ) -> list[torch.Tensor]:
    """Consumer (``o_proj``) input columns of each unit. ``mode="groups"``: one unit per KV
    group (its ``G = heads / kv`` query heads, columns ``[g G hd, (g+1) G hd)``); a head
    when there is no GQA. ``mode="query"``: one unit per query head (``[h hd, (h+1) hd)``),
    ordered group by group."""
    if mode == "groups":
        span = (num_heads // num_kv_heads) * head_dim
        return [torch.arange(g * span, (g + 1) * span) for g in range(num_kv_heads)]
    return [torch.arange(h * head_dim, (h + 1) * head_dim) for h in range(num_heads)]


def unit_scores(col_scores: torch.Tensor, units: list[torch.Tensor], reduce: str = "sum"
                ) -> torch.Tensor:
    """Sum of the column scores of each unit (``reduce="norm"``: square root of the sum)."""
    s = torch.stack([col_scores[u].sum() for u in units])
    return s.clamp_min(0).sqrt() if reduce == "norm" else s


def outliers(scores: torch.Tensor, z: float = 3.0) -> torch.Tensor:
    """Boolean mask of robust outliers: ``|s - median| > z * 1.4826 * MAD`` (magnitude
    profile: such units are kept, the bulk is pruned). ``z = 0`` marks none."""
    s = scores.double()
    if z <= 0 or s.numel() < 3:
        return torch.zeros_like(s, dtype=torch.bool)
    med = s.median()
    mad = (s - med).abs().median() * 1.4826
    if mad <= 0:
        return torch.zeros_like(s, dtype=torch.bool)
    return (s - med).abs() > z * mad


def removal_order(scores: torch.Tensor, protect: torch.Tensor | None = None) -> list[int]:
    """Unit indices from the first to remove to the last: ascending score, protected
    units after every unprotected one; ties broken by index (deterministic)."""
    s = scores.double().tolist()
    p = protect.tolist() if protect is not None else [False] * len(s)
    return sorted(range(len(s)), key=lambda i: (bool(p[i]), s[i], i))


def standardise(scores: torch.Tensor) -> torch.Tensor:
    """``(s - mean) / std`` within one layer (FLAP's global comparison across layers)."""
    s = scores.double()
    std = s.std() if s.numel() > 1 else torch.tensor(0.0, dtype=s.dtype)
    return (s - s.mean()) / (std if std > 0 else 1.0)


def round_width(width: int, keep: float, multiple: int) -> int:
    """Kept FFN width rounded to the nearest multiple of ``multiple`` within
    ``[multiple, width]`` (``width`` itself when it is smaller than ``multiple``)."""
    if multiple <= 1:
        return int(min(max(round(keep), 1), width))
    k = int(round(keep / multiple)) * multiple
    return int(min(max(k, multiple), width))


# ---------------------------------------------------------------- compensation
def refit_consumer(w: torch.Tensor, gram: torch.Tensor, keep: torch.Tensor,
                   col_sum: torch.Tensor | None = None, tokens: int = 0,
                   damp: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Least-squares refit of a consumer after its input columns outside ``keep`` (``S``;
    removed ``R``) are removed (Putri ``min_mse``; FLAP's bias compensation generalised):
    the dense output ``Y = X W^T`` is re-fitted from the kept inputs. Written as a
    correction of the sliced weight, ``W_S^T + D`` with
    ``(H_SS + lambda I) D = H_SR W_R^T`` (``H = X^T X``; with ``lambda = 0`` exactly
    ``W_S^T = H_SS^{-1} (X^T Y)_S``), so the ridge ``lambda = damp * mean(diag H_SS)``
    shrinks towards plain slicing rather than towards zero (few calibration tokens
    otherwise over-fit). Cholesky with a damping cascade
    (:func:`prunelab.lstsq.ridge_solve`). With ``col_sum`` (``sum_t X_t``) and
    ``tokens`` the fit is affine (a bias change ``db`` is fitted too, unpenalised).
    Returns ``(W_S [d_out, |S|] float64, db [d_out] or None)``."""
    w = w.double()
    h = gram.double()
    keep = torch.as_tensor(keep, dtype=torch.long)
    mask = torch.ones(h.shape[0], dtype=torch.bool)
    mask[keep] = False
    rem = torch.nonzero(mask).flatten()
    hss = h[keep][:, keep]
    rhs = h[keep][:, rem] @ w[:, rem].t()
    if col_sum is None:
        sol = ridge_solve(hss, rhs, damp)
        return (w[:, keep].t() + sol).t().contiguous(), None
    s = col_sum.double()
    n = float(tokens)
    top = torch.cat([hss, s[keep][:, None]], dim=1)
    bottom = torch.cat([s[keep], torch.tensor([n], dtype=h.dtype)])[None, :]
    ata = torch.cat([top, bottom], dim=0)
    atb = torch.cat([rhs, (s[rem] @ w[:, rem].t())[None, :]], dim=0)
    sol = ridge_solve(ata, atb, damp, unpenalised_last=True)
    return (w[:, keep].t() + sol[:-1]).t().contiguous(), sol[-1]


def flap_bias(w: torch.Tensor, removed: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """FLAP bias compensation: ``W[:, removed] mean(X_removed)`` (added to the bias)."""
    removed = torch.as_tensor(removed, dtype=torch.long)
    return w.double()[:, removed] @ mean.double()[removed]


# ---------------------------------------------------------------- CoCurve
def cocurve_features(deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CoCurve (derived): from per-token loss changes ``deltas [units, tokens]`` of
    single-unit ablations, ``a_u = mean_t delta_u[t]`` and the Fisher-style interaction
    ``F_uv = mean_t delta_u[t] delta_v[t]``."""
    d = deltas.double()
    return d.mean(1), d @ d.t() / max(d.shape[1], 1)


def _project(z: torch.Tensor, c: torch.Tensor, budget: float) -> torch.Tensor:
    """Euclidean projection onto ``{z in [0,1]^n : c^T z >= budget}`` (bisection on the
    multiplier of the budget constraint)."""
    p = z.clamp(0, 1)
    if float(c @ p) >= budget:
        return p
    lo, hi = 0.0, 1.0
    while float(c @ (z + hi * c).clamp(0, 1)) < budget:
        hi *= 2
        if hi > 1e12:
            break
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if float(c @ (z + mid * c).clamp(0, 1)) < budget:
            lo = mid
        else:
            hi = mid
    return (z + hi * c).clamp(0, 1)


def solve_box_qp(a: torch.Tensor, f: torch.Tensor, c: torch.Tensor, budget: float,
                 iters: int = 2000, tol: float = 1e-10) -> torch.Tensor:
    """Minimise ``a^T z + 1/2 z^T F z`` s.t. ``c^T z >= budget``, ``0 <= z <= 1``.

    Closed form when the unconstrained minimiser ``z = -F^{-1} a`` is feasible; otherwise
    projected gradient (FISTA, step ``1 / lambda_max(F)``) from the budget-projected
    cheapest-first start. ``z_u = 1`` means unit ``u`` is removed.
    """
    a, f, c = a.double(), f.double(), c.double()
    f = 0.5 * (f + f.t())
    if budget > float(c.sum()) + 1e-9:
        raise ValueError("budget exceeds the total cost of all units")
    try:
        z = linalg.solve(f, -a)
        if bool(((z >= 0) & (z <= 1)).all()) and float(c @ z) >= budget:
            return z
    except RuntimeError:
        pass
    step = 1.0 / max(float(linalg.eigvalsh(f).max()), 1e-12)
    z = _project(torch.zeros_like(a), c, budget)
    y, t = z.clone(), 1.0
    for _ in range(iters):
        z_new = _project(y - step * (a + f @ y), c, budget)
        t_new = 0.5 * (1 + (1 + 4 * t * t) ** 0.5)
        y = z_new + ((t - 1) / t_new) * (z_new - z)
        done = float((z_new - z).abs().max()) < tol
        z, t = z_new, t_new
        if done:
            break
    return z


def greedy_round(z: torch.Tensor, c: torch.Tensor, budget: float, allowed=None,
                 a: torch.Tensor | None = None, f: torch.Tensor | None = None) -> list[int]:
    """Round a relaxed QP solution to units to remove until their cost reaches ``budget``.

    Units the relaxation removes fully (``z_u ~ 1``) are taken first; the rest of the
    budget is filled greedily by the smallest marginal quadratic cost per parameter,
    ``(a_u + F_uu / 2 + sum_{v chosen} F_uv) / c_u`` (ties: larger ``z_u``). Without
    ``a`` / ``F`` the order is decreasing ``z``. ``allowed(chosen, u)`` may veto a unit
    (e.g. the last KV group of a block)."""
    n = len(z)
    chosen: list[int] = []
    total = 0.0

    def take(u):
        nonlocal total
        chosen.append(u)
        total += float(c[u])

    for u in sorted(range(n), key=lambda u: (-float(z[u]), float(c[u]), u)):
        if float(z[u]) < 1 - 1e-6 or total >= budget - 1e-9:
            break
        if allowed is None or allowed(chosen, u):
            take(u)
    while total < budget - 1e-9:
        cands = [u for u in range(n) if u not in chosen
                 and (allowed is None or allowed(chosen, u))]
        if not cands:
            break
        if a is None or f is None:
            u = max(cands, key=lambda u: (float(z[u]), -float(c[u]), -u))
        else:
            def marginal(u):
                extra = float(f[u, chosen].sum()) if chosen else 0.0
                return (float(a[u]) + 0.5 * float(f[u, u]) + extra) / max(float(c[u]), 1e-12)
            u = min(cands, key=lambda u: (marginal(u), -float(z[u]), u))
        take(u)
    return chosen


def quadratic_cost(a: torch.Tensor, f: torch.Tensor, chosen: list[int]) -> float:
    """``a^T z + 1/2 z^T F z`` for the 0/1 vector of ``chosen`` units."""
    z = torch.zeros(len(a), dtype=torch.float64)
    z[chosen] = 1.0
    return float(a.double() @ z + 0.5 * z @ f.double() @ z)
