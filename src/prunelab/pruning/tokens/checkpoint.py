"""Token pruning written into the model: a checkpoint that prunes patch tokens by itself.

:class:`TokenPruner` is a prunelab custom module (:mod:`prunelab.models.custom`) placed
inside each pruning block (``<block>.token_pruner``); at attach it registers a forward
pre-hook on that block which replaces the block's input hidden states by the pruned ones
(CLS attention of the block's own norm and query / key projections; the top share of the
patch tokens kept, the rest dropped or fused into one, as
:mod:`prunelab.pruning.tokens.runtime`, EViT / TAP-Path). It holds no weights, only its
spec, so a saved model gets the generated modeling file (:mod:`prunelab.checkpoint.remote`) and
reloads with ``AutoModel.from_pretrained(path, trust_remote_code=True)``; its
``last_hidden_state`` then has ``1 + kept (+ 1)`` tokens, CLS first.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prunelab.models.custom import PrunelabModule, register_module


@register_module
class TokenPruner(PrunelabModule):
    """Prunes the input of its parent block: keep ``keep`` of the patch tokens by the CLS
    query's head-averaged attention (``num_heads`` x ``head_dim``; ``norm``, ``query``,
    ``key``: paths of the block's pre-attention norm and projections), ``fuse`` the rest
    into their attention-weighted mean."""

    prunelab_kind = "token_pruner"

    def __init__(self, keep: float, fuse: bool, num_heads: int, head_dim: int, norm: str,
                 query: str, key: str):
        super().__init__()
        self.keep, self.fuse = float(keep), bool(fuse)
        self.num_heads, self.head_dim = int(num_heads), int(head_dim)
        self.paths = {"norm": norm, "query": query, "key": key}

    def prunelab_spec(self) -> dict:
        return {"keep": self.keep, "fuse": self.fuse, "num_heads": self.num_heads,
                "head_dim": self.head_dim, **self.paths}

    def prunelab_attach(self, owner: nn.Module, root: nn.Module) -> None:
        owner.register_forward_pre_hook(self._prune_input, with_kwargs=True)

    def _prune_input(self, block, args, kwargs):
        if args:
            return (self(args[0], block), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self(kwargs["hidden_states"], block)}

    @staticmethod
    def cls_scores(x: torch.Tensor, query: nn.Module, key: nn.Module, num_heads: int,
                   head_dim: int) -> torch.Tensor:
        """``[B, T]``: head-averaged softmax attention of token 0's query to every token
        of the normed ``x`` ``[B, T, d]``."""
        b, t, _ = x.shape
        q = query(x[:, :1]).view(b, 1, num_heads, head_dim).transpose(1, 2)
        k = key(x).view(b, t, num_heads, head_dim).transpose(1, 2)
        att = (q @ k.transpose(-1, -2)) * head_dim ** -0.5
        return att.softmax(-1).mean(1)[:, 0]

    @staticmethod
    def select(hidden: torch.Tensor, scores: torch.Tensor, keep: float,
               fuse: bool) -> torch.Tensor:
        """``[B, 1 + k (+1), d]``: CLS, the ``k = ceil(keep x (T - 1))`` patch tokens of
        highest ``scores`` in their original order, and with ``fuse`` (when any token is
        dropped) the ``scores``-weighted mean of the dropped ones."""
        patches = hidden.shape[1] - 1
        k = min(patches, max(1, math.ceil(keep * patches - 1e-9)))
        if k == patches:
            return hidden
        s = scores[:, 1:]
        order = s.argsort(dim=-1, descending=True, stable=True)
        kept = order[:, :k].sort(dim=-1).values
        d = hidden.shape[-1]
        parts = [hidden[:, :1], hidden[:, 1:].gather(1, kept[..., None].expand(-1, -1, d))]
        if fuse:
            dropped = order[:, k:]
            w = s.gather(1, dropped)
            w = w / w.sum(-1, keepdim=True).clamp_min(1e-12)
            tokens = hidden[:, 1:].gather(1, dropped[..., None].expand(-1, -1, d))
            parts.append((tokens * w[..., None]).sum(1, keepdim=True))
        return torch.cat(parts, dim=1)

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, block: nn.Module) -> torch.Tensor:
        x = block.get_submodule(self.paths["norm"])(hidden)
        scores = self.cls_scores(x, block.get_submodule(self.paths["query"]),
                                 block.get_submodule(self.paths["key"]), self.num_heads,
                                 self.head_dim)
        return self.select(hidden, scores, self.keep, self.fuse)

    def flops_per_token(self) -> int:
        return 0

    def extra_repr(self) -> str:
        return f"keep={self.keep}, fuse={self.fuse}"
