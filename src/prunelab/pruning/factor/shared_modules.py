"""Custom modules of the cross-layer shared dictionaries (Basis Sharing, Wang et al. 2024,
"Basis Sharing: Cross-Layer Parameter Sharing for Large Language Model Compression").

A linear ``y = W x (+ b)`` of layer ``l`` becomes ``y = C_l (D x) (+ b)``: the dictionary
``D`` (``k x in``) is shared by every layer of a group and stored once, as a
:class:`SharedDictionary` at a root path (``prunelab_dictionaries.<name>``); each layer
keeps a :class:`SharedBasisLinear` holding only its coefficients ``C_l`` (``out x k``) and
its bias. The coefficient module finds its dictionary by path when it is attached and keeps
a plain (non-registered) reference to it, so the state dict, the parameter count and the
checkpoint hold ``D`` once, and ``model.to(dtype / device)`` (which converts parameters in
place inside the same module objects) leaves the reference valid.

Both class bodies use only ``torch``, ``nn`` and :class:`PrunelabModule` (the checkpoint's
modeling file copies them).
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab.models.custom import PrunelabModule, register_module

#: where :func:`~prunelab.models.custom.install` puts the dictionaries (from the model root)
DICTIONARY_ROOT = "prunelab_dictionaries"


@register_module
class SharedDictionary(PrunelabModule):
    """A dictionary ``D`` (``rank x in_features``) shared by several
    :class:`SharedBasisLinear` layers; ``forward(x) = x D^T``. Costs no FLOPs by itself:
    each layer that uses it counts the product."""

    prunelab_kind = "shared_dictionary"

    def __init__(self, in_features: int, rank: int):
        super().__init__()
        self.in_features, self.rank = in_features, rank
        self.weight = nn.Parameter(torch.empty(rank, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

    def prunelab_spec(self) -> dict:
        return {"in_features": self.in_features, "rank": self.rank}

    def flops_per_token(self) -> int:
        return 0

    def extra_repr(self) -> str:
        return f"in={self.in_features}, rank={self.rank}"


@register_module
class SharedBasisLinear(PrunelabModule):
    """``y = C (D_S x) + b``: a linear layer whose basis ``D`` is the
    :class:`SharedDictionary` at ``dictionary`` (a path from the model root); the module
    holds only ``coefficients`` (``C``, ``out x rank``, with the bias). With ``sparse``,
    the layer uses only the dictionary rows in its buffer ``atoms`` (``rank`` of the
    dictionary's ``dictionary_rank``): the other columns of its coefficients are zero and
    not stored, and the rows it skips are not computed."""

    prunelab_kind = "shared_basis_linear"

    def __init__(self, in_features: int, out_features: int, rank: int, dictionary: str,
                 bias: bool = False, dictionary_rank: int | None = None,
                 sparse: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.dictionary = dictionary
        self.dictionary_rank = rank if dictionary_rank is None else dictionary_rank
        self.sparse = sparse
        self.coefficients = nn.Linear(rank, out_features, bias=bias)
        if sparse:
            self.register_buffer("atoms", torch.arange(rank))
        self.__dict__["_dictionary"] = None  # set by prunelab_attach; not a submodule

    def prunelab_attach(self, owner: nn.Module, root: nn.Module) -> None:
        found = root.get_submodule(self.dictionary)
        if tuple(found.weight.shape) != (self.dictionary_rank, self.in_features):
            raise ValueError(f"dictionary {self.dictionary} has shape "
                             f"{tuple(found.weight.shape)}, expected "
                             f"{(self.dictionary_rank, self.in_features)}")
        self.__dict__["_dictionary"] = found

    def shared(self) -> nn.Module:
        """The :class:`SharedDictionary` this layer reads (after attach)."""
        found = self.__dict__["_dictionary"]
        if found is None:
            raise RuntimeError(f"SharedBasisLinear: dictionary {self.dictionary} not attached")
        return found

    def basis(self) -> torch.Tensor:
        """The dictionary rows this layer uses (``rank x in``)."""
        weight = self.shared().weight
        return weight.index_select(0, self.atoms) if self.sparse else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.coefficients(torch.nn.functional.linear(x, self.basis()))

    def dense_weight(self) -> torch.Tensor:
        """The product ``C D_S`` as ``[out, in]``."""
        return self.coefficients.weight @ self.basis()

    def prunelab_spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features,
                "rank": self.rank, "dictionary": self.dictionary,
                "bias": self.coefficients.bias is not None,
                "dictionary_rank": self.dictionary_rank, "sparse": self.sparse}

    def flops_per_token(self) -> int:
        return 2 * (self.rank * self.in_features + self.out_features * self.rank)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, "
                f"dictionary={self.dictionary}")
