"""ROSE: reordered SparseGPT.

Source: Su & Wang 2025, "ROSE: Reordered SparseGPT for More Accurate One-Shot Large
Language Models Pruning" (arXiv:2510.06751). SparseGPT
prunes columns left to right, so late columns have few weights left to absorb their error;
ROSE moves the columns with the largest expected pruning loss to the front, but only for
"columnar" layers, whose block losses differ a lot.
"""

from __future__ import annotations

from typing import Any

import torch

from prunelab.errors import ConfigError
from prunelab.pruning.sparsity.masks import (
    check_sparsity,
    nm_mask,
    parse_pattern,
    prune_count,
    prune_lowest_k,
    unstructured_mask,
)
from prunelab.pruning.sparsity.scores import wanda_scores
from prunelab.pruning.sparsity.sparsegpt import sparsegpt_prune

__all__ = ["rose_permutation", "rose_prune"]


def _pruned_scores(scores: torch.Tensor, s: float, nm: tuple[int, int] | None,
                   blocks: list[tuple[int, int]], pre_mask: str) -> torch.Tensor:
    """Wanda scores of the weights the pre-pruning removes (0 elsewhere), float64."""
    if nm is not None:
        pruned = ~nm_mask(scores, nm[0], nm[1])
    elif pre_mask == "row":
        pruned = ~unstructured_mask(scores, s, group="row")
    else:  # "block": joint choice over each [d_out, block] slice (the ROSE code)
        pruned = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        for b, e in blocks:
            part = scores[:, b:e].reshape(1, -1)
            k = prune_count(part.numel(), s)
            pruned[:, b:e] = ~prune_lowest_k(part, k).reshape(scores.shape[0], e - b)
    return scores * pruned


def rose_permutation(
    W: torch.Tensor,
    col_sq_norm: torch.Tensor,
    sparsity: float,
    blocksize: int = 128,
    threshold: float = 0.5,
    pattern: tuple[int, int] | str | None = None,
    pre_mask: str = "block",
) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """ROSE column order for ``W`` (``[d_out, d_in]``), or ``None`` if not columnar.

    Pre-prunes with Wanda scores ``|W| * sqrt(col_sq_norm)`` (``col_sq_norm: [d_in]``) at
    ``sparsity``: ``pre_mask="block"`` (default, as in the paper's code)
    prunes the lowest ``floor(numel * sparsity)`` scores of each ``[d_out, blocksize]``
    slice jointly, so a block of large weights has a large loss and moves to the front;
    ``"row"`` uses the layer's per-row unstructured Wanda mask instead (such a block then
    loses few weights and moves to the back). Column
    loss = sum of the pruned scores of a column; block loss = sum over a block of
    ``blocksize`` columns. If ``(max - min) / max`` of the block losses exceeds ``threshold``
    the layer is columnar and the permutation (LongTensor ``[d_in]``) lists the blocks by
    block loss descending and, inside each block, the columns by column loss descending
    (stable: ties keep index order). With an N:M ``pattern`` the pre-pruning is the N:M
    Wanda mask and the "blocks" are the M-column groups, reordered as wholes (as in the ROSE
    code), so the N:M groups of the original column order survive the permutation.

    ``info``: ``columnar`` (bool), ``relative_range`` (float), ``block_size`` (int),
    ``block_loss`` (float64 tensor, one per block). Defaults follow the paper (128, 0.5).
    """
    s = check_sparsity(sparsity)
    nm = parse_pattern(pattern) if isinstance(pattern, str) or pattern is None else pattern
    if blocksize < 1:
        raise ConfigError(f"ROSE blocksize={blocksize} must be >= 1")
    if pre_mask not in ("row", "block"):
        raise ConfigError(f"ROSE pre_mask {pre_mask!r} must be 'row' or 'block'")
    cols = W.shape[1]
    size = int(nm[1]) if nm is not None else int(blocksize)
    blocks = [(b, min(b + size, cols)) for b in range(0, cols, size)]
    scores = wanda_scores(W, col_sq_norm).double()
    col_loss = _pruned_scores(scores, s, nm, blocks, pre_mask).sum(dim=0)
    block_loss = torch.stack([col_loss[b:e].sum() for b, e in blocks])
    top = float(block_loss.max())
    rel = (top - float(block_loss.min())) / top if top > 0 else 0.0
    columnar = rel > threshold
    info: dict[str, Any] = {"columnar": columnar, "relative_range": rel, "block_size": size,
                            "block_loss": block_loss.cpu()}
    if not columnar:
        return None, info
    parts = []
    for idx in torch.sort(-block_loss, stable=True).indices.tolist():
        b, e = blocks[idx]
        if nm is not None:
            parts.append(torch.arange(b, e, device=W.device))
        else:
            parts.append(b + torch.sort(-col_loss[b:e], stable=True).indices)
    return torch.cat(parts).long(), info


def rose_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    col_sq_norm: torch.Tensor,
    sparsity: float,
    pattern: tuple[int, int] | str | None = None,
    blocksize: int = 128,
    reorder: bool = True,
    threshold: float = 0.5,
    percdamp: float = 0.01,
    pre_mask: str = "block",
    mask_group: str = "row",
) -> tuple[torch.Tensor, torch.Tensor]:
    """ROSE: SparseGPT on the :func:`rose_permutation` column order; ``(W_new, kept_mask)``.

    ``W``: ``[d_out, d_in]``; ``H``: ``[d_in, d_in]`` (``X^T X`` up to scale);
    ``col_sq_norm``: ``[d_in]`` Wanda statistic. ``reorder=False``, or a layer that is not
    columnar, gives exactly ``sparsegpt_prune(W, H, sparsity, pattern, blocksize,
    percdamp)``. Other arguments as in :func:`sparsegpt_prune` / :func:`rose_permutation`.
    To log whether a layer was reordered, call :func:`rose_permutation` and pass its
    permutation to :func:`sparsegpt_prune` yourself.
    """
    perm = None
    if reorder:
        perm, _ = rose_permutation(W, col_sq_norm, sparsity, blocksize, threshold, pattern,
                                   pre_mask)
    return sparsegpt_prune(W, H, sparsity, pattern=pattern, blocksize=blocksize,
                           percdamp=percdamp, perm=perm, mask_group=mask_group)
