"""KV-cache eviction: scores from the captured attention, selection per KV group and the
real shrinking of the cache tensors.

The cache stores one key/value per KV head, so selection is per KV group: each KV head
keeps its own ``keep`` tokens (the same count for every KV head, so the cache stays a dense
``[B, G, keep, D]`` tensor); query heads of a group share their KV head's choice. Order is
preserved, and the keys were rotated (RoPE) before caching, so kept tokens keep their
original positions; new tokens continue from the original length (see ``press.py``).
"""

from __future__ import annotations

import torch

from prunelab.errors import UnsupportedOperationError
from prunelab.inference.config import H2O, TOVA, KNorm, Press, SnapKV, StreamingLLM
from prunelab.inference.decay import DecayEviction
from prunelab.inference.expected import ExpectedAttention, expected_scores, rope_function
from prunelab.inference.scores import (
    attention_rows,
    group_heads,
    keep_top,
    n_removed,
    smooth,
)


def prefill_scores(config: Press, query: torch.Tensor, key: torch.Tensor, scaling: float,
                   softcap: float | None) -> torch.Tensor | None:
    """Token scores ``[B, G, L]`` for eviction after the prefill, from one block's
    queries ``[B, H, L, D]`` and keys ``[B, G, L, D]`` (``None`` when the press needs
    none)."""
    groups = key.shape[1]
    if isinstance(config, SnapKV):
        probs = attention_rows(query, key, scaling, config.window, softcap)
        s = smooth(probs.sum(2), config.kernel, config.pooling)
        return group_heads(s, groups)
    if isinstance(config, H2O):
        probs = attention_rows(query, key, scaling, query.shape[2], softcap)
        return group_heads(probs.sum(2), groups)
    if isinstance(config, TOVA):
        return last_query_scores(query, key, scaling, softcap)
    if isinstance(config, KNorm):
        return key_norm_scores(key)
    if isinstance(config, DecayEviction) and config.observe:  # observation-window feature
        from prunelab.inference.decay import observation_scores, snap_scores

        if config.blend is not None and config.mix:  # SnapKV's and H2O's scores
            probs = attention_rows(query, key, scaling, query.shape[2], softcap)
            snap = snap_scores(probs[:, :, -config.observe:], groups, config.kernel)
            return torch.stack([snap, group_heads(probs.sum(2), groups)], -1)
        probs = attention_rows(query, key, scaling, config.observe, softcap)
        if config.blend is not None:
            return snap_scores(probs, groups, config.kernel)
        return observation_scores(probs, groups, config.kernel)
    return None


def expected_attention_scores(config: ExpectedAttention, module, query: torch.Tensor,
                              key: torch.Tensor, value: torch.Tensor, scaling: float,
                              rope: tuple | None) -> torch.Tensor:
    """ExpectedAttention's scores ``[B, G, L]`` of one block's prefill; ``rope``: the
    ``(cos, sin)`` ``[B, L, r]`` the block received (:mod:`prunelab.inference.expected`)."""
    if not isinstance(rope, tuple) or len(rope) != 2:
        raise UnsupportedOperationError(
            f"press expected-attention needs the rotary (cos, sin) of every attention block; "
            f"{type(module).__name__} receives none")
    cos, sin = rope
    return expected_scores(config, query, key, value, scaling, cos[0], sin[0],
                           rope_function(module))


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


def decode_scores(query: torch.Tensor, key: torch.Tensor, scaling: float,
                  softcap: float | None) -> torch.Tensor:
    """Attention ``[B, G, T]`` of the decode queries ``[B, H, q, D]`` (summed) over the
    cached keys ``[B, G, T, D]`` (H2O's running accumulation)."""
    probs = attention_rows(query, key, scaling, query.shape[2], softcap)
    return group_heads(probs.sum(2), key.shape[1])


def fixed_positions(config: Press, length: int, keep: int, device, protect: int = 0
                    ) -> torch.Tensor:
    """Bool ``[length]``: the tokens a scoring press always keeps (they count in ``keep``):
    SnapKV's window, H2O's recent share, TOVA's last token, the sinks, and the last
    ``protect`` tokens (a question in query-aware mode). When they exceed ``keep``, the
    ``keep`` most recent instead."""
    fixed = torch.zeros(length, dtype=torch.bool, device=device)
    if isinstance(config, (SnapKV, DecayEviction)):
        fixed[max(length - config.window, 0):] = True
        if isinstance(config, DecayEviction) and config.blend is None:
            fixed[0] = True
    elif isinstance(config, H2O):
        recent = min(int(keep * config.recent), keep)
        if recent:
            fixed[length - recent:] = True
    elif isinstance(config, TOVA):
        fixed[length - 1] = True  # the last token, whose query scored the others
    elif isinstance(config, ExpectedAttention):
        fixed[:min(config.sinks, length)] = True
    if protect:
        fixed[max(length - protect, 0):] = True
    if int(fixed.sum()) > keep:  # the window alone exceeds the budget: the most recent
        fixed[:] = False
        fixed[length - keep:] = True
    return fixed


def keep_indices(config: Press, length: int, keep: int, scores: torch.Tensor | None,
                 batch: int, groups: int, device, protect: int = 0) -> torch.Tensor:
    """Sorted token indices ``[B, G, keep]`` each KV head keeps out of ``length``
    (``protect``: the last tokens always kept, see :func:`fixed_positions`)."""
    if isinstance(config, StreamingLLM) or scores is None:
        sinks = min(config.sinks if isinstance(config, StreamingLLM) else 0, keep)
        idx = torch.cat([torch.arange(sinks, device=device),
                         torch.arange(length - (keep - sinks), length, device=device)])
        return idx.expand(batch, groups, keep).contiguous()
    return keep_top(scores, keep, fixed_positions(config, length, keep, device, protect))


def budget(config: Press, length: int) -> int:
    """Tokens kept out of a ``length``-token prompt (at least one)."""
    return max(length - n_removed(length, config.ratio), 1)


def evictable_layers(cache) -> list[int]:
    """Indices of the cache layers eviction may shrink: initialised, not sliding-window
    (a sliding-window layer keeps its own bounded window)."""
    out = []
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or not getattr(layer, "is_initialized", False):
            continue
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        out.append(i)
    return out


def shrink_layer(layer, idx: torch.Tensor) -> None:
    """Keep tokens ``idx`` ``[B, G, keep]`` of one cache layer (keys and values
    ``[B, G, T, D]``); the new tensors are contiguous, so the memory is really freed."""
    gather = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
    layer.keys = layer.keys.gather(2, gather).contiguous()
    layer.values = layer.values.gather(
        2, idx[..., None].expand(-1, -1, -1, layer.values.shape[-1])).contiguous()


def evict(config: Press, cache, keep: int, scores: dict[int, torch.Tensor],
          protect: int = 0) -> dict:
    """Shrink every evictable layer of ``cache`` to ``keep`` tokens; ``scores`` maps a
    layer to its ``[B, G, T]`` token scores; the last ``protect`` tokens are always kept.
    Returns ``{layer: kept indices}``."""
    kept = {}
    for i in evictable_layers(cache):
        layer = cache.layers[i]
        b, g, length, _ = layer.keys.shape
        if length <= keep:
            continue
        idx = keep_indices(config, length, keep, scores.get(i), b, g, layer.keys.device,
                           protect)
        shrink_layer(layer, idx)
        if i in scores:
            scores[i] = scores[i].gather(2, idx)
        kept[i] = idx
    return kept


def cache_bytes(cache) -> int:
    """Bytes held by the key and value tensors of ``cache``."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
