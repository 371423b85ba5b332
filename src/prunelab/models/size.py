"""Parameter and byte counts (tied tensors counted once)."""

from __future__ import annotations

from torch import nn

from prunelab.models.custom import flops_per_token


def model_size(model: nn.Module) -> dict:
    """``{"params": int, "bytes": int}`` over unique parameter and buffer storage.

    Parameters are counted once even when tied (SmolLM2's ``lm_head`` is its embedding);
    bytes include persistent buffers.
    """
    seen: set[int] = set()
    params = nbytes = 0
    for p in model.parameters():
        key = id(p) if p.is_meta else p.data_ptr()  # meta: a streamed block on disk
        if key in seen:
            continue
        seen.add(key)
        params += p.numel()
        nbytes += p.numel() * p.element_size()
    for name, b in model.named_buffers():
        key = b.data_ptr()
        if key in seen or name.endswith(("inv_freq", "original_inv_freq")):
            continue
        seen.add(key)
        nbytes += b.numel() * b.element_size()
    return {"params": params, "bytes": nbytes}


def size_summary(model) -> dict:
    """Stored parameters and FLOPs per token of ``model``."""
    return {"params": model_size(model)["params"], "flops_per_token": flops_per_token(model)}
