"""Vision-transformer helpers that keep a model's function and its plain checkpoint.

DINOv2 (Oquab et al., 2023) scales each residual branch by a learned per-channel
LayerScale ``lambda`` (Touvron et al., "Going deeper with Image Transformers", 2021):
``h + lambda * o_proj(attn)`` and ``h + lambda * fc2(mlp)``. Folding ``lambda`` into the
branch's last linear (``W <- diag(lambda) W``, ``b <- lambda * b``) and setting it to 1 gives
the same function, and makes the linear's output the branch's residual contribution, which
closed-form recoveries (ReplaceMe's foldable transform, boundary re-fits) assume.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def fold_layer_scales(adapter) -> int:
    """Fold every block's LayerScale into its ``o`` / ``down`` projection and set it to 1
    (no-op for ViT, which has none). Returns the number of scales folded."""
    folded = 0
    for i in range(adapter.num_blocks):
        blk = adapter.block(i)
        pairs = (("layer_scale1", adapter.attn_projections(i).get("o")),
                 ("layer_scale2", adapter.mlp_projections(i).get("down")))
        for name, proj in pairs:
            scale = getattr(blk, name, None)
            lam = getattr(scale, "lambda1", None)
            if lam is None or proj is None or bool((lam == 1).all()):
                continue
            proj.weight.mul_(lam.to(proj.weight.dtype)[:, None])
            if proj.bias is not None:
                proj.bias.mul_(lam.to(proj.bias.dtype))
            lam.fill_(1.0)
            folded += 1
    return folded
