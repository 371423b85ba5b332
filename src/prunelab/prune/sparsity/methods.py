"""One linear layer, one method: scores or OBS update, then the mask applied in place."""

from __future__ import annotations

import torch

from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.prune.sparsity import masks, scores
from prunelab.prune.sparsity.rose import rose_prune
from prunelab.prune.sparsity.sparsegpt import sparsegpt_prune


def _mask(score: torch.Tensor, cfg, sparsity: float) -> torch.Tensor:
    nm = masks.parse_pattern(cfg.pattern) if cfg.pattern else None
    if nm is not None:
        return masks.nm_mask(score, *nm)
    return masks.unstructured_mask(score, sparsity, group=cfg.group)


@torch.no_grad()
def prune_linear(module, accs, cfg, sparsity: float) -> None:
    """Prune ``module`` (``nn.Linear`` or ``Conv1D``) in place at ``sparsity``.

    ``accs``: the accumulators gathered on the layer's inputs (``[SumSquares]``, or
    ``[SumSquares, Gram]`` for SparseGPT/ROSE); ``None`` for magnitude.
    """
    w = weight_out_in(module).detach()
    nm = masks.parse_pattern(cfg.pattern) if cfg.pattern else None
    if sparsity <= 0 and nm is None:
        return
    method = cfg.method
    if method == "magnitude":
        keep = _mask(scores.magnitude_scores(w), cfg, sparsity)
        new = w * keep.to(w.device)
    elif method in ("wanda", "qk-wanda"):
        keep = _mask(scores.wanda_scores(w, accs[0].sum_sq.to(w.device)), cfg, sparsity)
        new = w * keep.to(w.device)
    else:
        h = accs[1].xtx  # X^T X (float32 from the executor); SparseGPT runs in float32
        cache = None
        if getattr(cfg, "hessian_alpha", 0.0) > 0:
            from prunelab.prune.sparsity.sparsegpt import hessian_blend

            h = hessian_blend(h, accs[2], cfg.hessian_alpha)
        elif method == "sparsegpt":  # linears sharing an input (q/k/v) share one factor
            cache = accs[1].__dict__.setdefault("_sparsegpt_factor", {})
        h = h.float()
        kw = dict(pattern=nm, blocksize=cfg.blocksize, percdamp=cfg.percdamp,
                  mask_group=cfg.group)
        if method == "rose":
            out = rose_prune(w, h, accs[0].sum_sq, sparsity, reorder=cfg.reorder,
                             threshold=cfg.threshold, **kw)
        else:
            out = sparsegpt_prune(w, h, sparsity, factor_cache=cache, **kw)
        new = out[0]
    set_weight_out_in(module, new)
