"""One linear layer, one method: scores or OBS update, then the mask applied in place."""

from __future__ import annotations

import torch

from prunelab.calib.stats import Gram, SumSquares
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.pruning.sparsity import masks, scores
from prunelab.pruning.sparsity.rose import rose_prune
from prunelab.pruning.sparsity.sparsegpt import sparsegpt_prune


def _mask(score: torch.Tensor, cfg, sparsity: float) -> torch.Tensor:
    nm = masks.parse_pattern(cfg.pattern) if cfg.pattern else None
    if nm is not None:
        return masks.nm_mask(score, *nm)
    return masks.unstructured_mask(score, sparsity, group=cfg.group)


def _find(accs, kind):
    return next((a for a in accs or () if isinstance(a, kind)), None)


def _taylor(accs):
    """The Taylor term the executor appended (a tensor), if any."""
    return next((a for a in accs or () if isinstance(a, torch.Tensor)), None)


def _sparsegpt_kwargs(cfg) -> dict:
    nm = masks.parse_pattern(cfg.pattern) if cfg.pattern else None
    # "layer" (one comparison group for the whole matrix) is, in SparseGPT's lazy column
    # blocks, the reference code's joint choice over each [d_out, blocksize] slice.
    return dict(pattern=nm, blocksize=cfg.blocksize, percdamp=cfg.percdamp,
                mask_group="block" if cfg.group == "layer" else "row")


@torch.no_grad()
def prune_linear(module, accs, cfg, sparsity: float) -> None:
    """Prune ``module`` (``nn.Linear`` or ``Conv1D``) in place at ``sparsity``.

    ``accs``: the accumulators gathered on the layer's inputs (``[SumSquares]`` for Wanda,
    ``[Gram]`` for SparseGPT, ``[SumSquares, Gram]`` for ROSE; the MOONSHOT Taylor term is
    appended as a tensor); ``None`` for magnitude.
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
        ss = _find(accs, SumSquares)
        keep = _mask(scores.wanda_scores(w, ss.sum_sq.to(w.device)), cfg, sparsity)
        new = w * keep.to(w.device)
    else:
        gram = _find(accs, Gram)
        h = gram.xtx  # X^T X (float32 from the executor); SparseGPT runs in float32
        cache = None
        taylor = _taylor(accs)
        if getattr(cfg, "hessian_alpha", 0.0) > 0:
            from prunelab.pruning.sparsity.sparsegpt import hessian_blend

            h = hessian_blend(h, taylor, cfg.hessian_alpha)
        elif method == "sparsegpt":  # linears sharing an input (q/k/v) share one factor
            cache = gram.__dict__.setdefault("_sparsegpt_factor", {})
        h = h.float()
        kw = _sparsegpt_kwargs(cfg)
        if method == "rose":
            out = rose_prune(w, h, _find(accs, SumSquares).sum_sq, sparsity,
                             reorder=cfg.reorder, threshold=cfg.threshold, **kw)
        else:
            out = sparsegpt_prune(w, h, sparsity, factor_cache=cache, **kw)
        new = out[0]
    set_weight_out_in(module, new)


def _joint_key(module, accs, cfg):
    """Linears whose SparseGPT runs can be stacked row-wise into one: plain SparseGPT, a
    per-row decision (N:M, or unstructured per row) and one shared Gram accumulator."""
    if cfg.method != "sparsegpt" or getattr(cfg, "hessian_alpha", 0.0) > 0 \
            or (cfg.group != "row" and not cfg.pattern):
        return None
    gram = _find(accs, Gram)
    if gram is None:
        return None
    w = weight_out_in(module)
    return id(gram), w.dtype, w.device


@torch.no_grad()
def prune_linears(modules: dict, accs: dict, cfg, sparsity: float) -> None:
    """Prune ``modules`` (path -> linear) in place, each as :func:`prune_linear` would.

    SparseGPT decides and updates every output row on its own (per-row masks, row-wise
    OBS updates), so linears that share one Gram (q/k/v, gate/up) are pruned as one
    matrix with their rows stacked: one column sweep instead of three; the result equals
    separate runs up to float rounding.
    """
    joint: dict = {}
    for path, module in modules.items():
        key = _joint_key(module, accs.get(path), cfg)
        if key is None:
            prune_linear(module, accs.get(path), cfg, sparsity)
        else:
            joint.setdefault(key, []).append(path)
    for paths in joint.values():
        if len(paths) == 1:
            prune_linear(modules[paths[0]], accs.get(paths[0]), cfg, sparsity)
            continue
        gram = _find(accs[paths[0]], Gram)
        ws = [weight_out_in(modules[p]).detach() for p in paths]
        new, _ = sparsegpt_prune(torch.cat(ws), gram.xtx.float(), sparsity,
                                 factor_cache=gram.__dict__.setdefault("_sparsegpt_factor", {}),
                                 **_sparsegpt_kwargs(cfg))
        for p, part in zip(paths, new.split([w.shape[0] for w in ws]), strict=True):
            set_weight_out_in(modules[p], part)
