"""Modules prunelab puts into a model that a plain config cannot describe (factorized
linears, shared dictionaries, residual shortcut maps), and how a checkpoint rebuilds them.

A custom module subclasses :class:`PrunelabModule` and is registered with
:func:`register_module` under a unique ``kind``. It must

* keep all its state in parameters or persistent buffers (the checkpoint loads them);
* describe its constructor arguments with :meth:`PrunelabModule.prunelab_spec` (JSON
  values) and rebuild from them with :meth:`PrunelabModule.prunelab_build`;
* wire itself into the model in :meth:`PrunelabModule.prunelab_attach` when it is more
  than a drop-in replacement (a forward hook on its owner, a reference to a shared
  dictionary elsewhere in the model);
* be self-contained source: its class body may use only ``torch``, ``nn``, ``math`` and
  :class:`PrunelabModule` (the checkpoint's modeling file copies the class source).

:func:`custom_modules` finds them in a model; :mod:`prunelab.checkpoint.remote` records each as
``{"module": path, "kind": kind, "spec": spec}`` in ``config.json`` and the generated
modeling file rebuilds them: every recorded path is replaced (or created, with empty
containers for missing parents) by ``cls.prunelab_build(spec)``, then every module's
``prunelab_attach(owner, root)`` runs (``owner`` is the parent module).
"""

from __future__ import annotations

import math  # noqa: F401 - available to custom module sources

import torch
from torch import nn

from prunelab.models.linear import in_out_features, is_conv1d


class PrunelabModule(nn.Module):
    """Base class of prunelab's custom modules (see the module docstring)."""

    prunelab_kind = "base"

    def prunelab_spec(self) -> dict:
        """JSON constructor arguments (``prunelab_build(spec)`` rebuilds the shapes)."""
        raise TypeError(f"{type(self).__name__} must define prunelab_spec()")

    @classmethod
    def prunelab_build(cls, spec: dict) -> PrunelabModule:
        return cls(**spec)

    def prunelab_attach(self, owner: nn.Module, root: nn.Module) -> None:
        """Wire into the model after every custom module exists (default: nothing)."""

    def flops_per_token(self) -> int:
        """Multiply-adds x 2 this module costs per token (default: every parameter once)."""
        return 2 * sum(p.numel() for p in self.parameters(recurse=True))


#: kind -> class of every registered custom module
CUSTOM_MODULES: dict[str, type[PrunelabModule]] = {}


def register_module(cls: type[PrunelabModule]) -> type[PrunelabModule]:
    """Class decorator: register a :class:`PrunelabModule` subclass under its ``kind``."""
    kind = cls.prunelab_kind
    if kind in CUSTOM_MODULES and CUSTOM_MODULES[kind] is not cls:
        raise ValueError(f"custom module kind {kind!r} is already registered "
                         f"({CUSTOM_MODULES[kind].__name__})")
    CUSTOM_MODULES[kind] = cls
    return cls


def is_custom(module: nn.Module) -> bool:
    """True for a prunelab custom module, also one rebuilt from a checkpoint's modeling file
    (a copy of the class, so recognised by its ``prunelab_kind``, not by ``isinstance``)."""
    kind = getattr(type(module), "prunelab_kind", None)
    return isinstance(kind, str) and kind != "base" and callable(
        getattr(module, "prunelab_spec", None))


def custom_modules(model: nn.Module) -> list[tuple[str, PrunelabModule]]:
    """``(path, module)`` of every outermost custom module in ``model`` (a custom module
    nested in another is rebuilt by its parent's constructor)."""
    found: list[tuple[str, PrunelabModule]] = []
    for name, module in model.named_modules():
        if is_custom(module) and not any(
                name.startswith(p + ".") for p, _ in found):
            found.append((name, module))
    return found


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` in ``root`` (replacing what is there; missing parents
    become empty containers)."""
    parent = root
    parts = path.split(".")
    for part in parts[:-1]:
        child = getattr(parent, part, None)
        if child is None:
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    setattr(parent, parts[-1], module)


def parent_of(root: nn.Module, path: str) -> nn.Module:
    head, _, _ = path.rpartition(".")
    return root.get_submodule(head) if head else root


def install(root: nn.Module, path: str, module: PrunelabModule) -> PrunelabModule:
    """Put a custom module at ``path`` and wire it (what a checkpoint's modeling file does
    at load; methods call this so the in-memory model and the reloaded one agree)."""
    set_module(root, path, module)
    module.prunelab_attach(parent_of(root, path), root)
    return module


@register_module
class LowRankLinear(PrunelabModule):
    """``y = B (A x) + b``: a linear layer stored as two factors, ``first`` (``A``,
    ``rank x in``) and ``second`` (``B``, ``out x rank``, with the bias)."""

    prunelab_kind = "low_rank_linear"

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.first = nn.Linear(in_features, rank, bias=False)
        self.second = nn.Linear(rank, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))

    def prunelab_spec(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features,
                "rank": self.rank, "bias": self.second.bias is not None}

    @classmethod
    def from_factors(cls, first: torch.Tensor, second: torch.Tensor,
                     bias: torch.Tensor | None = None, like: nn.Module | None = None
                     ) -> LowRankLinear:
        """A module holding ``second @ first`` (``[out, r] @ [r, in]``), on ``like``'s
        device and dtype when given."""
        rank, d_in = first.shape
        mod = cls(d_in, second.shape[0], rank, bias=bias is not None)
        ref = like.weight if like is not None else first
        with torch.no_grad():
            mod.first.weight.copy_(first)
            mod.second.weight.copy_(second)
            if bias is not None:
                mod.second.bias.copy_(bias)
        return mod.to(device=ref.device, dtype=ref.dtype)

    def dense_weight(self) -> torch.Tensor:
        """The product ``B A`` as ``[out, in]``."""
        return self.second.weight @ self.first.weight

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}"


def flops_per_token(model: nn.Module) -> int:
    """Multiply-adds x 2 per token of every linear map applied to each token: linear
    layers (the head included, embedding lookups excluded), convolution-as-linear layers
    and prunelab's custom modules (their own count). Attention scores, which grow with
    the context, are not included."""
    total = 0
    skip: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in skip):
            continue
        if is_custom(module):
            total += int(module.flops_per_token())
            skip.append(name)
        elif isinstance(module, nn.Linear) or is_conv1d(module):
            d_in, d_out = in_out_features(module)
            total += 2 * int(d_in) * int(d_out)
    return total
