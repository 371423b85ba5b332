"""Sparse plus low-rank linear layers ``y = S x + B (A x) + b`` (CACTUS, see
:mod:`prunelab.pruning.sparsity.methods.cactus`): ``S`` is stored as a dense tensor with
zeros (its sparsity is in the zeros), the low-rank part as two factors. A checkpoint
holding one loads with ``trust_remote_code=True`` (the class source below is copied into
the checkpoint's modeling file, so it uses only ``torch`` and ``nn``).

Parameter count (what a sparse kernel would store): ``nnz(S) + r (d_in + d_out)``
(+ the bias), :func:`stored_params`.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab.models.custom import PrunelabModule, install, register_module


@register_module
class SparseLowRankLinear(PrunelabModule):
    """``y = x S^T + (x A^T) B^T + b``: ``weight`` (``S``, ``out x in``, dense with zeros),
    ``first`` (``A``, ``rank x in``), ``second`` (``B``, ``out x rank``), optional
    ``bias``."""

    prunelab_kind = "sparse_lowrank_linear"

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.first = nn.Parameter(torch.zeros(rank, in_features))
        self.second = nn.Parameter(torch.zeros(out_features, rank))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight, self.bias)
        return y + nn.functional.linear(nn.functional.linear(x, self.first), self.second)

    def prunelab_spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features,
                "rank": self.rank, "bias": self.bias is not None}

    def dense_weight(self) -> torch.Tensor:
        """``S + B A`` as ``[out, in]``."""
        return self.weight + self.second @ self.first

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}"


def from_parts(sparse: torch.Tensor, left: torch.Tensor, right: torch.Tensor,
               bias: torch.Tensor | None, like: torch.Tensor) -> SparseLowRankLinear:
    """A :class:`SparseLowRankLinear` holding ``sparse + left @ right`` (``[out, in]``,
    ``[out, r]``, ``[r, in]``) in ``like``'s dtype and device."""
    d_out, d_in = sparse.shape
    mod = SparseLowRankLinear(d_in, d_out, left.shape[1], bias=bias is not None)
    with torch.no_grad():
        mod.weight.copy_(sparse)
        mod.first.copy_(right)
        mod.second.copy_(left)
        if bias is not None:
            mod.bias.copy_(bias)
    return mod.to(device=like.device, dtype=like.dtype)


def replace_linear(root: nn.Module, path: str, linear: nn.Module, sparse: torch.Tensor,
                   left: torch.Tensor, right: torch.Tensor) -> SparseLowRankLinear:
    """Put a :class:`SparseLowRankLinear` at ``path`` of ``root`` in place of ``linear``
    (``nn.Linear`` or ``Conv1D``; its bias is kept)."""
    bias = getattr(linear, "bias", None)
    mod = from_parts(sparse, left, right, None if bias is None else bias.detach(),
                     linear.weight)
    return install(root, path, mod)


def stored_params(module: nn.Module) -> int:
    """``nnz(S) + r (d_in + d_out)`` (+ bias) of a :class:`SparseLowRankLinear`;
    ``nnz(W)`` (+ bias) of a plain linear."""
    bias = getattr(module, "bias", None)
    n = int((module.weight != 0).sum()) + (0 if bias is None else bias.numel())
    if isinstance(module, SparseLowRankLinear):
        n += module.rank * (module.in_features + module.out_features)
    return n


__all__ = ["SparseLowRankLinear", "from_parts", "replace_linear", "stored_params"]
