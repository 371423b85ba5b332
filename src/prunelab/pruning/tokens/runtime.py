"""Input-adaptive patch-token pruning by CLS attention (TAP-Path; EViT).

At each chosen layer ``l`` (0-based: before block ``l`` runs), the CLS token's attention
to the patch tokens is computed with block ``l``'s own pre-attention norm and query / key
projections on its input, averaged over heads (softmax over all keys, CLS included). The
top ``ceil(keep x patches)`` patch tokens are kept in their original order; the rest are
dropped or, with ``fuse``, replaced by one token: their attention-weighted mean (EViT's
inattentive-token fusion, Liang et al., "Not All Patches are What You Need", ICLR 2022).
Later blocks then really run on ``1 + kept (+ 1)`` tokens.

Seed: TAP-Path (a pathology ViT restructured to 24 of 32 blocks with 70 % of the patch
tokens kept, multi-depth feature recovery and a gated task head: 35 % less compute).
``keep = 1`` (or no layers) is the dense forward exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from prunelab.errors import ConfigError, UnsupportedArchitectureError
from prunelab.pruning.base import METHODS
from prunelab.pruning.tokens.checkpoint import TokenPruner
from prunelab.registry import check_range


@METHODS.register("tokens")
@dataclass(frozen=True)
class TokenPruning:
    """Patch-token pruning of a vision encoder by CLS attention (TAP-Path; EViT fusion):
    ``keep`` of the current patch tokens at each of ``layers`` (0-based blocks, pruning
    before the block runs); ``fuse`` merges the dropped tokens into one."""

    keep: float = field(default=0.7, metadata={
        "help": "share of the patch tokens kept at each layer", "budget": "keep-tokens"})
    layers: tuple = field(default=(3,), metadata={
        "help": "0-based blocks before which tokens are pruned"})
    fuse: bool = field(default=True, metadata={
        "help": "fuse the dropped tokens into one (EViT) or drop them"})

    def __post_init__(self):
        check_range("keep", self.keep, 1e-6, 1.0)
        raw = self.layers
        if isinstance(raw, str):
            raw = [x for x in raw.split(",") if x.strip()]
        elif isinstance(raw, int) and not isinstance(raw, bool):
            raw = [raw]
        try:
            layers = tuple(sorted({_block_index(x) for x in raw}))
        except (TypeError, ValueError):
            raise ConfigError(f"token pruning layers: 0-based block indices, got {self.layers!r}"
                              ) from None
        if any(x < 0 for x in layers):
            raise ConfigError(f"token pruning layers must be >= 0, got {list(self.layers)}")
        object.__setattr__(self, "layers", layers)


def _block_index(x) -> int:
    if isinstance(x, bool) or (isinstance(x, float) and not x.is_integer()):
        raise ValueError(x)
    return int(x)


@torch.no_grad()
def cls_attention(adapter, index: int, hidden: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: block ``index``'s head-averaged attention of the CLS query (token 0)
    to every token of ``hidden`` ``[B, T, d]`` (its input, before its norm)."""
    norm = adapter.norms(index).get(adapter.spec.norms[0])
    proj = adapter.attn_projections(index)
    geo = adapter.head_geometry(index)
    x = norm(hidden) if norm is not None else hidden
    return TokenPruner.cls_scores(x, proj["q"], proj["k"], geo.num_heads, geo.head_dim)


def prune_tokens(hidden: torch.Tensor, scores: torch.Tensor, keep: float,
                 fuse: bool) -> torch.Tensor:
    """``[B, 1 + k (+1), d]``: the CLS token, the ``k = ceil(keep x (T - 1))`` patch tokens
    of highest ``scores`` in their original order, and with ``fuse`` (when any token is
    dropped) the ``scores``-weighted mean of the dropped ones (one implementation with
    the checkpoint's :class:`~prunelab.pruning.tokens.checkpoint.TokenPruner`)."""
    return TokenPruner.select(hidden, scores, keep, fuse)


class TokenPrunedEncoder(nn.Module):
    """A vision encoder (a LoadedModel of a ``dinov2`` / ``vit`` family) whose forward
    prunes patch tokens at ``config.layers``; the wrapped model's weights are shared, not
    copied. ``forward(pixel_values)`` returns the final normed hidden states
    ``[B, tokens, d]`` (CLS first); ``forward(..., depths=(i, ...))`` also returns the
    normed hidden states after blocks ``i`` (0-based) in a list."""

    def __init__(self, lm, config: TokenPruning | None = None):
        super().__init__()
        if not getattr(lm.adapter, "is_vision", False):
            raise UnsupportedArchitectureError(
                f"token pruning needs a vision transformer (dinov2, vit), not "
                f"{lm.adapter.family}")
        self.lm = lm
        self.pruning = config or TokenPruning()
        n = lm.adapter.num_blocks
        if any(layer >= n for layer in self.pruning.layers):
            raise ConfigError(f"token pruning layers {list(self.pruning.layers)} out of "
                              f"range 0..{n - 1}")
        self.tokens_per_block: list[int] = []

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, depths: tuple = ()):
        ad = self.lm.adapter
        param = next(self.lm.model.parameters())
        h = ad.embed_pixels(pixel_values.to(param.device, param.dtype))
        norm = ad.final_norm() or nn.Identity()
        feats, counts = [], []
        for i in range(ad.num_blocks):
            if i in self.pruning.layers:
                h = prune_tokens(h, cls_attention(ad, i, h), self.pruning.keep,
                                 self.pruning.fuse)
            counts.append(h.shape[1])
            out = ad.block(i)(h, None)
            h = out[0] if isinstance(out, tuple) else out
            if i in depths:
                feats.append(norm(h))
        self.tokens_per_block = counts
        final = norm(h)
        return (final, feats) if depths else final
