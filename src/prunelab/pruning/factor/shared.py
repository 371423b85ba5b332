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

Grams: with ``sequential`` the projection types are processed by the tensor they read, in
execution order (q/k/v, o, gate/up, down), and each stage's Grams are collected on the
model with the earlier stages already compressed (``propagate="modified"``). That fits
the dense weights to the compressed stream's inputs rather than reproducing the dense
outputs, and measured worse on SmolLM2-135M for both methods
(benchmarks/results/factorization.md), so both default to one pass on the dense model
collecting every Gram, as in the paper.

Shrinkage (``shared-dict --shrink s``): each layer's Gram is replaced by
``(1 - s) H_l + s mean_G(H)`` before pairing and fitting. ``s = 1`` is Basis Sharing's
shared metric (its SVD is then optimal and the alternation cannot move), ``s = 0`` each
layer's own geometry; own Grams from few calibration tokens fit those tokens better and
generalise worse (lower calibration KL, not lower test perplexity).

Pair scoring (``--candidates N``): a cheap proxy for every pair (Basis Sharing's error
with the mean Gram of all layers, one ``in x in`` eigenvalue problem per pair from cached
``S^T W_l^T W_l S``) keeps each layer's ``N`` best partners and the adjacent pairs; only
those are scored exactly (``D`` from an ``in x in`` eigenproblem, then the least-squares
coefficients), the others are never chosen over a scored pairing.

(c) Structured coefficient sparsity (``shared-dict --expand E > 1``): the group's budget
``k (in + sum out_l)`` buys a larger dictionary of ``k' = floor(E k)`` atoms, and each layer
keeps only its most useful atoms (whole columns of ``C_l``; the rest are zero and not
stored: the layer holds ``C_l`` as ``out x k_l`` and the indices of its atoms, and computes
only those rows of ``D x``) so that ``k' in + sum_l out_l k_l`` stays within the budget;
the alternating minimisation then runs with those columns fixed at zero. Pairs are still
scored at the dense rank ``k``.

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

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Gram
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.log import progress
from prunelab.models.custom import install
from prunelab.models.families import INPUT_GROUPS
from prunelab.models.linear import in_out_features, is_conv1d, weight_out_in
from prunelab.models.size import model_size
from prunelab.pruning.base import METHODS, SKIPPED
from prunelab.pruning.factor.config import FactorConfig
from prunelab.pruning.factor.shared_math import (
    adjacent_pairs,
    alternate,
    basis_sharing,
    candidate_pairs,
    choose_atoms,
    damped,
    masked_coefficients,
    min_weight_pairing,
    objective,
    pair_error,
    pair_proxies,
    pairing_cost,
    shrunk,
)
from prunelab.pruning.factor.shared_modules import (
    DICTIONARY_ROOT,
    SharedBasisLinear,
    SharedDictionary,
)
from prunelab.registry import check_range

ROLES = ("q", "k", "v", "o", "qkv", "gate", "up", "gate_up", "down")
DEFAULT_TYPES = "q,k,v,qkv,gate,up,gate_up"


# ------------------------------------------------------------------ the model
@dataclass
class _Layer:
    block: int
    path: str  # from the model root
    module: nn.Module | None
    shape: tuple[int, int]  # out, in
    weight: torch.Tensor | None = None  # out x in, float64, while its type is factorized


def _type_list(types) -> list[str]:
    """The projection types of ``"q,k,v"`` or of a sequence of names."""
    parts = types.split(",") if isinstance(types, str) else list(types)
    return [str(t).strip() for t in parts if str(t).strip()]


def target_roles(lm, types: str, group: int) -> dict[str, str]:
    """``role -> path inside a block`` of the requested types this family has; raises
    :class:`UnsupportedOperationError` (one line) when nothing can be shared."""
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
    the model as it is now (linears that read the same tensor share one Gram)."""
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    ad = lm.adapter
    grams: dict[tuple[int, str], torch.Tensor] = {}

    def on_block(i: int, hidden) -> None:
        linears = ad.linears(i)
        accs = runner.collect(i, hidden, {p: linears[p] for p in roles.values()},
                              lambda _name: Gram(), share=True)
        for role, path in roles.items():
            grams[(i, role)] = accs[path][0].xtx

    runner.run(on_block, propagate="modified", desc="shared: input Grams")
    return grams


def _layers(lm, path: str) -> list[_Layer]:
    ad = lm.adapter
    names = {id(m): n for n, m in lm.model.named_modules()}
    found = []
    for i in range(ad.num_blocks):
        m = ad.linears(i)[path]
        d_in, d_out = in_out_features(m)
        found.append(_Layer(i, names[id(m)], m, (int(d_out), int(d_in))))
    return found


def rank_for(ratio: float, d_in: int, outs: list[int], group: int) -> tuple[int, int]:
    """``(k, params per unit of rank)`` for ``ratio`` removed from the layers with output
    widths ``outs`` (in order) grouped by ``group`` (any grouping with the same number of
    groups stores the same)."""
    n_groups = -(-len(outs) // group)
    per_rank = n_groups * d_in + sum(outs)
    return math.floor((1 - ratio) * d_in * sum(outs) / per_rank), per_rank


def _install_group(lm, role: str, members: list[_Layer], d: torch.Tensor, cs,
                   atoms=None) -> None:
    """One dictionary at ``prunelab_dictionaries.<role>_<blocks>`` and each member's
    coefficients (``atoms``: per layer, the dictionary rows it uses)."""
    ref = members[0].module.weight
    path = f"{DICTIONARY_ROOT}.{role}_" + "_".join(str(m.block) for m in members)
    shared = SharedDictionary(d.shape[1], d.shape[0])
    with torch.no_grad():
        shared.weight.copy_(d)
    install(lm.model, path, shared.to(device=ref.device, dtype=ref.dtype))
    for i, (layer, c) in enumerate(zip(members, cs, strict=True)):
        bias = getattr(layer.module, "bias", None)
        mod = SharedBasisLinear(d.shape[1], c.shape[0], c.shape[1], path,
                                bias=bias is not None, dictionary_rank=d.shape[0],
                                sparse=atoms is not None)
        with torch.no_grad():
            mod.coefficients.weight.copy_(c)
            if atoms is not None:
                mod.atoms.copy_(atoms[i])
            if bias is not None:
                mod.coefficients.bias.copy_(bias)
        install(lm.model, layer.path, mod.to(device=ref.device, dtype=ref.dtype))


def _expanded(cs, atoms, rank: int):
    """Coefficients as ``out x rank`` (compact ones scattered back to their atoms)."""
    if atoms is None:
        return cs
    full = []
    for c, a in zip(cs, atoms, strict=True):
        f = c.new_zeros(c.shape[0], rank)
        f[:, a] = c
        full.append(f)
    return full


# ------------------------------------------------------------------ methods
def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@dataclass(frozen=True)
class _SharedConfig(FactorConfig):
    """Options shared by the two dictionary methods (see the module docstring)."""

    ratio: float | None = field(default=None, metadata=_help(
        "fraction of the targeted linears' weights removed, each dictionary counted once "
        "(default 0.2)", budget="remove-weights"))
    rank: int | None = field(default=None, metadata=_help(
        "rank of every dictionary (overrides the budget; capped at min(in, sum of outs))"))
    types: str = field(default=DEFAULT_TYPES, metadata=_help(
        "comma-separated projection types to share (q,k,v,o,qkv,gate,up,gate_up,down); "
        "types the family lacks are skipped"))
    damping: float = field(default=1e-3, metadata=_help(
        "Gram damping, as a fraction of its mean diagonal"))

    group: ClassVar[int] = 2
    history_keys: ClassVar[tuple] = ("ratio", "ranks")
    #: removed sublayers (gates) leave layers without the projections a dictionary pairs
    refuses_kinds: ClassVar[frozenset] = SKIPPED

    def __post_init__(self) -> None:
        super().__post_init__()
        given = [name for name, v in (("ratio", self.ratio), ("rank", self.rank),
                                      ("target_params", self.target_params)) if v is not None]
        if len(given) > 1:
            raise ConfigError(f"give one of ratio (--budget remove-weights:F), target_params "
                              f"(--budget keep-params:F) or rank, not both "
                              f"{' and '.join(given)}")
        if not given:
            object.__setattr__(self, "ratio", 0.2)
        if self.ratio is not None:
            check_range("ratio", self.ratio, 0.0, 0.999)
            if self.ratio == 0:
                raise ConfigError("ratio must be > 0: removing nothing only refactors the "
                                  "weights (the model does not get smaller)")
        check_range("damping", self.damping, 0.0, 1.0)
        if self.rank is not None:
            check_range("rank", self.rank, 1, None, integer=True)
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

        total = model_size(lm.model)["params"]
        targeted = sum(math.prod(x.shape) for ls in layers.values() for x in ls)
        kept = self.target_params * total - (total - targeted)
        if kept <= 0:
            raise ConfigError(f"target_params {self.target_params} is below what the "
                              f"untargeted parameters alone keep "
                              f"({(total - targeted) / total:.4f})")
        return 1 - kept / targeted

    def apply(self, lm, input_ids, *, batch_size: int) -> dict:
        roles = target_roles(lm, self.types, self._group())
        layers = {role: _layers(lm, path) for role, path in roles.items()}
        ratio = self._ratio(lm, layers)
        report: dict = {"ratio": ratio, "ranks": {}, "groups": {}, "error": {},
                        "objective_history": {}, "atoms": {}}
        stages = [[r for r in grp if r in roles] for grp in INPUT_GROUPS] \
            if self.sequential else [list(roles)]
        for stage in [s for s in stages if s]:
            # sequential: the Grams of a stage's inputs see the earlier stages compressed
            raw = collect_input_grams(lm, input_ids, {r: roles[r] for r in stage},
                                      batch_size=batch_size)
            damped_by_id: dict[int, torch.Tensor] = {}
            for role in progress(stage, total=len(stage), desc="shared: factorize"):
                hs = [damped_by_id.setdefault(id(raw[(x.block, role)]),
                                              damped(raw[(x.block, role)], self.damping))
                      for x in layers[role]]
                self._factorize_role(lm, role, layers[role], hs, ratio, report)
        return report

    def _factorize_role(self, lm, role: str, ls: list[_Layer], hs, ratio: float,
                        report: dict) -> None:
        """Group, factorize and install one projection type; fill its report entries."""
        for x in ls:
            x.weight = weight_out_in(x.module).detach().to(torch.float64)
        k = self._rank(role, ratio, ls)
        groups = self._groups(role, ls, hs, k, report)
        histories, used, own = [], [], 0.0
        for g in groups:
            ws, gh = [ls[i].weight for i in g], [hs[i] for i in g]
            d, cs, hist, atoms = self._factor(ws, gh, k)
            histories.append(hist)
            own += objective(ws, gh, d, _expanded(cs, atoms, d.shape[0]))
            used.append([d.shape[0], [c.shape[1] for c in cs]])
            _install_group(lm, role, [ls[i] for i in g], d, cs, atoms)
        for x in ls:  # replaced in the model: let the dense weights go
            x.weight = x.module = None
        report["ranks"][role] = k
        report["atoms"][role] = used
        report["groups"][role] = [[ls[i].block for i in g] for g in groups]
        n = max(len(h) for h in histories)
        report["objective_history"][role] = [
            sum(h[min(t, len(h) - 1)] for h in histories) for t in range(n)]
        report["error"][role] = own  # each layer's own Gram (history: the fitted metric)

    def _rank(self, role: str, ratio: float, ls: list[_Layer]) -> int:
        if self.rank is not None:
            return self.rank
        k, _ = rank_for(ratio, ls[0].shape[1], [x.shape[0] for x in ls],
                        self._group())
        if k < 1:
            raise ConfigError(f"ratio {ratio:.4f} leaves rank 0 for the {role} projections")
        return k

    def _groups(self, role, ls, hs, k, report) -> list[tuple[int, ...]]:
        g = self._group()
        return [tuple(range(i, min(i + g, len(ls)))) for i in range(0, len(ls), g)]

    def _factor(self, ws, hs, k):
        d, cs = basis_sharing(ws, hs, k)
        return d, cs, [objective(ws, hs, d, cs)], None


@METHODS.register("basis-sharing")
@dataclass(frozen=True)
class BasisSharing(_SharedConfig):
    """Basis Sharing (Wang et al. 2024): consecutive layers in groups of ``group`` share
    one whitened-SVD basis per projection type (summed Gram of the group's inputs)."""

    group: int = field(default=2, metadata=_help(
        "consecutive layers sharing one dictionary (1 = independent per-layer SVD-LLM)"))
    sequential: bool = field(default=False, metadata=_help(
        "collect each input group's Grams (q/k/v, o, gate/up, down) after the earlier "
        "groups were compressed, instead of all on the dense model"))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("group", self.group, 1, None, integer=True)


@METHODS.register("shared-dict")
@dataclass(frozen=True)
class SharedDict(_SharedConfig):
    """The optimized shared dictionary: pairs chosen by minimum-weight matching of the
    pair errors, then alternating minimisation with each layer's own Gram."""

    sequential: bool = field(default=False, metadata=_help(
        "collect each input group's Grams (q/k/v, o, gate/up, down) after the earlier "
        "groups were compressed (measured worse: it fits the dense weights to the "
        "compressed inputs instead of the dense outputs)"))
    pairing: str = field(default="optimized", metadata=_help(
        "optimized (minimum-weight matching of pair errors) or adjacent (0-1, 2-3, ...)"))
    iters: int = field(default=8, metadata=_help(
        "alternating-minimisation iterations per pair (0 = Basis Sharing + a "
        "least-squares coefficient step)"))
    tol: float = field(default=1e-6, metadata=_help(
        "stop a pair's iterations when one gains less than this (relative)"))
    pair_iters: int = field(default=0, metadata=_help(
        "alternating iterations when scoring each candidate pair"))
    shrink: float = field(default=0.5, metadata=_help(
        "per-layer Grams shrunk towards their group's mean, (1 - s) H_l + s mean(H): 0 = each "
        "layer's own geometry, 1 = Basis Sharing's shared metric"))
    candidates: int = field(default=3, metadata=_help(
        "optimized pairing: exact scores only for each layer's N best partners by a cheap "
        "mean-Gram proxy, plus adjacent pairs (0 = score every pair exactly)"))
    expand: float = field(default=1.0, metadata=_help(
        "dictionary atoms as a multiple of the budget's rank; above 1 each layer keeps "
        "only its most useful atoms (whole columns of its coefficients) within the budget"))

    history_keys: ClassVar[tuple] = ("ratio", "ranks", "groups")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pairing not in ("optimized", "adjacent"):
            raise ConfigError(f"pairing must be optimized or adjacent, got {self.pairing!r}")
        check_range("iters", self.iters, 0, None, integer=True)
        check_range("pair_iters", self.pair_iters, 0, None, integer=True)
        check_range("tol", self.tol, 0.0, 1.0)
        check_range("expand", self.expand, 1.0, 8.0)
        check_range("shrink", self.shrink, 0.0, 1.0)
        check_range("candidates", self.candidates, 0, None, integer=True)

    def _groups(self, role, ls, hs, k, report) -> list[tuple[int, ...]]:
        n = len(ls)
        if self.pairing == "adjacent":
            return adjacent_pairs(n)
        ws = [x.weight for x in ls]
        pairs = list(itertools.combinations(range(n), 2))
        if self.candidates and n > 2:
            proxy = pair_proxies(ws, hs, k)
            pairs = candidate_pairs(proxy, self.candidates)
        exact = {p: pair_error([ws[p[0]], ws[p[1]]], shrunk([hs[p[0]], hs[p[1]]],
                                                            self.shrink), k, self.pair_iters)
                 for p in pairs}
        # pairs without an exact score are never better than the worst scored one x 1e6
        cost = torch.full((n, n), 1e6 * max(max(exact.values()), 1e-300), dtype=torch.float64)
        for (a, b), e in exact.items():
            cost[a, b] = cost[b, a] = e
        single = None if n % 2 == 0 else [
            pair_error([x.weight], [h], k) for x, h in zip(ls, hs, strict=True)]
        chosen = min_weight_pairing(cost, single)
        report.setdefault("pairing_error", {})[role] = {
            "chosen": pairing_cost(cost, chosen, single),
            "adjacent": pairing_cost(cost, adjacent_pairs(n), single),
            "scored_pairs": len(exact)}
        return chosen

    def _factor(self, ws, hs, k):
        hs = shrunk(hs, self.shrink)
        if self.expand > 1:
            return self._sparse(ws, hs, k)
        d, cs = basis_sharing(ws, hs, k)
        return (*alternate(ws, hs, d, cs, self.iters, self.tol), None)

    def _sparse(self, ws, hs, k):
        """A dictionary of up to ``expand * k`` atoms, each layer keeping its best ones,
        within the dense group's budget; unused atoms are dropped."""
        d_in, outs = ws[0].shape[1], [w.shape[0] for w in ws]
        budget = min(k, d_in, sum(outs)) * (d_in + sum(outs))
        big = min(d_in, math.floor(self.expand * k), (budget - sum(outs)) // d_in)
        d, cs = basis_sharing(ws, hs, max(big, 1))
        d, cs, _ = alternate(ws, hs, d, cs, self.iters, self.tol)
        atoms = choose_atoms(ws, hs, d, cs, budget - d.shape[0] * d_in)
        cs = [masked_coefficients(w, h, d, a) for w, h, a in zip(ws, hs, atoms, strict=True)]
        d, cs, hist = alternate(ws, hs, d, cs, self.iters, self.tol, atoms)
        keep = sorted(set().union(*(a.tolist() for a in atoms)))
        new_index = {old: new for new, old in enumerate(keep)}
        compact = [c[:, a] for c, a in zip(cs, atoms, strict=True)]
        atoms = [torch.tensor([new_index[int(j)] for j in a], dtype=torch.long) for a in atoms]
        return d[keep], compact, hist, atoms
