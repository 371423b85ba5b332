"""Whitened low-rank factorization of linear layers: SVD-LLM (Wang et al. 2024,
"SVD-LLM: Truncation-aware Singular Value Decomposition for Large Language Model
Compression", arXiv:2403.07378).

For a linear ``W`` (``m x n``, ``[d_out, d_in]``) with input Gram ``G = X^T X / tokens``:
``S S^T = G + lambda I`` (Cholesky, float64; ``lambda = damping * mean(diag G)``),
``U Sigma V^T = svd(W S)`` and, keeping rank ``k``,
``W ~ B A`` with ``B = U_k Sigma_k^{1/2}`` (``m x k``) and ``A = Sigma_k^{1/2} V_k^T S^{-1}``
(``k x n``). The truncation loss ``sum_{i>k} sigma_i^2`` equals the whitened error
``||(W - B A) S||_F^2`` (the mean per-token output error ``E||(W - BA) x||^2`` plus the
damping term ``lambda ||W - BA||_F^2``; reported per linear, with ``relative_loss`` =
loss / ``||W S||_F^2``). The linear becomes a
:class:`~prunelab.models.custom.LowRankLinear` (bias on the second factor) only when
``k (m + n) < m n``.

Calibration runs block by block on the already-factorized upstream stream, sublayer group
by sublayer group (``[q, k, v]`` -> ``o`` -> ``[gate, up]`` -> ``down``, the sequential
order of SparseGPT), so each Gram sees the compressed inputs. With ``refit`` the second
factor is refit in closed form on that stream against the dense model's outputs:
``B = argmin ||X_p A^T B^T - X_d W^T||_F`` where ``X_p`` is the linear's input in the
compressed model and ``X_d`` its input in the dense model (same tokens), i.e.
``B = W C^T A^T (A H_p A^T)^{-1}`` with ``H_p = X_p^T X_p`` and ``C = X_p^T X_d``
(float64).

Ranks: ``uniform`` keeps the same parameter fraction ``rho`` of every linear,
``k = floor(rho m n / (m + n))`` (at least 1); ``spectrum`` ranks all singular directions
of all targeted linears (whitened spectra of the dense model, one extra pass) by
``sigma^2 / (m + n)`` and keeps the best that fit the parameter budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import ClassVar

import torch

from prunelab import linalg
from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Gram
from prunelab.errors import ConfigError
from prunelab.models.custom import LowRankLinear, PrunelabModule, install
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.models.size import model_size
from prunelab.pruning.base import METHODS
from prunelab.pruning.factor.config import FactorConfig
from prunelab.pruning.factor.grams import (
    CrossGram,
    Whitening,
    blocks_prefix,
    dense_inputs,
    whitened_spectra,
    whitening,
)
from prunelab.pruning.linears import branch_containers, selected_linears
from prunelab.registry import check_range

ALLOCATIONS = ("uniform", "spectrum")


# ---------------------------------------------------------------------- the maths
@dataclass
class Factors:
    """``W ~ second @ first`` (float64) and the whitened spectrum it truncated."""

    first: torch.Tensor  # A, [k, n]
    second: torch.Tensor  # B, [m, k]
    sigma: torch.Tensor  # every singular value of W S, decreasing
    white: Whitening

    @property
    def rank(self) -> int:
        return self.first.shape[0]

    @property
    def loss(self) -> float:
        """Truncation loss ``sum_{i>k} sigma_i^2`` (= ``||(W - BA) S||_F^2``)."""
        return float(self.sigma[self.rank:].square().sum())

    @property
    def energy(self) -> float:
        """``||W S||_F^2 = sum_i sigma_i^2``."""
        return float(self.sigma.square().sum())


def whitened_factors(w: torch.Tensor, gram: torch.Tensor, rank: int,
                     damping: float) -> Factors:
    """SVD-LLM factors of ``w`` (``[m, n]``) at ``rank`` under input Gram ``gram``."""
    w64 = w.detach().to(torch.float64)
    white = whitening(gram.to(w64.device), damping)
    u, s, vh = linalg.svd(w64 @ white.s, full_matrices=False)
    k = max(1, min(int(rank), s.numel()))
    root = s[:k].sqrt()
    return Factors(white.right_solve(root[:, None] * vh[:k]), u[:, :k] * root, s, white)


def whitened_error(approx: torch.Tensor, w: torch.Tensor, white: Whitening) -> float:
    """``||(W - approx) S||_F^2``."""
    diff = w.to(torch.float64) - approx.to(torch.float64)
    return float((diff @ white.s).square().sum())


def refit_second(first: torch.Tensor, w: torch.Tensor, gram: torch.Tensor,
                 cross: torch.Tensor) -> torch.Tensor:
    """Least-squares second factor ``B = argmin ||X_p A^T B^T - X_d W^T||_F``:
    ``B = W C^T A^T (A H_p A^T)^{-1}`` from ``gram = X_p^T X_p / t`` and
    ``cross = X_p^T X_d / t`` (float64; the pseudo-inverse when ``A H_p A^T`` is
    singular)."""
    a = first.to(torch.float64)
    lhs = a @ gram.to(torch.float64) @ a.t()
    rhs = a @ cross.to(torch.float64) @ w.to(torch.float64).t()  # A C W^T, [k, m]
    chol, info = linalg.cholesky_ex(lhs)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, chol).t()
    return (linalg.pinv(lhs, hermitian=True) @ rhs).t()


def saves(m: int, n: int, k: int) -> bool:
    """The two factors store fewer parameters than the dense weight."""
    return k * (m + n) < m * n


def uniform_rank(m: int, n: int, keep: float | Fraction) -> int:
    """``floor(keep m n / (m + n))``, at least 1: the rank that keeps the fraction
    ``keep`` of an ``m x n`` weight (exact rational arithmetic: a float ``keep`` is read
    as the decimal it prints as, so 0.8 x 80 / 5 is 12.8, not 12.79999)."""
    q = keep if isinstance(keep, Fraction) else Fraction(repr(float(keep)))
    return max(1, math.floor(q * m * n / (m + n)))


def _kept(ratio: float) -> Fraction:
    """``1 - ratio`` exactly (``ratio`` read as the decimal it prints as)."""
    return 1 - Fraction(repr(float(ratio)))


def spectrum_ranks(spectra: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]],
                   budget: int) -> dict[str, int]:
    """Ranks under one parameter budget for the factors (``sum k (m + n) <= budget``):
    every factorizable linear starts at rank 1, then singular directions are taken
    greedily by ``sigma^2 / (m + n)`` while they fit. A linear never goes past the largest
    rank that still saves parameters (``k (m + n) < m n``); linears with no such rank are
    left out (they stay dense) and their ``m n`` is not part of ``budget``."""
    ranks = {p: 1 for p, (m, n) in shapes.items() if saves(m, n, 1)}
    left = budget - sum(sum(shapes[p]) for p in ranks)
    if left < 0:
        raise ValueError("budget below rank 1 everywhere")
    cands = []
    for p in ranks:
        m, n = shapes[p]
        kmax = (m * n - 1) // (m + n)
        s2 = spectra[p][1:kmax].to(torch.float64).square() / (m + n)
        cands += [(float(v), p) for v in s2]
    cands.sort(key=lambda c: -c[0])
    for _value, p in cands:  # a linear's directions come in decreasing order
        cost = sum(shapes[p])
        if cost <= left:
            ranks[p] += 1
            left -= cost
    return ranks


# ---------------------------------------------------------------------- the run
def _factorize_one(module, accs: list, rank: int, damping: float, refit: bool,
                   only_if_smaller: bool) -> tuple[dict, Factors | None]:
    """One linear's report row and factors (``None``: it stays dense)."""
    w = weight_out_in(module).detach()
    m, n = w.shape
    rank = max(1, min(int(rank), m, n))
    gram = accs[0].mean()
    if only_if_smaller and not saves(m, n, rank):
        return {"shape": [m, n], "rank": None, "factorized": False, "params_before": m * n,
                "params_after": m * n, "truncation_loss": 0.0, "relative_loss": 0.0}, None
    fac = whitened_factors(w, gram, rank, damping)
    if refit:
        fac.second = refit_second(fac.first, w, gram, accs[1].mean())
    k = fac.rank
    return {"shape": [m, n], "rank": k, "factorized": True, "params_before": m * n,
            "params_after": k * (m + n), "truncation_loss": fac.loss,
            "relative_loss": fac.loss / fac.energy if fac.energy > 0 else 0.0}, fac


def _factorize_block(lm, runner: BlockRunner, index: int, hidden: list, chosen: dict,
                     ranks: dict[str, int], opts: dict, kept: dict | None
                     ) -> tuple[list[dict], list]:
    """Factorize ``chosen`` (paths in block ``index``) group by group on the compressed
    stream; returns the report rows and the block's new outputs."""
    prefix = f"{blocks_prefix(lm)}.{index}."
    groups = lm.adapter.linear_groups(index, chosen)
    rows: list[dict] = []
    pending: dict[str, tuple] = {}

    def make(name):
        return [Gram()] + ([CrossGram(kept[name][0])] if kept is not None else [])

    def on_group(g, accs):
        for path, module in groups[g].items():
            row, fac = _factorize_one(module, accs[path], ranks[path], **opts)
            rows.append({"module": prefix + path, **row})
            if fac is not None:  # the product stands in until the block is done
                set_weight_out_in(module, fac.second @ fac.first)
                pending[path] = (module, fac)

    outs = runner.sequential(index, hidden, groups, make, on_group,
                             containers=branch_containers(lm, index))
    for path, (module, fac) in pending.items():
        install(lm.model, prefix + path, LowRankLinear.from_factors(
            fac.first, fac.second, bias=getattr(module, "bias", None), like=module))
    return rows, outs


def factorize_model(lm, input_ids: torch.Tensor, ranks: dict[str, int], *,
                    batch_size: int, damping: float = 0.01, refit: bool = False,
                    only_if_smaller: bool = True, runner: BlockRunner | None = None
                    ) -> list[dict]:
    """Replace each linear named in ``ranks`` (full module path -> rank, clamped to
    ``min(m, n)``) by its SVD-LLM factors, block by block on the compressed stream.

    ``only_if_smaller``: a linear whose factors would not store fewer parameters stays
    dense. ``refit``: least-squares second factor against the dense model's outputs (one
    extra dense block pass per block; the dense inputs are held for one block). Returns
    one report row per linear (``module``, ``shape``, ``rank``, ``factorized``,
    ``params_before``, ``params_after``, ``truncation_loss``, ``relative_loss``).
    """
    prefix = blocks_prefix(lm)
    runner = runner if runner is not None else BlockRunner(lm, input_ids, batch_size)
    opts = {"damping": damping, "refit": refit, "only_if_smaller": only_if_smaller}
    rows: list[dict] = []
    dense: list = []

    def on_block(i, hidden):
        chosen = {p: m for p, m in lm.adapter.linears(i).items()
                  if f"{prefix}.{i}.{p}" in ranks}
        kept = None
        if refit:
            kept, dense[:] = dense_inputs(runner, i, dense if i else list(hidden), chosen)
        if not chosen:
            return None
        local = {p: ranks[f"{prefix}.{i}.{p}"] for p in chosen}
        new_rows, outs = _factorize_block(lm, runner, i, hidden, chosen, local, opts, kept)
        rows.extend(new_rows)
        return outs

    runner.run(on_block=on_block, propagate="modified", desc="svd-llm factorization")
    return rows


# ---------------------------------------------------------------------- the method
def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@METHODS.register("svd-llm")
@dataclass(frozen=True)
class SvdLlm(FactorConfig):
    """SVD-LLM whitened low-rank factorization (Wang et al. 2024) of the adapter's
    prunable linears (see the module docstring). ``ratio`` (default 0.2) is the fraction
    of the targeted linears' weight parameters removed; ``target_params`` instead gives
    the kept fraction of the whole model (not both)."""

    ratio: float | None = field(default=None, metadata=_help(
        "fraction of the targeted linears' parameters removed, in (0, 1); default 0.2",
        budget="remove-weights"))
    allocation: str = field(default="uniform", metadata=_help(
        "uniform (every linear keeps the same fraction) or spectrum (ranks chosen "
        "globally by the whitened spectra)"))
    damping: float = field(default=0.01, metadata=_help(
        "lambda added to the Gram's diagonal, as a fraction of its mean diagonal"))
    refit: bool = field(default=False, metadata={**_help(
        "refit the second factor by least squares on the compressed stream"), "toggle": True})
    targets: tuple[str, ...] = field(default=(), metadata=_help(
        "glob patterns of linears to factorize"))
    ignore: tuple[str, ...] = field(default=(), metadata=_help(
        "glob patterns of linears to keep dense"))

    history_keys: ClassVar[tuple] = ("removed_fraction", "truncation_loss")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio is not None and self.target_params is not None:
            raise ConfigError("give ratio or target_params, not both")
        if self.ratio is None and self.target_params is None:
            object.__setattr__(self, "ratio", 0.2)
        if self.ratio is not None:
            check_range("ratio", self.ratio, 0.0, 1.0)
            if not 0 < self.ratio < 1:
                raise ConfigError(f"ratio must be in (0, 1), got {self.ratio!r}")
        if self.allocation not in ALLOCATIONS:
            raise ConfigError(f"allocation must be uniform or spectrum, got "
                              f"{self.allocation!r}")
        check_range("damping", self.damping, 0.0, 1.0)
        if not isinstance(self.refit, bool):
            raise ConfigError(f"refit must be true or false, got {self.refit!r}")
        for name in ("targets", "ignore"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) \
                    or not all(isinstance(p, str) and p for p in value):
                raise ConfigError(f"{name} must be a list of glob patterns (strings), got "
                                  f"{value!r}")
            object.__setattr__(self, name, tuple(value))

    # -- which linears, what budget ---------------------------------------------------
    def select(self, lm, index: int, linears: dict) -> dict:
        """The hook :func:`~prunelab.pruning.linears.selected_linears` calls
        after ``targets`` / ``ignore`` (every matched linear)."""
        return linears

    def targeted(self, lm) -> dict[str, tuple[int, str, torch.nn.Module]]:
        """``{full path: (block, path in block, module)}`` of the linears to factorize
        (those already factorized are left as they are)."""
        prefix = blocks_prefix(lm)
        return {f"{prefix}.{i}.{p}": (i, p, m) for i in range(lm.adapter.num_blocks)
                for p, m in selected_linears(lm, i, self).items()
                if not isinstance(m, PrunelabModule)}

    def budget(self, lm, shapes: dict[str, tuple[int, int]]) -> int:
        """Parameters the targeted linears' weights may keep (raises when unreachable)."""
        total_lin = sum(m * n for m, n in shapes.values())
        floor_ = sum(m + n if saves(m, n, 1) else m * n for m, n in shapes.values())
        if self.target_params is None:
            budget, what = math.floor(_kept(self.ratio) * total_lin), f"ratio {self.ratio}"
            reach = f"keeps {floor_ / total_lin:.4f} of the targeted linears"
        else:
            total = model_size(lm.model)["params"]
            budget = math.floor(self.target_params * total - (total - total_lin))
            what = f"target_params {self.target_params}"
            reach = f"keeps {(total - total_lin + floor_) / total:.4f} of the model"
            if budget >= total_lin:
                raise ConfigError(f"{what} keeps every parameter of the targeted linears: "
                                  f"nothing to factorize")
        if budget < floor_:
            raise ConfigError(f"{what} is unreachable: even rank 1 in every targeted "
                              f"linear {reach}")
        return budget

    def uniform_ranks(self, shapes: dict[str, tuple[int, int]], budget: int
                      ) -> dict[str, int]:
        """``floor(rho m n / (m + n))`` (at least 1) with ``rho`` = ``1 - ratio`` or the
        budget's fraction; raises when the rank-1 floor of small linears overshoots."""
        keep = _kept(self.ratio) if self.ratio is not None else \
            Fraction(budget, sum(m * n for m, n in shapes.values()))
        ranks = {p: uniform_rank(m, n, keep) for p, (m, n) in shapes.items()}
        cost = sum(k * sum(shapes[p]) if saves(*shapes[p], k) else math.prod(shapes[p])
                   for p, k in ranks.items())
        if cost > budget:
            what = f"ratio {self.ratio}" if self.ratio is not None else \
                f"target_params {self.target_params}"
            raise ConfigError(f"{what} is unreachable with uniform ranks (at least rank 1 "
                              f"per linear keeps {cost} > {budget}): use allocation spectrum")
        return ranks

    def precheck(self, lm) -> None:
        targets = self.targeted(lm)
        if not targets:
            raise ConfigError("--targets/--ignore selected no linear layer")
        shapes = {n: tuple(weight_out_in(m).shape) for n, (_i, _p, m) in targets.items()}
        budget = self.budget(lm, shapes)
        if self.allocation == "uniform":
            self.uniform_ranks(shapes, budget)

    # -- the run ----------------------------------------------------------------------
    def ranks(self, lm, input_ids, shapes: dict, budget: int, *, batch_size: int,
              runner: BlockRunner, targets: dict) -> dict[str, int]:
        """Rank per targeted linear: uniform, or by the dense whitened spectra."""
        if self.allocation == "uniform":
            return self.uniform_ranks(shapes, budget)
        spectra = whitened_spectra(lm, input_ids, {n: (i, p) for n, (i, p, _m) in
                                                   targets.items()},
                                   batch_size=batch_size, damping=self.damping, runner=runner)
        dense = sum(m * n for m, n in shapes.values() if not saves(m, n, 1))
        return spectrum_ranks(spectra, shapes, budget - dense)

    def apply(self, lm, input_ids, *, batch_size: int) -> dict:
        targets = self.targeted(lm)
        shapes = {n: tuple(weight_out_in(m).shape) for n, (_i, _p, m) in targets.items()}
        budget = self.budget(lm, shapes)
        runner = BlockRunner(lm, input_ids, batch_size)
        ranks = self.ranks(lm, input_ids, shapes, budget, batch_size=batch_size,
                           runner=runner, targets=targets)
        rows = factorize_model(lm, input_ids, ranks, batch_size=batch_size,
                               damping=self.damping, refit=self.refit, runner=runner)
        before = sum(r["params_before"] for r in rows)
        after = sum(r["params_after"] for r in rows)
        return {"allocation": self.allocation, "damping": self.damping, "refit": self.refit,
                "linear_params_before": before, "linear_params_after": after,
                "linear_budget": budget, "removed_fraction": 1 - after / before,
                "truncation_loss": sum(r["truncation_loss"] for r in rows),
                "dense_linears": [r["module"] for r in rows if not r["factorized"]],
                "linears": rows, "block_evaluations": runner.passes}
