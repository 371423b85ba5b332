"""Gradient alignment: how well a (pruned) model keeps a reference's per-sample gradients
(CACTUS's headline metric: the pruned model's influence functions follow the dense
model's when its per-sample gradients point the same way).

Protocol: for every held-out window ``n`` (a row of ``input_ids``), ``L_n`` is the summed
next-token NLL of the window (:func:`prunelab.eval.divergence.nll_sum`) and ``g_n`` its
gradient with respect to a fixed parameter subset: the weight of each block's linear
matching ``params`` (through the adapter; for prunelab's sparse + low-rank layers the
weight ``S``, whose gradient equals the gradient with respect to the effective weight).
Reported: ``gradient_alignment``, the mean over windows of ``cos(g_n, g_n^ref)`` with all
blocks' gradients concatenated; ``gradient_alignment_per_block``, per block the mean over
windows of the cosine of that block's gradients; ``gradient_params`` (the paths used) and
``gradient_windows``. One forward per batch of windows and one backward per window (the
batch's graph is kept until its last window); the model's ``.grad`` fields are untouched.
"""

from __future__ import annotations

import fnmatch

import torch

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.divergence import nll_sum


def matching_linears(lm, params: str) -> list[dict[str, torch.nn.Module]]:
    """Per block, ``{path: linear}`` of the linears whose path in the block matches
    ``params`` (a glob, or its last component), or whose role is ``params`` without a
    ``_proj`` suffix (``"down_proj"`` finds GPT-2's ``mlp.c_proj`` by its role ``down``)."""
    ad = lm.adapter
    roles = {**ad.spec.attn_proj, **ad.spec.mlp_proj}
    out = []
    for i in range(ad.num_blocks):
        linears = ad.linears(i)
        hit = {p: m for p, m in linears.items()
               if fnmatch.fnmatch(p, params) or p.split(".")[-1] == params}
        role = roles.get(params.removesuffix("_proj"))
        if not hit and role in linears:
            hit = {role: linears[role]}
        out.append(hit)
    if not any(out):
        raise ConfigError(f"gradient alignment: no linear matches {params!r} in "
                          f"{ad.family} (paths: {', '.join(ad.linears(0))})")
    return out


def _window_grads(lm, ids: torch.Tensor, weights: list[list[torch.Tensor]]
                  ) -> list[list[torch.Tensor]]:
    """Per window of ``ids``, per block, the flattened float32 gradient of the window's
    summed NLL with respect to ``weights[block]`` (concatenated within a block)."""
    flat = [w for block in weights for w in block]
    with torch.enable_grad():
        hidden = lm.adapter.base(input_ids=ids.to(lm.device), use_cache=False).last_hidden_state
        rows = []
        for r in range(ids.shape[0]):
            loss = nll_sum(lm.adapter.logits(hidden[r:r + 1]), ids[r:r + 1])
            grads = torch.autograd.grad(loss, flat, retain_graph=r < ids.shape[0] - 1,
                                        allow_unused=True)
            it = iter(grads)
            rows.append([torch.cat([_flat(next(it), w) for w in block]) if block
                         else torch.zeros(0) for block in weights])
    return rows


def _flat(g: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
    return (torch.zeros_like(w) if g is None else g).reshape(-1).float().cpu()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(a.double().norm() * b.double().norm())
    return float(a.double() @ b.double()) / den if den > 0 else 0.0


def gradient_alignment(lm, ref_lm, input_ids: torch.Tensor, *, batch_size: int = 4,
                       params: str = "down_proj") -> dict:
    """Mean cosine between ``lm``'s and ``ref_lm``'s per-window loss gradients with
    respect to each block's linear matching ``params`` (see the module docstring), on
    ``input_ids`` ``[N, T]``. Both models must be causal LMs with the same blocks."""
    for m in (lm, ref_lm):
        if m.adapter.head() is None:
            raise UnsupportedOperationError(f"{m.spec}: gradient alignment needs an LM head")
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    sel, ref_sel = matching_linears(lm, params), matching_linears(ref_lm, params)
    if [list(s) for s in sel] != [list(s) for s in ref_sel]:
        raise ConfigError("gradient alignment: the model and the reference differ in blocks "
                          "or linears")
    weights = [[m.weight for m in s.values()] for s in sel]
    ref_weights = [[m.weight for m in s.values()] for s in ref_sel]
    flags = [(w, w.requires_grad) for ws in weights + ref_weights for w in ws]
    blocks = [i for i, s in enumerate(sel) if s]
    per_block = torch.zeros(len(blocks), dtype=torch.float64)
    total, n = 0.0, 0
    try:
        for w, _ in flags:
            w.requires_grad_(True)
        for ids in torch.as_tensor(input_ids).split(batch_size):
            mine, ref = _window_grads(lm, ids, weights), _window_grads(ref_lm, ids, ref_weights)
            for a, b in zip(mine, ref, strict=True):
                total += _cos(torch.cat(a), torch.cat(b))
                per_block += torch.tensor([_cos(a[i], b[i]) for i in blocks],
                                          dtype=torch.float64)
                n += 1
    finally:
        for w, flag in flags:
            w.requires_grad_(flag)
    return {"gradient_alignment": total / max(n, 1),
            "gradient_alignment_per_block": {i: float(v) / max(n, 1)
                                             for i, v in zip(blocks, per_block, strict=True)},
            "gradient_params": sorted({p for s in sel for p in s}),
            "gradient_windows": n}


__all__ = ["gradient_alignment", "matching_linears"]
