"""Pure maths of the presses: attention rows from captured queries and keys, pooling of
head scores, Renyi entropy and the deletion envelope. Tensors in, tensors out (float32).
Also :class:`ScoreInputs`, what a press' scoring hook sees of one attention call.

Shapes: ``B`` batch, ``H`` query heads, ``G`` KV heads (groups), ``L`` keys, ``Q`` queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ScoreInputs:
    """One attention block's call, as a press' :meth:`~prunelab.inference.config.Press.score`
    sees it (kvpress gives its ``ScorerPress.score`` the same: the module, the keys and values
    of the cache, the queries through the hidden states).

    ``query`` ``[B, H, Q, D]``: the queries of the tokens of this forward (the whole prompt
    at the prefill, the new tokens at a decode step), after RoPE; ``key`` / ``value``
    ``[B, G, L, D]``: every cached entry of the block, these tokens included (keys after
    RoPE); ``scaling``: the block's attention scaling; ``softcap``: its logit softcap
    (``None`` without); ``layer``: the 0-based block; ``module``: the attention module;
    ``rope``: the rotary ``(cos, sin)`` ``[B, Q, r]`` the block received (``None`` when the
    family passes none)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float
    softcap: float | None = None
    layer: int = 0
    module: Any = None
    rope: tuple | None = None

    @property
    def groups(self) -> int:
        """``G``, the KV heads."""
        return self.key.shape[1]

    def attention(self, rows: int) -> torch.Tensor:
        """Softmax attention ``[B, H, rows, L]`` of the last ``rows`` queries over the cached
        keys (causal, float32; :func:`attention_rows`)."""
        return attention_rows(self.query, self.key, self.scaling, rows, self.softcap)


def attention_rows(query: torch.Tensor, key: torch.Tensor, scaling: float, rows: int,
                   softcap: float | None = None, chunk: int = 256) -> torch.Tensor:
    """Softmax attention of the last ``rows`` queries ``[B, H, Q, D]`` over ``key``
    ``[B, G, L, D]`` (causal: the queries are the last ``Q`` of the ``L`` positions, query
    ``i`` sees keys ``<= L - Q + i``), as ``[B, H, rows, L]`` float32 probabilities.
    Computed ``chunk`` query rows at a time."""
    b, h, q, _ = query.shape
    g, length = key.shape[1], key.shape[2]
    rows = min(rows, q)
    k = key.float().repeat_interleave(h // g, dim=1)
    out = []
    for start in range(q - rows, q, chunk):
        qs = query[:, :, start:min(start + chunk, q)].float()
        logits = qs @ k.transpose(-1, -2) * scaling
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        pos = torch.arange(start, start + qs.shape[2], device=key.device) + (length - q)
        future = torch.arange(length, device=key.device)[None, :] > pos[:, None]
        out.append(logits.masked_fill(future, float("-inf")).softmax(-1))
    return torch.cat(out, dim=2)


def group_heads(scores: torch.Tensor, groups: int, mix: float = 0.0) -> torch.Tensor:
    """Pool query-head scores ``[B, H, L]`` to KV groups ``[B, groups, L]`` by
    ``(1 - mix) * mean + mix * max`` over the heads of each group."""
    b, h, length = scores.shape
    s = scores.view(b, groups, h // groups, length)
    return (1.0 - mix) * s.mean(2) + mix * s.amax(2)


def smooth(scores: torch.Tensor, kernel: int, pooling: str = "max") -> torch.Tensor:
    """1-D pooling of width ``kernel`` (odd, stride 1, same length) along the last dim
    (SnapKV's clustering of neighbouring tokens)."""
    if kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    pad = kernel // 2
    if pooling == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        out = F.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=False)
    return out.reshape(shape)


def renyi_entropy(p: torch.Tensor, alpha: float) -> torch.Tensor:
    """Renyi entropy ``1 / (1 - alpha) * log(sum p^alpha)`` of the distributions along the
    last dim (renormalised first; zeros allowed), in nats. ``alpha != 1``."""
    p = p.double()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.log((p ** alpha).sum(-1).clamp_min(1e-300)) / (1.0 - alpha)


def deletion_envelope(head_mass: torch.Tensor, order: torch.Tensor, bound: float
                      ) -> torch.Tensor:
    """The largest ``r`` per row such that removing the first ``r`` tokens of ``order``
    discards at most ``bound`` attention mass for every head.

    ``head_mass``: ``[B, H, L]`` per-head token masses; ``order``: ``[B, C]`` candidate
    token indices, removal order (least important first). Returns ``[B]`` long. Exact: the
    discarded mass of a head is non-decreasing in ``r``, so the envelope is the count of
    prefixes whose worst head stays within the bound."""
    b, h, _ = head_mass.shape
    picked = head_mass.double().gather(2, order[:, None, :].expand(b, h, -1))
    worst = picked.cumsum(-1).amax(1)  # [B, C]: worst head after removing 1..C tokens
    return (worst <= bound).sum(-1)


def discarded_mass(head_mass: torch.Tensor, removed: torch.Tensor) -> torch.Tensor:
    """Attention mass ``[B, H]`` of the ``removed`` token indices ``[B, R]``."""
    b, h, _ = head_mass.shape
    if removed.shape[1] == 0:
        return head_mass.new_zeros(b, h, dtype=torch.float64)
    return head_mass.double().gather(2, removed[:, None, :].expand(b, h, -1)).sum(-1)


def keep_top(scores: torch.Tensor, keep: int, fixed: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Sorted indices ``[..., keep]`` of the ``keep`` highest ``scores`` ``[..., L]``;
    positions where ``fixed`` (bool ``[L]``) is true are always kept (they count in
    ``keep``). Ties broken toward earlier tokens (stable)."""
    s = scores.float().clone()
    if fixed is not None:
        s[..., fixed] = float("inf")
    idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :keep]
    return idx.sort(-1).values


def proposed_keep(pooled: torch.Tensor, alpha: float, scale: float) -> torch.Tensor:
    """Entropy-guided number of candidates to keep, ``ceil(scale * exp(H_alpha))`` per
    row of ``pooled`` ``[B, C]`` (the effective number of attended tokens)."""
    eff = torch.exp(renyi_entropy(pooled, alpha)) * scale
    return torch.ceil(eff - 1e-9).long().clamp(0, pooled.shape[-1])


def n_removed(length: int, ratio: float) -> int:
    """Tokens removed from ``length`` at ``ratio`` (floor: ratio 0 removes none)."""
    return int(math.floor(length * ratio + 1e-9))


def last_query_scores(query: torch.Tensor, key: torch.Tensor, scaling: float,
                      softcap: float | None) -> torch.Tensor:
    """TOVA's score ``[B, G, L]``: the attention of the last query of ``query``
    ``[B, H, Q, D]`` over ``key`` ``[B, G, L, D]``, averaged over all ``H`` query heads (the
    same row for every KV head)."""
    probs = attention_rows(query, key, scaling, 1, softcap)  # [B, H, 1, L]
    return probs[:, :, 0].mean(1, keepdim=True).expand(-1, key.shape[1], -1).contiguous()


def key_norm_scores(key: torch.Tensor) -> torch.Tensor:
    """KNorm's score ``[B, G, L]``: minus the L2 norm of each key ``[B, G, L, D]``."""
    return -key.float().norm(dim=-1)
