"""Which directions of the residual stream to keep: activation PCA (SliceGPT, Ashkboos et
al., ICLR 2024), a sensitivity-aware subspace, and kept widths under a parameter budget.

Objective (second order in the output, Fisher metric). Let ``h`` be the residual stream at
a boundary, ``C = E[h h^T]`` and ``F = E[g g^T]`` the Fisher of the model's output
distribution in ``h`` (``g = d log p(y | .) / d h``, ``y`` drawn from the model). A small
perturbation ``delta`` costs ``E[KL] ~ 1/2 E[delta^T F delta]`` (the Fisher is the Hessian
of the KL at ``delta = 0``). Slicing keeps ``P h`` with ``P = U U^T`` an *orthogonal*
projector (the stream is rotated by an orthogonal ``Q``: RMSNorm commutes only with
orthogonal maps), so ``delta = -(I - P) h`` and, treating ``h`` and ``g`` as uncorrelated
across the expectation (the usual K-FAC-style factorisation),

    J(P) = 1/2 tr((I - P) F (I - P) C)        (:func:`kl_proxy`).

With ``F = c I`` this is ``c/2 tr((I - P) C)``, minimised by the top eigenvectors of ``C``
(PCA), which is why SliceGPT is the special case "the output is equally sensitive in every
direction".

Spectral bound (exact). Relax ``P`` to any rank-``k`` map ``R``:
``J >= min_R 1/2 ||F^{1/2} (I - R) C^{1/2}||_F^2 = 1/2 sum_{i>k} lambda_i(F^{1/2} C F^{1/2})``
(Eckart-Young on ``F^{1/2} C^{1/2}``), attained by the F-orthogonal (oblique) projector
``R = F^{-1/2} U_k U_k^T F^{1/2}``, ``U_k`` the top eigenvectors of ``F^{1/2} C F^{1/2}``.
``R``'s range ``F^{-1/2} U_k`` (the top eigenvectors of ``C F``) and its row space
``F^{1/2} U_k`` (the top eigenvectors of ``F C``, equivalently ``C^{-1/2}`` times those of
``C^{1/2} F C^{1/2}``) give the two natural orthogonal projectors: keep the range of ``R``,
or keep the space ``R`` reads from.

Heuristic. Neither is optimal for an orthogonal ``P`` unless ``C`` and ``F`` commute, and
either can lose to PCA. :func:`sensitivity_basis` therefore (1) builds both candidates,
orthonormalised in order by QR (which keeps every prefix's span, so the basis stays nested),
(2) keeps, among them and PCA, the one with the smallest geometric mean of
``J(P_k) / J(P_k^PCA)`` over the widths ``k``, and (3) given the width ``k`` that will be
used, refines the first ``k`` columns by Riemannian gradient descent on the Grassmann
manifold with an Armijo line search (monotone, so never worse than its start), starting from
the best of the three at ``k``.
The refinement is a local method on a non-convex problem: it improves the start, it does
not certify the optimum, and it converges slowly when the spectra are ill-conditioned
(``steps`` bounds its cost, ``O(d^2 (d - k))`` per step).
The optimised objective uses ``F`` damped by ``damping * mean(diag F) * I`` (``F`` is
estimated from few tokens and often ill-conditioned; the damping also blends in the PCA
objective); the final result is compared with PCA on the undamped proxy and PCA's basis is
returned whenever it is at least as good, which the returned ``source`` says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from prunelab import linalg
from prunelab.errors import ConfigError


class SubspaceBasis(tuple):
    """``(q, scores)`` (unpacks as a pair) with where the basis came from.

    ``source``: ``"pca"``, ``"range"`` (top eigenvectors of ``C F``), ``"rowspace"``
    (of ``F C``), or one of them + ``"+refined"``; ``k``: the width refined for (``None``:
    not refined); ``proxy`` / ``pca_proxy``: :func:`kl_proxy` of the first ``k`` columns and
    of PCA's (``None`` without ``k``)."""

    def __new__(cls, q: Tensor, scores: Tensor, source: str, k: int | None = None,
                proxy: float | None = None, pca_proxy: float | None = None):
        obj = super().__new__(cls, (q, scores))
        obj.source, obj.k, obj.proxy, obj.pca_proxy = source, k, proxy, pca_proxy
        return obj


def _sym64(a: Tensor) -> Tensor:
    a = a.detach().to(torch.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {tuple(a.shape)}")
    return (a + a.T) / 2


def _fix_signs(q: Tensor) -> Tensor:
    """Each column's largest-magnitude entry made positive (a deterministic basis)."""
    idx = q.abs().argmax(dim=0)
    signs = torch.sign(q[idx, torch.arange(q.shape[1], device=q.device)])
    return q * torch.where(signs == 0, torch.ones_like(signs), signs)


def pca_basis(cov: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvectors (columns, float64) of the symmetric PSD ``cov`` by decreasing
    eigenvalue, and the eigenvalues."""
    vals, vecs = linalg.eigh(_sym64(cov))
    return _fix_signs(vecs.flip(1)), vals.flip(0)


Mats = Tensor | Sequence[Tensor]


def _pairs(cov: Mats, fisher: Mats) -> list[tuple[Tensor, Tensor]]:
    """``[(C_l, F_l)]`` symmetrised in float64: one pair, or one per boundary sharing a
    rotation (then every objective here is the sum over the pairs)."""
    covs = [cov] if isinstance(cov, Tensor) else list(cov)
    fishers = [fisher] if isinstance(fisher, Tensor) else list(fisher)
    if not covs or len(covs) != len(fishers):
        raise ValueError(f"{len(covs)} covariances for {len(fishers)} Fisher matrices")
    pairs = [(_sym64(c), _sym64(f)) for c, f in zip(covs, fishers, strict=True)]
    shape = pairs[0][0].shape
    if any(c.shape != shape or f.shape != shape for c, f in pairs):
        raise ValueError("the covariances and Fisher matrices differ in shape")
    return pairs


def kl_proxy(cov: Mats, fisher: Mats, q_kept: Tensor) -> float:
    """``1/2 tr((I - P) F (I - P) C)``, ``P`` the orthogonal projector on the columns of
    ``q_kept`` (orthonormal, ``d x k``; ``k = 0`` allowed). Lists of ``C_l`` and ``F_l``
    (one rotation for several boundaries): the sum over ``l``."""
    u = q_kept.to(torch.float64)
    return sum(_proxy(c, f, u) for c, f in _pairs(cov, fisher))


def _proxy(c: Tensor, f: Tensor, u: Tensor) -> float:
    rc = c - u @ (u.T @ c)  # (I - P) C
    rcr = rc - (rc @ u) @ u.T  # (I - P) C (I - P)
    return 0.5 * float((f * rcr).sum())


def proxy_curve(cov: Mats, fisher: Mats, q: Tensor) -> Tensor:
    """``J_k`` = :func:`kl_proxy` of ``q[:, :k]`` for ``k = 0 .. d`` (float64, length
    ``d + 1``), in ``O(d^3)`` for all ``k`` at once: in the basis ``q``,
    ``J_k = 1/2 sum_{i, j >= k} (Q^T F Q)_{ij} (Q^T C Q)_{ij}``."""
    q = q.to(torch.float64)
    e = sum((q.T @ f @ q) * (q.T @ c @ q) for c, f in _pairs(cov, fisher))
    tail = e.flip(0).flip(1).cumsum(0).cumsum(1).flip(0).flip(1).diagonal()
    return 0.5 * torch.cat([tail, tail.new_zeros(1)])


def _psd_powers(a: Tensor) -> tuple[Tensor, Tensor]:
    """``a^{1/2}`` and ``a^{-1/2}`` of a positive definite ``a``."""
    vals, vecs = linalg.eigh(a)
    vals = vals.clamp_min(vals.max() * 1e-15)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs / vals.sqrt()) @ vecs.T


def _ordered_qr(m: Tensor) -> Tensor:
    """Orthonormal columns with ``span(q[:, :k]) = span(m[:, :k])`` for every ``k``."""
    q, r = linalg.qr(m)
    return q * torch.sign(torch.where(r.diagonal() == 0, 1.0, r.diagonal()))


def _candidates(c: Tensor, f_damped: Tensor) -> dict[str, Tensor]:
    half, inv_half = _psd_powers(f_damped)
    _, u = linalg.eigh(_sym(half @ c @ half))
    u = u.flip(1)
    return {"pca": pca_basis(c)[0], "range": _ordered_qr(inv_half @ u),
            "rowspace": _ordered_qr(half @ u)}


def _sym(a: Tensor) -> Tensor:
    return (a + a.T) / 2


def _damped(f: Tensor, damping: float) -> Tensor:
    scale = float(f.diagonal().mean().clamp_min(0))
    if scale == 0.0:
        scale = 1.0
    return f + damping * scale * torch.eye(f.shape[0], dtype=f.dtype, device=f.device)


def sensitivity_basis(cov: Mats, fisher: Mats, damping: float = 0.01, *,
                      k: int | None = None, steps: int = 100) -> SubspaceBasis:
    """An orthonormal ``d x d`` basis whose first ``k`` columns are the kept subspace for
    every ``k`` (nested), chosen to reduce :func:`kl_proxy`, and per-direction scores.

    ``scores[i] = J(P_i) - J(P_{i+1})``: the proxy (with the damped Fisher) saved by
    keeping column ``i`` on top of the previous ones (for ``F = I``: ``(1 + damping) / 2``
    times the eigenvalues of ``C``; it can be negative: adding a direction to an orthogonal
    projector can raise the Fisher-weighted error). With ``k``, the first ``k`` columns
    are refined for that width (at most ``steps`` line-search steps) and are never worse
    than PCA's on the undamped proxy; the other prefixes are then only ordered by energy
    inside the kept and the dropped subspaces. See the module docstring for the derivation.

    One rotation for several boundaries (SliceGPT's global rotation): pass lists of
    ``C_l`` and ``F_l``; the candidates come from ``sum C_l`` and ``sum F_l`` and every
    proxy (refinement, comparison with PCA of ``sum C_l``) is ``sum_l J_l``."""
    if not damping >= 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    pairs = _pairs(cov, fisher)
    c, f = [p[0] for p in pairs], [p[1] for p in pairs]
    fd = [_damped(x, damping) for x in f]
    d = c[0].shape[0]
    cands = _candidates(sum(c), sum(fd))
    curves = {name: proxy_curve(c, fd, q) for name, q in cands.items()}
    if k is None:
        name = min(cands, key=lambda n: (_log_ratio(curves[n], curves["pca"]), n != "pca"))
        return SubspaceBasis(cands[name], _scores(curves[name]), name)
    if not 0 <= k <= d:
        raise ValueError(f"k must be in [0, {d}], got {k}")
    name = min(cands, key=lambda n: (float(curves[n][k]), n != "pca"))
    u = refine_subspace(c, fd, cands[name][:, :k], steps=steps)
    q = _complete(sum(c), u)
    proxy, pca_proxy = kl_proxy(c, f, q[:, :k]), kl_proxy(c, f, cands["pca"][:, :k])
    if pca_proxy <= proxy:
        q, proxy, name = cands["pca"], pca_proxy, "pca"
    elif kl_proxy(c, fd, u) < float(curves[name][k]):
        name += "+refined"
    return SubspaceBasis(q, _scores(proxy_curve(c, fd, q)), name, k, proxy, pca_proxy)


def _log_ratio(curve: Tensor, pca: Tensor) -> float:
    """``sum_k log(J_k / J_k^PCA)`` over the widths where both are positive."""
    ok = (curve[1:-1] > 0) & (pca[1:-1] > 0)
    return float((curve[1:-1][ok].log() - pca[1:-1][ok].log()).sum())


def _scores(curve: Tensor) -> Tensor:
    return curve[:-1] - curve[1:]


def _complete(c: Tensor, u: Tensor) -> Tensor:
    """``[U | V]`` orthonormal: ``U`` (kept) and its complement ``V``, each ordered by
    decreasing energy ``x^T C x`` inside its subspace."""
    parts = []
    for basis in (u, _complement(u)):
        if basis.shape[1] == 0:
            parts.append(basis)
            continue
        _, w = linalg.eigh(_sym(basis.T @ c @ basis))
        parts.append(basis @ w.flip(1))
    return _fix_signs(torch.cat(parts, 1))


def refine_subspace(cov: Mats, fisher: Mats, u: Tensor, *, steps: int = 100,
                    tol: float = 1e-7) -> Tensor:
    """Decrease ``J = 1/2 tr((I - UU^T) F (I - UU^T) C)`` over orthonormal ``d x k`` ``U``
    from ``u``; returns the new ``U``.

    Works on the dropped subspace ``V`` (``I - UU^T = VV^T``, ``J = 1/2 tr((V^T F V)
    (V^T C V))``, no cancellation, ``O(d^2 (d - k))`` per step): Riemannian gradient
    descent on the Grassmann manifold (gradient ``(I - VV^T)(F V B + C V A)``, ``A = V^T F
    V``, ``B = V^T C V``), QR retraction, Barzilai-Borwein (second form) trial steps and Armijo
    backtracking, so every accepted step lowers ``J``. Stops after ``steps`` steps or when
    a step gains less than ``tol`` relative. Lists of ``C_l``, ``F_l``: ``sum_l J_l``."""
    pairs = _pairs(cov, fisher)
    u = u.to(torch.float64)
    d, k = u.shape
    if k in (0, d):
        return u
    v = _complement(u)
    state = _dropped_state(pairs, v)
    # <= 1 / sum ||C_l||_2 ||F_l||_2
    t = 1.0 / max(sum(float(c.trace() * f.trace()) for c, f in pairs), 1e-300)
    for _ in range(steps):
        grad = state[2]
        gnorm = float((grad * grad).sum())
        if gnorm <= 1e-300:
            break
        while True:
            trial = _dropped_state(pairs, linalg.qr(state[0] - t * grad)[0])
            if trial[1] <= state[1] - 1e-4 * t * gnorm or t < 1e-30:
                break
            t /= 2
        if trial[1] > state[1]:
            break
        s_, y_ = trial[0] - state[0], trial[2] - grad
        done = state[1] - trial[1] <= tol * max(abs(state[1]), 1e-300)
        state = trial
        if done:
            break
        sy = float((s_ * y_).sum())
        t = sy / float((y_ * y_).sum()) if sy > 0 else 2 * t
    return _complement(state[0])


def _dropped_state(pairs: list[tuple[Tensor, Tensor]], v: Tensor
                   ) -> tuple[Tensor, float, Tensor]:
    """``(V, J(V), Riemannian gradient)`` for the dropped basis ``V``."""
    value, grad = 0.0, torch.zeros_like(v)
    for c, f in pairs:
        fv, cv = f @ v, c @ v
        a, b = v.T @ fv, v.T @ cv
        grad += fv @ b + cv @ a
        value += 0.5 * float((a * b).sum())
    return v, value, grad - v @ (v.T @ grad)


def _complement(u: Tensor) -> Tensor:
    """An orthonormal basis of the orthogonal complement of ``u``'s columns."""
    d, k = u.shape
    full = linalg.qr(torch.cat([u, torch.eye(d, dtype=u.dtype, device=u.device)], 1))[0]
    return full[:, k:d]


def widths_for_budget(spectra: list[Tensor], cost_per_dim: list[int], budget: int,
                      multiple: int = 8, floor: int = 8) -> list[int]:
    """Kept width per boundary under one parameter budget.

    Each boundary starts at ``floor`` (rounded up to ``multiple``, at most its size); then
    blocks of ``multiple`` leading directions (the last block of a boundary may be shorter,
    reaching its full size) are added greedily, the block with the largest summed score
    per parameter first (ties: the lower boundary), as long as it fits, until no block
    fits. Directions are taken in order (the bases are nested), so ``spectra[i]`` should
    be the scores of boundary ``i``'s basis columns in that order. The cost of a width is
    ``width * cost_per_dim[i]``; the total never exceeds ``budget``."""
    if len(spectra) != len(cost_per_dim):
        raise ValueError("spectra and cost_per_dim differ in length")
    if multiple < 1 or floor < 0:
        raise ValueError(f"multiple must be >= 1 and floor >= 0, got {multiple}, {floor}")
    sizes = [len(s) for s in spectra]
    widths = [min(n, -(-floor // multiple) * multiple) for n in sizes]
    spent = sum(w * c for w, c in zip(widths, cost_per_dim, strict=True))
    if spent > budget:
        raise ConfigError(f"the parameter budget {budget} is below the minimum {spent} "
                          f"(every boundary at least {floor} wide)")
    scores = [s.detach().to(torch.float64).cpu() for s in spectra]
    while True:
        best, best_value = None, None
        for i, (w, n, cost) in enumerate(zip(widths, sizes, cost_per_dim, strict=True)):
            step = min(multiple, n - w)
            if step == 0 or spent + step * cost > budget:
                continue
            value = float(scores[i][w:w + step].sum()) / (step * max(cost, 1e-300))
            if best is None or value > best_value:
                best, best_value = i, value
        if best is None:
            return widths
        step = min(multiple, sizes[best] - widths[best])
        widths[best] += step
        spent += step * cost_per_dim[best]


def widths_for_energy(spectra: list[Tensor], share: float) -> list[int]:
    """Per boundary, the fewest leading directions whose scores (negative ones count zero)
    sum to at least ``share`` of the boundary's total."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    widths = []
    for s in spectra:
        s = s.detach().to(torch.float64).cpu().clamp_min(0)
        total = float(s.sum())
        if total == 0:
            widths.append(0)
            continue
        cum = s.cumsum(0)
        hit = torch.nonzero(cum >= share * total * (1 - 1e-12)).flatten()
        widths.append(int(hit[0]) + 1)
    return widths
