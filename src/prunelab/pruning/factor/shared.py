"""Cross-layer shared dictionaries: each targeted linear ``W_l`` (``out x in``) of a group of
layers becomes ``C_l D`` with one dictionary ``D`` (``k x in``) per group, stored once
(:mod:`prunelab.pruning.factor.shared_modules`).

* ``basis-sharing`` (Wang et al. 2024, "Basis Sharing: Cross-Layer Parameter Sharing for
  Large Language Model Compression"): consecutive layers in groups of ``group``, one
  projection type at a time. With ``H = sum_{l in G} X_l^T X_l + lambda I = S S^T``
  (Cholesky, float64) and the stack ``M = [W_1^T | ... | W_g^T]`` (``in x g*out``), the
  SVD ``S^T M = U Sigma V^T`` truncated to ``k`` gives ``M ~ S^{-T} U_k Sigma_k V_k^T``:
  ``D = U_k^T S^{-1}`` (acts on the inputs) and ``C_l = V_k[block l] Sigma_k``.
* ``shared-dict`` (the seed's optimized shared dictionary): (a) pairs of layers chosen by
  a minimum-weight perfect matching of the pair errors ``e(a, b)`` (each layer with its
  own Gram; exact bitmask DP up to :data:`EXACT_MAX` layers, greedy + 2-opt above, never
  worse than adjacent pairs); (b) alternating minimisation of
  ``sum_l tr((W_l - C_l D) H_l (W_l - C_l D)^T)`` with each layer's own damped Gram
  ``H_l``, started from Basis Sharing: the ``C`` step is per-layer least squares
  ``C_l = W_l H_l D^T (D H_l D^T)^{-1}``, the ``D`` step solves
  ``sum_l C_l^T C_l D H_l = sum_l C_l^T W_l H_l`` exactly (two layers: two generalized
  eigendecompositions; one layer: ``D = C^+ W``; more: conjugate gradients from the
  current ``D``). A step is kept only when it does not increase the objective, so the
  recorded objective is monotone.

Grams are collected once on the dense model (``propagate="dense"``): pairing and
factorization of every type see the original inputs, not earlier compressions (a stated
simplification of the seed's sequential pairing). The coefficient sparsity of the seed
(whole rows / columns of ``C_l`` zeroed) is not implemented.

Budget: ``ratio`` is the fraction of the targeted linears' weights removed, the dictionary
counted once per group (biases are kept and not counted): per type
``k = floor((1 - ratio) sum_l out_l in / sum_G (in + sum_{l in G} out_l))``, at most
``min(in, sum_{l in G} out_l)``. ``target_params`` (kept fraction of every stored
parameter) is turned into the one ``ratio`` that meets it after flooring.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.pruning.base import METHODS
from prunelab.pruning.factor.config import FactorConfig
from prunelab.registry import check_range

#: largest number of layers matched exactly (bitmask dynamic programme)
EXACT_MAX = 16
ROLES = ("q", "k", "v", "o", "qkv", "gate", "up", "gate_up", "down")
DEFAULT_TYPES = "q,k,v,qkv,gate,up,gate_up"


# ------------------------------------------------------------------ maths
def damped(h: torch.Tensor, damping: float) -> torch.Tensor:
    """``H + damping * mean(diag H) I`` in float64 (``1e-12`` when ``H`` is zero)."""
    h = h.to(torch.float64)
    lam = damping * float(h.diagonal().mean()) or 1e-12
    return h + lam * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)


def objective(weights, grams, d: torch.Tensor, cs) -> float:
    """``sum_l tr((W_l - C_l D) H_l (W_l - C_l D)^T)`` (= ``sum_l ||X_l (W_l^T -
    D^T C_l^T)||_F^2`` for undamped ``H_l``)."""
    total = 0.0
    for w, h, c in zip(weights, grams, cs):
        e = w - c @ d
        total += float(((e @ h) * e).sum())
    return total


def basis_sharing(weights, grams, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Basis Sharing on one group: ``D`` (``k x in``) and ``C_l`` (``out_l x k``) from the
    whitened SVD of the stacked ``W_l^T`` with the summed (damped) Gram; ``k`` is capped
    at ``min(in, sum out_l)``."""
    s = torch.linalg.cholesky(sum(grams))
    m = torch.cat([w.t() for w in weights], dim=1)  # in x sum(out)
    u, sig, vh = torch.linalg.svd(s.t() @ m, full_matrices=False)
    k = min(rank, sig.shape[0])
    # D = U_k^T S^{-1}  <=>  S^T D^T = U_k
    d = torch.linalg.solve_triangular(s.t(), u[:, :k], upper=True).t()
    coef = vh[:k].t() * sig[:k]  # sum(out) x k
    return d, list(coef.split([w.shape[0] for w in weights], dim=0))


def coefficient_step(w: torch.Tensor, h: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Least squares ``C = W H D^T (D H D^T)^{-1}``."""
    hd = h @ d.t()
    return torch.linalg.solve(d @ hd, (w @ hd).t()).t()


def _dictionary_pair(a, hs, b) -> torch.Tensor:
    """Solve ``A_1 D H_1 + A_2 D H_2 = B``: with ``P^T A_2 P = I, P^T A_1 P = mu`` and
    ``G^T H_2 G = I, G^T H_1 G = lam``, ``D = P Y G^T``, ``Y_ij = (P^T B G)_ij / (1 +
    mu_i lam_j)``."""
    def pencil(x1, x2):
        r = torch.linalg.cholesky(x2)
        n = torch.linalg.solve_triangular(r, torch.linalg.solve_triangular(
            r, x1, upper=False).t(), upper=False)
        vals, vecs = torch.linalg.eigh((n + n.t()) / 2)
        return vals, torch.linalg.solve_triangular(r.t(), vecs, upper=True)

    mu, p = pencil(a[0], a[1])
    lam, g = pencil(hs[0], hs[1])
    y = (p.t() @ b @ g) / (1 + mu[:, None] * lam[None, :])
    return p @ y @ g.t()


def _dictionary_cg(a, hs, b, d0, steps: int) -> torch.Tensor:
    """Conjugate gradients on ``T(D) = sum_l A_l D H_l = B`` from ``d0`` (each iterate
    lowers the quadratic, hence the objective)."""
    def op(x):
        return sum(al @ x @ hl for al, hl in zip(a, hs))
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


def dictionary_step(weights, grams, cs, d0: torch.Tensor, cg_steps: int = 200) -> torch.Tensor:
    """The ``D`` minimising the objective for fixed coefficients."""
    a = [c.t() @ c for c in cs]
    b = sum(c.t() @ w @ h for c, w, h in zip(cs, weights, grams))
    try:
        if len(cs) == 1:
            return torch.linalg.lstsq(cs[0], weights[0]).solution
        if len(cs) == 2:
            return _dictionary_pair(a, grams, b)
    except RuntimeError:  # a singular A_l: fall back to CG
        pass
    return _dictionary_cg(a, grams, b, d0, cg_steps)


def alternate(weights, grams, d, cs, iters: int, tol: float = 0.0):
    """Alternating minimisation from ``(d, cs)``: returns ``d, cs, history`` with the
    objective at the start and after every iteration (``C`` step then ``D`` step; a step
    that would increase the objective is rejected, so the history never increases). Stops
    early when an iteration gains less than ``tol`` (relative)."""
    history = [objective(weights, grams, d, cs)]
    for _ in range(iters):
        new_cs = [coefficient_step(w, h, d) for w, h in zip(weights, grams)]
        cur = objective(weights, grams, d, new_cs)
        if cur <= history[-1]:
            cs = new_cs
        else:
            cur = history[-1]
        new_d = dictionary_step(weights, grams, cs, d)
        val = objective(weights, grams, new_d, cs)
        if val <= cur:
            d, cur = new_d, val
        history.append(cur)
        if history[-2] - cur <= tol * max(abs(history[-2]), 1e-300):
            break
    return d, cs, history


def pair_error(weights, grams, rank: int, iters: int = 0) -> float:
    """Whitened error of sharing a rank-``rank`` dictionary (each layer's own Gram): the
    Basis Sharing start, a least-squares coefficient step, then ``iters`` iterations."""
    d, cs = basis_sharing(weights, grams, rank)
    cs = [coefficient_step(w, h, d) for w, h in zip(weights, grams)]
    return alternate(weights, grams, d, cs, iters)[2][-1]


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


# ------------------------------------------------------------------ the model
@dataclass
class _Layer:
    block: int
    path: str  # from the model root
    module: nn.Module
    weight: torch.Tensor  # out x in, float64
    bias: torch.Tensor | None


def _type_list(types: str) -> list[str]:
    return [t.strip() for t in types.split(",") if t.strip()]


def target_roles(lm, types: str, group: int) -> dict[str, str]:
    """``role -> path inside a block`` of the requested types this family has; raises
    :class:`UnsupportedOperationError` (one line) when nothing can be shared."""
    from prunelab.models.linear import in_out_features, is_conv1d

    ad = lm.adapter
    have = {**ad.spec.attn_proj, **ad.spec.mlp_proj}
    roles = {r: have[r] for r in _type_list(types) if r in have}
    if not roles:
        raise UnsupportedOperationError(
            f"{ad.family}: none of the projection types {types!r} exist in this family "
            f"(it has {','.join(have)})")
    if ad.num_blocks < group:
        raise UnsupportedOperationError(f"{ad.family}: sharing across {group} layers needs "
                                        f"at least {group} blocks, the model has {ad.num_blocks}")
    for role, path in roles.items():
        mods = [ad.linears(i)[path] for i in range(ad.num_blocks)]
        if not all(isinstance(m, nn.Linear) or is_conv1d(m) for m in mods):
            raise UnsupportedOperationError(f"{ad.family}: some {role} projections are not "
                                            "plain linear layers (already factorized?)")
        if len({in_out_features(m)[0] for m in mods}) > 1:
            raise UnsupportedOperationError(f"{ad.family}: the {role} projections read inputs "
                                            "of different widths; they cannot share a basis")
    return roles


def collect_input_grams(lm, input_ids: torch.Tensor, roles: dict[str, str], *,
                        batch_size: int) -> dict[tuple[int, str], torch.Tensor]:
    """``X^T X`` (float64) of every targeted linear's input, ``{(block, role): gram}``, on
    the dense model (linears that read the same tensor share one Gram)."""
    from prunelab.calib.runner import BlockRunner
    from prunelab.calib.stats import Gram

    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    ad = lm.adapter
    grams: dict[tuple[int, str], torch.Tensor] = {}

    def on_block(i: int, hidden) -> None:
        linears = ad.linears(i)
        accs = runner.collect(i, hidden, {p: linears[p] for p in roles.values()},
                              lambda _name: Gram(), share=True)
        for role, path in roles.items():
            grams[(i, role)] = accs[path][0].xtx

    runner.run(on_block, propagate="dense", desc="shared: input Grams")
    return grams


def _layers(lm, path: str) -> list[_Layer]:
    from prunelab.models.linear import weight_out_in

    ad = lm.adapter
    names = {id(m): n for n, m in lm.model.named_modules()}
    found = []
    for i in range(ad.num_blocks):
        m = ad.linears(i)[path]
        bias = getattr(m, "bias", None)
        found.append(_Layer(i, names[id(m)], m, weight_out_in(m).detach().to(torch.float64),
                            None if bias is None else bias.detach().clone()))
    return found


def rank_for(ratio: float, d_in: int, outs: list[int], group: int) -> tuple[int, int]:
    """``(k, params per unit of rank)`` for ``ratio`` removed from the layers with output
    widths ``outs`` (in order) grouped by ``group`` (any grouping with the same number of
    groups stores the same)."""
    n_groups = -(-len(outs) // group)
    per_rank = n_groups * d_in + sum(outs)
    return math.floor((1 - ratio) * d_in * sum(outs) / per_rank), per_rank


def _install_group(lm, role: str, members: list[_Layer], d: torch.Tensor, cs) -> None:
    from prunelab.models.custom import install
    from prunelab.pruning.factor.shared_modules import (
        DICTIONARY_ROOT, SharedBasisLinear, SharedDictionary)

    ref = members[0].module.weight
    path = f"{DICTIONARY_ROOT}.{role}_" + "_".join(str(m.block) for m in members)
    shared = SharedDictionary(d.shape[1], d.shape[0])
    with torch.no_grad():
        shared.weight.copy_(d)
    install(lm.model, path, shared.to(device=ref.device, dtype=ref.dtype))
    for layer, c in zip(members, cs):
        mod = SharedBasisLinear(d.shape[1], c.shape[0], d.shape[0], path,
                                bias=layer.bias is not None)
        with torch.no_grad():
            mod.coefficients.weight.copy_(c)
            if layer.bias is not None:
                mod.coefficients.bias.copy_(layer.bias)
        install(lm.model, layer.path, mod.to(device=ref.device, dtype=ref.dtype))


# ------------------------------------------------------------------ methods
def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class _SharedConfig(FactorConfig):
    """Options shared by the two dictionary methods (see the module docstring)."""

    ratio: float = field(default=0.2, metadata=_help(
        "fraction of the targeted linears' weights removed, each dictionary counted once"))
    rank: int | None = field(default=None, metadata=_help(
        "rank of every dictionary (overrides --ratio; capped at min(in, sum of outs))"))
    types: str = field(default=DEFAULT_TYPES, metadata=_help(
        "comma-separated projection types to share (q,k,v,o,qkv,gate,up,gate_up,down); "
        "types the family lacks are skipped"))
    damping: float = field(default=1e-3, metadata=_help(
        "Gram damping, as a fraction of its mean diagonal"))

    group: ClassVar[int] = 2
    history_keys: ClassVar[tuple] = ("ratio", "ranks")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("ratio", self.ratio, 0.0, 0.999)
        check_range("damping", self.damping, 0.0, 1.0)
        if self.rank is not None:
            check_range("rank", self.rank, 1, None, integer=True)
            if self.target_params is not None:
                raise ConfigError("give rank or target_params, not both")
        bad = [t for t in _type_list(self.types) if t not in ROLES]
        if bad or not _type_list(self.types):
            raise ConfigError(f"types: unknown projection type {bad[0] if bad else ''!r}; "
                              f"valid: {','.join(ROLES)}")

    def precheck(self, lm) -> None:
        target_roles(lm, self.types, self._group())

    def _group(self) -> int:
        return self.group

    def _ratio(self, lm, layers: dict[str, list[_Layer]]) -> float:
        """``ratio``, or the one that meets ``target_params`` after flooring the ranks."""
        if self.target_params is None:
            return self.ratio
        from prunelab.models.size import model_size

        total = model_size(lm.model)["params"]
        targeted = sum(l.weight.numel() for ls in layers.values() for l in ls)
        kept = self.target_params * total - (total - targeted)
        if kept <= 0:
            raise ConfigError(f"target_params {self.target_params} is below what the "
                              f"untargeted parameters alone keep "
                              f"({(total - targeted) / total:.4f})")
        return 1 - kept / targeted

    def apply(self, lm, input_ids, *, batch_size: int) -> dict:
        from prunelab.log import progress

        roles = target_roles(lm, self.types, self._group())
        raw = collect_input_grams(lm, input_ids, roles, batch_size=batch_size)
        layers = {role: _layers(lm, path) for role, path in roles.items()}
        ratio = self._ratio(lm, layers)
        damped_by_id: dict[int, torch.Tensor] = {}
        report: dict = {"ratio": ratio, "ranks": {}, "groups": {}, "error": {},
                        "objective_history": {}}
        for role in progress(list(layers), total=len(layers), desc="shared: factorize"):
            ls = layers[role]
            hs = [damped_by_id.setdefault(id(raw[(l.block, role)]),
                                          damped(raw[(l.block, role)], self.damping))
                  for l in ls]
            k = self._rank(role, ratio, ls)
            groups = self._groups(role, ls, hs, k, report)
            histories = []
            for g in groups:
                ws, gh = [ls[i].weight for i in g], [hs[i] for i in g]
                d, cs, hist = self._factor(ws, gh, k)
                histories.append(hist)
                _install_group(lm, role, [ls[i] for i in g], d, cs)
            report["ranks"][role] = k
            report["groups"][role] = [[ls[i].block for i in g] for g in groups]
            n = max(len(h) for h in histories)
            report["objective_history"][role] = [
                sum(h[min(t, len(h) - 1)] for h in histories) for t in range(n)]
            report["error"][role] = report["objective_history"][role][-1]
        return report

    def _rank(self, role: str, ratio: float, ls: list[_Layer]) -> int:
        if self.rank is not None:
            return self.rank
        k, _ = rank_for(ratio, ls[0].weight.shape[1], [l.weight.shape[0] for l in ls],
                        self._group())
        if k < 1:
            raise ConfigError(f"ratio {ratio:.4f} leaves rank 0 for the {role} projections")
        return k

    def _groups(self, role, ls, hs, k, report) -> list[tuple[int, ...]]:
        g = self._group()
        return [tuple(range(i, min(i + g, len(ls)))) for i in range(0, len(ls), g)]

    def _factor(self, ws, hs, k):
        d, cs = basis_sharing(ws, hs, k)
        return d, cs, [objective(ws, hs, d, cs)]


@METHODS.register("basis-sharing")
@dataclass(frozen=True)
class BasisSharing(_SharedConfig):
    """Basis Sharing (Wang et al. 2024): consecutive layers in groups of ``group`` share
    one whitened-SVD basis per projection type (summed Gram of the group's inputs)."""

    group: int = field(default=2, metadata=_help(
        "consecutive layers sharing one dictionary (1 = independent per-layer SVD-LLM)"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("group", self.group, 1, None, integer=True)


@METHODS.register("shared-dict")
@dataclass(frozen=True)
class SharedDict(_SharedConfig):
    """The optimized shared dictionary: pairs chosen by minimum-weight matching of the
    pair errors, then alternating minimisation with each layer's own Gram."""

    pairing: str = field(default="optimized", metadata=_help(
        "optimized (minimum-weight matching of pair errors) or adjacent (0-1, 2-3, ...)"))
    iters: int = field(default=20, metadata=_help(
        "alternating-minimisation iterations per pair (0 = Basis Sharing + a "
        "least-squares coefficient step)"))
    tol: float = field(default=1e-6, metadata=_help(
        "stop a pair's iterations when one gains less than this (relative)"))
    pair_iters: int = field(default=0, metadata=_help(
        "alternating iterations when scoring each candidate pair"))

    history_keys: ClassVar[tuple] = ("ratio", "ranks", "groups")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pairing not in ("optimized", "adjacent"):
            raise ConfigError(f"pairing must be optimized or adjacent, got {self.pairing!r}")
        check_range("iters", self.iters, 0, None, integer=True)
        check_range("pair_iters", self.pair_iters, 0, None, integer=True)
        check_range("tol", self.tol, 0.0, 1.0)

    def _groups(self, role, ls, hs, k, report) -> list[tuple[int, ...]]:
        n = len(ls)
        if self.pairing == "adjacent":
            return adjacent_pairs(n)
        cost = torch.zeros(n, n, dtype=torch.float64)
        for a, b in itertools.combinations(range(n), 2):
            cost[a, b] = cost[b, a] = pair_error([ls[a].weight, ls[b].weight],
                                                 [hs[a], hs[b]], k, self.pair_iters)
        single = [pair_error([l.weight], [h], k) for l, h in zip(ls, hs)] if n % 2 else None
        chosen = min_weight_pairing(cost, single)
        report.setdefault("pairing_error", {})[role] = {
            "chosen": pairing_cost(cost, chosen, single),
            "adjacent": pairing_cost(cost, adjacent_pairs(n), single)}
        return chosen

    def _factor(self, ws, hs, k):
        d, cs = basis_sharing(ws, hs, k)
        d, cs, hist = alternate(ws, hs, d, cs, self.iters, self.tol)
        return d, cs, hist
