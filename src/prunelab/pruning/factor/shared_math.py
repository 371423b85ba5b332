"""The maths of the cross-layer shared dictionaries (:mod:`prunelab.pruning.factor.shared`):
Basis Sharing's whitened SVD (Wang et al. 2024, "Basis Sharing: Cross-Layer Parameter
Sharing for Large Language Model Compression"), the alternating minimisation of
``sum_l tr((W_l - C_l D) H_l (W_l - C_l D)^T)`` with each layer's own Gram, the choice of
per-layer atoms (structured column sparsity of ``C_l``) and the minimum-weight pairing of
layers. Pure tensor functions in float64; ``W_l`` is ``out x in``, ``D`` is ``k x in``,
``C_l`` is ``out x k``, ``H_l`` is ``in x in``.
"""

from __future__ import annotations

import itertools
import math

import torch

from prunelab import linalg

#: largest number of layers matched exactly (bitmask dynamic programme)
EXACT_MAX = 20


# ------------------------------------------------------------------ maths
def damped(h: torch.Tensor, damping: float) -> torch.Tensor:
    """``H + damping * mean(diag H) I`` in float64 (``1e-12`` when ``H`` is zero)."""
    h = h.to(torch.float64)
    lam = damping * float(h.diagonal().mean()) or 1e-12
    return h + lam * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def shrunk(grams, amount: float) -> list[torch.Tensor]:
    """``(1 - amount) H_l + amount mean(H)`` per layer: each layer's Gram shrunk towards the
    group's mean (``amount = 1``: one shared metric, whose optimum is Basis Sharing's SVD;
    ``0``: the grams unchanged). A fixed-sample regulariser: a layer's own Gram from few
    calibration tokens overfits them more than the group's pooled one."""
    if amount == 0 or len(grams) < 2:
        return list(grams)
    mean = sum(grams) / len(grams)
    return [(1 - amount) * h + amount * mean for h in grams]


def objective(weights, grams, d: torch.Tensor, cs) -> float:
    """``sum_l tr((W_l - C_l D) H_l (W_l - C_l D)^T)`` (= ``sum_l ||X_l (W_l^T -
    D^T C_l^T)||_F^2`` for undamped ``H_l``)."""
    total = 0.0
    for w, h, c in zip(weights, grams, cs, strict=True):
        e = w - c @ d
        total += float(((e @ h) * e).sum())
    return total


def basis_sharing(weights, grams, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Basis Sharing on one group: ``D`` (``k x in``) and ``C_l`` (``out_l x k``) from the
    whitened SVD of the stacked ``W_l^T`` with the summed (damped) Gram; ``k`` is capped
    at ``min(in, sum out_l)``."""
    s = linalg.cholesky(sum(grams))
    m = torch.cat([w.t() for w in weights], dim=1)  # in x sum(out)
    u, sig, vh = linalg.svd(s.t() @ m, full_matrices=False)
    k = min(rank, sig.shape[0])
    # D = U_k^T S^{-1}  <=>  S^T D^T = U_k
    d = linalg.solve_triangular(s.t(), u[:, :k], upper=True).t()
    coef = vh[:k].t() * sig[:k]  # sum(out) x k
    return d, list(coef.split([w.shape[0] for w in weights], dim=0))


def coefficient_step(w: torch.Tensor, h: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Least squares ``C = W H D^T (D H D^T)^{-1}``."""
    hd = h @ d.t()
    return linalg.solve(d @ hd, (w @ hd).t()).t()


def pencil(x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vals, p)`` with ``p^T x2 p = I`` and ``p^T x1 p = diag(vals)`` (``x2`` positive
    definite, both symmetric)."""
    r = linalg.cholesky(x2)
    n = linalg.solve_triangular(r, linalg.solve_triangular(
        r, x1, upper=False).t(), upper=False)
    vals, vecs = linalg.eigh((n + n.t()) / 2)
    return vals, linalg.solve_triangular(r.t(), vecs, upper=True)


def _dictionary_pair(a, b, gram_pencil, chunk: int = 256) -> torch.Tensor:
    """Solve ``A_1 D H_1 + A_2 D H_2 = B`` given ``G^T H_2 G = I, G^T H_1 G = lam``.
    With ``A_2`` positive definite (``P^T A_2 P = I, P^T A_1 P = mu``):
    ``D = P Y G^T``, ``Y_ij = (P^T B G)_ij / (1 + mu_i lam_j)``. Otherwise (a layer that
    leaves atoms unused) ``D = E G^T`` with ``(lam_j A_1 + A_2) e_j = (B G)_j`` per column."""
    lam, g = gram_pencil
    try:
        mu, p = pencil(a[0], a[1])
    except RuntimeError:
        rhs = b @ g
        e = torch.empty_like(rhs)
        for j in range(0, rhs.shape[1], chunk):
            mats = lam[j:j + chunk, None, None] * a[0] + a[1]
            e[:, j:j + chunk] = linalg.solve(mats, rhs[:, j:j + chunk].t()[..., None])[
                ..., 0].t()
        return e @ g.t()
    y = (p.t() @ b @ g) / (1 + mu[:, None] * lam[None, :])
    return p @ y @ g.t()


def _dictionary_cg(a, hs, b, d0, steps: int) -> torch.Tensor:
    """Conjugate gradients on ``T(D) = sum_l A_l D H_l = B`` from ``d0`` (each iterate
    lowers the quadratic, hence the objective)."""
    def op(x):
        return sum(al @ x @ hl for al, hl in zip(a, hs, strict=True))
    x, r = d0.clone(), b - op(d0)
    p, rr = r.clone(), float((r * r).sum())
    for _ in range(steps):
        if rr <= 1e-30:
            break
        tp = op(p)
        alpha = rr / float((p * tp).sum())
        x, r = x + alpha * p, r - alpha * tp
        rr_new = float((r * r).sum())
        p, rr = r + (rr_new / rr) * p, rr_new
    return x


def dictionary_step(weights, grams, cs, d0: torch.Tensor, gram_pencil=None,
                    cg_steps: int = 200) -> torch.Tensor:
    """The ``D`` minimising the objective for fixed coefficients (``gram_pencil``: two
    layers' ``pencil(H_1, H_2)``, computed once per group by :func:`alternate`)."""
    a = [c.t() @ c for c in cs]
    b = sum(c.t() @ w @ h for c, w, h in zip(cs, weights, grams, strict=True))
    try:
        if len(cs) == 1:  # D = C^+ W on the atoms the layer uses (H cancels)
            used = cs[0].abs().sum(0) > 0
            d = d0.clone()
            d[used] = linalg.pinv(cs[0][:, used]) @ weights[0]
            return d
        if len(cs) == 2:
            return _dictionary_pair(a, b, gram_pencil if gram_pencil is not None
                                    else pencil(grams[0], grams[1]))
    except RuntimeError:  # singular systems (an atom no layer uses): conjugate gradients
        pass
    return _dictionary_cg(a, grams, b, d0, cg_steps)


def alternate(weights, grams, d, cs, iters: int, tol: float = 0.0, atoms=None):
    """Alternating minimisation from ``(d, cs)``: returns ``d, cs, history`` with the
    objective at the start and after every iteration (``C`` step then ``D`` step; a step
    that would increase the objective is rejected, so the history never increases). Stops
    early when an iteration gains less than ``tol`` (relative). ``atoms``: per layer, the
    columns of ``C_l`` allowed to be non-zero (the others stay zero)."""
    history = [objective(weights, grams, d, cs)]
    gram_pencil = pencil(grams[0], grams[1]) if len(grams) == 2 and iters else None
    for _ in range(iters):
        if atoms is None:
            new_cs = [coefficient_step(w, h, d) for w, h in zip(weights, grams, strict=True)]
        else:
            new_cs = [masked_coefficients(w, h, d, a)
                      for w, h, a in zip(weights, grams, atoms, strict=True)]
        cur = objective(weights, grams, d, new_cs)
        if cur <= history[-1]:
            cs = new_cs
        else:
            cur = history[-1]
        new_d = dictionary_step(weights, grams, cs, d, gram_pencil)
        val = objective(weights, grams, new_d, cs)
        if val <= cur:
            d, cur = new_d, val
        history.append(cur)
        if history[-2] - cur <= tol * max(abs(history[-2]), 1e-300):
            break
    return d, cs, history


def basis_sharing_dictionary(weights, grams, rank: int) -> torch.Tensor:
    """Basis Sharing's ``D`` alone, from the ``in x in`` eigenproblem
    ``S^T (sum_l W_l^T W_l) S`` instead of the SVD of ``S^T [W_1^T | ...]`` (the same left
    singular vectors; cheaper when ``sum out_l`` exceeds ``in``)."""
    s = linalg.cholesky(sum(grams))
    g = s.t() @ sum(w.t() @ w for w in weights) @ s
    _, vecs = linalg.eigh((g + g.t()) / 2)
    k = min(rank, g.shape[0], sum(w.shape[0] for w in weights))
    return linalg.solve_triangular(s.t(), vecs.flip(1)[:, :k], upper=True).t()


def pair_error(weights, grams, rank: int, iters: int = 0) -> float:
    """Whitened error of sharing a rank-``rank`` dictionary (each layer's own Gram): the
    Basis Sharing start, a least-squares coefficient step, then ``iters`` iterations."""
    if iters == 0:  # the coefficient step replaces Basis Sharing's C: only D is needed
        d = basis_sharing_dictionary(weights, grams, rank)
        cs = [coefficient_step(w, h, d) for w, h in zip(weights, grams, strict=True)]
        return objective(weights, grams, d, cs)
    d, cs = basis_sharing(weights, grams, rank)
    cs = [coefficient_step(w, h, d) for w, h in zip(weights, grams, strict=True)]
    return alternate(weights, grams, d, cs, iters)[2][-1]


def pair_proxies(weights, grams, rank: int) -> torch.Tensor:
    """Cheap pair scores, ``n x n`` (diagonal 0): an upper bound on the Basis Sharing error
    of every pair when both layers' Grams are replaced by the mean Gram ``Hbar = S S^T``
    of all ``n`` layers. With ``G_l = S^T W_l^T W_l S`` (``in x in``) and ``U_l`` its top
    ``rank`` eigenvectors (one eigendecomposition per layer, cached), sharing ``U_a``
    costs ``tail_a + tr(G_b) - tr(U_a^T G_b U_a)`` (``tail_a``: ``G_a``'s dropped
    eigenvalues); the proxy is the better of ``U_a`` and ``U_b``, two ``in x in x rank``
    products per pair instead of a Cholesky, an eigenproblem and a least-squares step.
    Exact when the two layers' ``G`` agree. Used to discard hopeless pairs before the
    exact scores (:func:`candidate_pairs`)."""
    s = linalg.cholesky(sum(grams) / len(grams))
    gs, us, tails = [], [], []
    for w in weights:
        m = w @ s
        g = m.t() @ m
        vals, vecs = linalg.eigh((g + g.t()) / 2)
        k = min(rank, vals.shape[0])
        gs.append(g)
        us.append(vecs[:, vals.shape[0] - k:])
        tails.append(float(vals[:vals.shape[0] - k].sum()))
    n = len(weights)
    out = torch.zeros(n, n, dtype=torch.float64)
    for a, b in itertools.combinations(range(n), 2):
        use_a = tails[a] + float(gs[b].trace()) - float(((gs[b] @ us[a]) * us[a]).sum())
        use_b = tails[b] + float(gs[a].trace()) - float(((gs[a] @ us[b]) * us[b]).sum())
        out[a, b] = out[b, a] = min(use_a, use_b)
    return out


def candidate_pairs(proxy: torch.Tensor, per_layer: int) -> list[tuple[int, int]]:
    """The pairs worth an exact score: every layer's ``per_layer`` lowest-``proxy``
    partners, and the adjacent pairs ``(0, 1), (1, 2), ...`` (so a perfect matching no
    worse than adjacent pairing always exists among them)."""
    n = proxy.shape[0]
    keep = {(i, i + 1) for i in range(n - 1)}
    for a in range(n):
        order = [int(b) for b in torch.argsort(proxy[a]) if int(b) != a]
        keep.update(tuple(sorted((a, b))) for b in order[:per_layer])
    return sorted(keep)


# ------------------------------------------------------------------ matching
def pairing_cost(cost: torch.Tensor | list, pairs, single=None) -> float:
    """Total cost of ``pairs`` (tuples of 1 or 2 indices; ``single[i]`` for a lone one)."""
    return sum(float(cost[p[0]][p[1]]) if len(p) == 2 else float(single[p[0]])
               for p in pairs)


def adjacent_pairs(n: int) -> list[tuple[int, ...]]:
    """``(0, 1), (2, 3), ...`` and ``(n-1,)`` when ``n`` is odd."""
    return [tuple(range(i, min(i + 2, n))) for i in range(0, n, 2)]


def _exact_matching(cost, n: int) -> list[tuple[int, int]]:
    """Minimum-weight perfect matching of ``n`` (even) nodes by a DP over subsets that
    always pairs the lowest unmatched node."""
    full = (1 << n) - 1
    best: dict[int, tuple[float, tuple]] = {full: (0.0, ())}

    def solve(mask: int) -> tuple[float, tuple]:
        if mask in best:
            return best[mask]
        i = (~mask & (mask + 1)).bit_length() - 1  # lowest unmatched node
        found = (math.inf, ())
        for j in range(i + 1, n):
            if not mask >> j & 1:
                sub_cost, sub = solve(mask | 1 << i | 1 << j)
                total = float(cost[i][j]) + sub_cost
                if total < found[0]:
                    found = (total, ((i, j),) + sub)
        best[mask] = found
        return found

    return list(solve(0)[1])


def _two_opt(cost, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Swap partners between two pairs while that lowers the total."""
    pairs = list(pairs)
    improved = True
    while improved:
        improved = False
        for x, y in itertools.combinations(range(len(pairs)), 2):
            (a, b), (c, d) = pairs[x], pairs[y]
            now = float(cost[a][b]) + float(cost[c][d])
            for p, q in (((a, c), (b, d)), ((a, d), (b, c))):
                if float(cost[p[0]][p[1]]) + float(cost[q[0]][q[1]]) < now - 1e-12 * abs(now):
                    pairs[x], pairs[y] = p, q
                    improved = True
                    break
    return pairs


def _greedy(cost, n: int) -> list[tuple[int, int]]:
    edges = sorted(itertools.combinations(range(n), 2), key=lambda e: float(cost[e[0]][e[1]]))
    used: set[int] = set()
    pairs = []
    for a, b in edges:
        if a not in used and b not in used:
            pairs.append((a, b))
            used.update((a, b))
    return pairs


def min_weight_pairing(cost, single=None) -> list[tuple[int, ...]]:
    """Pair ``n`` layers minimising the summed ``cost[a][b]`` (symmetric ``n x n``); for
    odd ``n`` one layer stays alone at ``single[i]``. Exact for ``n <= EXACT_MAX``;
    above, greedy + 2-opt, and never worse than :func:`adjacent_pairs`."""
    n = len(cost)
    odd = n % 2 == 1
    if odd:  # a dummy node: pairing with it = staying alone
        if single is None:
            raise ValueError("odd number of layers needs single costs")
        def entry(i: int, j: int) -> float:
            if i < n and j < n:
                return float(cost[i][j])
            return 0.0 if i == j else float(single[min(i, j)])
        big = [[entry(i, j) for j in range(n + 1)] for i in range(n + 1)]
    else:
        big = [[float(cost[i][j]) for j in range(n)] for i in range(n)]
    m = len(big)
    pairs = _exact_matching(big, m) if n <= EXACT_MAX else _two_opt(big, _greedy(big, m))
    found = [tuple(sorted(p)) if n not in p else (min(p),) for p in pairs]
    found.sort()
    adj = adjacent_pairs(n)
    if n > EXACT_MAX and pairing_cost(cost, adj, single) < pairing_cost(cost, found, single):
        return adj
    return found


# ------------------------------------------------------------------ coefficient sparsity
def choose_atoms(weights, grams, d: torch.Tensor, cs, budget: int) -> list[torch.Tensor]:
    """Per layer, the dictionary rows (columns of ``C_l``) it keeps: every layer its best
    one, then the largest whitened energies ``||C_l[:, j]||^2 (D H_l D^T)_jj`` per stored
    parameter (``out_l``) while the coefficients stay within ``budget`` parameters."""
    outs = [w.shape[0] for w in weights]
    energy = [(c ** 2).sum(0) * torch.einsum("ji,ik,jk->j", d, h, d)
              for c, h in zip(cs, grams, strict=True)]
    chosen: list[set[int]] = [{int(e.argmax())} for e in energy]
    left = budget - sum(outs)
    ranked = sorted(((float(e[j]) / outs[i], i, j) for i, e in enumerate(energy)
                     for j in range(e.shape[0])), reverse=True)
    for _, i, j in ranked:
        if j not in chosen[i] and outs[i] <= left:
            chosen[i].add(j)
            left -= outs[i]
    return [torch.tensor(sorted(s), dtype=torch.long, device=d.device) for s in chosen]


def masked_coefficients(w: torch.Tensor, h: torch.Tensor, d: torch.Tensor,
                        atoms: torch.Tensor) -> torch.Tensor:
    """Least squares ``C`` (``out x k``) with zero columns outside ``atoms``."""
    c = torch.zeros(w.shape[0], d.shape[0], dtype=w.dtype, device=w.device)
    c[:, atoms] = coefficient_step(w, h, d[atoms])
    return c
