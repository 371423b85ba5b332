"""Uniform access to linear-like layers.

Hugging Face models use ``nn.Linear`` (weight ``[d_out, d_in]``) almost everywhere, but
GPT-2 uses ``Conv1D`` whose weight is stored transposed (``[d_in, d_out]``). Everything in
prunelab reads and writes weights through these helpers so that the maths always sees the
PyTorch convention ``[d_out, d_in]``.
"""

from __future__ import annotations

import torch
from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """True for transformers' ``Conv1D`` (a linear layer with a transposed weight)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def in_out_features(module: nn.Module) -> tuple[int, int]:
    """``(d_in, d_out)`` of a linear-like layer."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """The weight as ``[d_out, d_in]`` (a view; for ``Conv1D`` the transpose)."""
    return module.weight.t() if is_conv1d(module) else module.weight


def set_weight_out_in(module: nn.Module, weight: torch.Tensor) -> None:
    """Write ``weight`` given as ``[d_out, d_in]`` into the layer (same shape, in place)."""
    with torch.no_grad():
        target = module.weight
        src = weight.t() if is_conv1d(module) else weight
        target.copy_(src.to(dtype=target.dtype, device=target.device))


def slice_linear(module: nn.Module, index: torch.Tensor, dim: str) -> None:
    """Keep only the output rows (``dim="out"``) or input columns (``dim="in"``) in ``index``.

    Works in place on ``nn.Linear`` and ``Conv1D`` (bias sliced with the outputs) and
    updates the size attributes the layer reads.
    """
    if dim not in ("out", "in"):
        raise ValueError(f"dim must be 'out' or 'in', got {dim!r}")
    index = torch.as_tensor(index, dtype=torch.long, device=module.weight.device)
    conv = is_conv1d(module)
    # axis of the weight tensor that holds outputs / inputs
    axis = {("out", False): 0, ("in", False): 1, ("out", True): 1, ("in", True): 0}[(dim, conv)]
    with torch.no_grad():
        new_w = module.weight.index_select(axis, index).clone()
        module.weight = nn.Parameter(new_w, requires_grad=module.weight.requires_grad)
        if dim == "out" and getattr(module, "bias", None) is not None:
            new_b = module.bias.index_select(0, index.to(module.bias.device)).clone()
            module.bias = nn.Parameter(new_b, requires_grad=module.bias.requires_grad)
    if conv:
        if dim == "out":
            module.nf = len(index)
    elif dim == "out":
        module.out_features = len(index)
    else:
        module.in_features = len(index)
