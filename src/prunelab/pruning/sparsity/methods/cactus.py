"""CACTUS: curvature-aware ADMM pruning and sparse plus low-rank decomposition.

From the CACTUS proposal (seed system): the layer's curvature combines activations and
output gradients as the Kronecker-factored Fisher ``E[(g g^T) kron (x x^T)] ~ G kron A``
(``A = E[x x^T]`` over calibration tokens, ``G = E[g g^T]`` with ``g = dL/dy`` the
gradient of the LM loss with respect to the layer's output), the objective
``tr((W - W') A (W - W')^T G)``, solved by ADMM, and ``W ~ S + L`` with ``S`` sparse (or
N:M) and ``rank(L) <= r``, alternating the sparse projection and a truncated SVD in the
metric.

Derived here (prunelab): ``G`` is accumulated in float64 from one backward pass per
calibration batch of the *dense* model (:func:`prunelab.calib.gradients.taylor_terms`
with another accumulator) and normalised by tokens; both factors are normalised to unit
diagonal and damped (``A`` by ``admm_damp``, ``G`` by ``grad_damp``, each a fraction of
the mean normalised diagonal); the W-step is elementwise in the factors' eigenbases
(:mod:`prunelab.pruning.sparsity.methods.admm`; with ``G = I`` it is exactly the plain
ADMM update); ``L`` is the best rank-``r`` approximation of ``W + U - S`` in the norm
``||G^{1/2} M A^{1/2}||_F`` (whitened SVD, unwhitened); the mask in the gradual variant
is chosen from ``|W_ij| sqrt(G_ii A_jj)`` (normalised ``|W + U - L|``). The default is
the gradual mask (15 of 20 iterations, cubic schedule).

Storage: with ``rank > 0`` every pruned linear becomes a
:class:`~prunelab.pruning.sparsity.sparse_lowrank.SparseLowRankLinear` (checkpoint loads
with ``trust_remote_code``); ``fold_lowrank=True`` writes ``S + L`` as a plain dense
weight instead (for quality comparison only: it saves no parameter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from prunelab.calib import gradients
from prunelab.errors import UnsupportedOperationError
from prunelab.models.linear import weight_out_in
from prunelab.pruning.base import METHODS, PRUNERS
from prunelab.pruning.linears import selected_linears
from prunelab.pruning.sparsity.config import find
from prunelab.pruning.sparsity.execute import SparsityReport
from prunelab.pruning.sparsity.methods.admm import Admm, factor
from prunelab.pruning.sparsity.pruner import SparsityPruner
from prunelab.pruning.sparsity.sparse_lowrank import replace_linear, stored_params
from prunelab.registry import check_range


class OutputGradCov:
    """``sum_t g_t g_t^T`` (float64) of one linear's output gradients and the token count;
    after pruning it also keeps the linear's low-rank factors until they are installed."""

    def __init__(self) -> None:
        self.ggt: torch.Tensor | None = None
        self.tokens = 0
        self.parts: tuple | None = None

    def update(self, g: torch.Tensor) -> None:
        g = g.reshape(-1, g.shape[-1]).double()
        t = (g.t() @ g).cpu()
        self.ggt = t if self.ggt is None else self.ggt + t
        self.tokens += g.shape[0]

    def mean(self) -> torch.Tensor:
        """``G = E[g g^T]``, ``[d_out, d_out]`` (float64)."""
        return self.ggt.double() / max(self.tokens, 1)


def _accumulate_ggt(terms: dict, name: str, x: torch.Tensor, g: torch.Tensor) -> None:
    terms.setdefault(name, OutputGradCov()).update(g)


def output_gradient_covariances(lm, input_ids: torch.Tensor, modules: dict,
                                batch_size: int) -> dict[str, OutputGradCov]:
    """``{name: OutputGradCov}`` of every linear in ``modules`` from one backward pass per
    batch of the LM loss (summed next-token NLL) on the dense model."""
    covs = gradients.taylor_terms(lm, input_ids, modules, batch_size=batch_size,
                        accumulate=_accumulate_ggt)
    for cov in covs.values():  # summed in float64; kept in float32 until used (memory)
        cov.ggt = cov.ggt.float()
    return covs


@METHODS.register("cactus")
@dataclass(frozen=True)
class Cactus(Admm):
    """CACTUS: ADMM on the Kronecker curvature ``G kron A`` (activations and output
    gradients of the LM loss); ``rank > 0`` adds a rank-r term in the metric (sparse +
    low-rank). Default mask: gradual (cubic schedule inside the ADMM iterations)."""

    gradual: bool = True
    #: refused (UnsupportedOperationError) on a model without an LM head (an encoder)
    needs_lm_loss: ClassVar[bool] = True
    grad_damp: float = field(default=0.1, metadata={
        "help": "cactus: damping of G = E[g g^T], a fraction of its mean normalised diagonal"})
    rank: int = field(default=0, metadata={
        "help": "cactus: rank of the low-rank term L (0: plain pruning)"})
    fold_lowrank: bool = field(default=False, metadata={
        "help": "cactus: fold L into S as one dense weight (quality comparison only: saves "
                "no parameter)"})

    def __post_init__(self):
        super().__post_init__()
        check_range("grad_damp", self.grad_damp, 0.0, 10.0)
        check_range("rank", self.rank, 0, 1_000_000, integer=True)

    def precheck(self, lm):
        if lm.adapter.head() is None:
            raise UnsupportedOperationError(f"cactus needs the LM loss's gradients; "
                                            f"{lm.adapter.family} has no LM head")

    def model_statistics(self, lm, input_ids, linears, batch_size):
        """``G`` of every selected linear (one backward pass per half-size batch)."""
        covs = output_gradient_covariances(lm, input_ids, linears,
                                           batch_size=max(1, batch_size // 2))
        self.__dict__["_covs"] = covs
        return covs

    def output_factor(self, w, accs):
        cov = find(accs, OutputGradCov)
        return factor(cov.mean(), self.grad_damp)

    def prune_weight(self, w, accs, sparsity):
        s, left, right = self.solve(w, accs, sparsity, rank=self.rank)
        cov = find(accs, OutputGradCov)
        cov.ggt = None  # free G once the layer is done
        if left is None:
            return s.to(w.dtype)
        if not self.fold_lowrank:
            cov.parts = (s, left, right)
        return (s + left @ right).to(w.dtype)


@dataclass
class CactusReport(SparsityReport):
    """A CACTUS run: the sparsity report (achieved sparsity of ``S``) plus ``rank``,
    ``lowrank_params`` (``r (d_in + d_out)`` summed) and ``stored_params``
    (``nnz(S) + lowrank_params``) of the pruned linears."""

    rank: int = 0
    lowrank_params: int = 0
    stored_params: int = 0


def install_lowrank(lm, cfg: Cactus) -> dict:
    """Replace every pruned linear holding factors by a ``SparseLowRankLinear``; returns
    the per-block achieved sparsity of ``S`` and the parameter counts."""
    covs = cfg.__dict__.pop("_covs", {})
    names = {id(m): n for n, m in lm.model.named_modules()}
    zeros = total = low = stored = 0
    layers = []
    for i in range(lm.adapter.num_blocks):
        achieved = {}
        for path, module in selected_linears(lm, i, cfg).items():
            cov = covs.get(f"{i}:{path}")
            if cov is not None and cov.parts is not None:
                s, left, right = cov.parts
                module = replace_linear(lm.model, names[id(module)], module, s, left, right)
                cov.parts = None
                low += module.rank * (module.in_features + module.out_features)
            w = module.weight if hasattr(module, "rank") else _out_in(module)
            z = int((w == 0).sum())
            zeros, total = zeros + z, total + w.numel()
            stored += stored_params(module) - (0 if module.bias is None else module.bias.numel())
            achieved[path] = z / max(w.numel(), 1)
        layers.append(achieved)
    return {"zeros": zeros, "total": total, "lowrank": low, "stored": stored,
            "layers": layers}


def _out_in(module):
    return weight_out_in(module)


@PRUNERS.register(Cactus)
class CactusPruner(SparsityPruner):
    """The sparsity pruner, then the low-rank factors installed (``rank > 0``)."""

    def run(self, lm, config: Cactus, input_ids, *, batch_size: int) -> SparsityReport:
        rep = super().run(lm, config, input_ids, batch_size=batch_size)
        info = install_lowrank(lm, config)
        for row, achieved in zip(rep.layers, info["layers"], strict=True):
            row["linears"] = achieved
        fields = {k: v for k, v in vars(rep).items()}
        fields["achieved_sparsity"] = info["zeros"] / max(info["total"], 1)
        return CactusReport(**fields, rank=config.rank, lowrank_params=info["lowrank"],
                            stored_params=info["stored"])
