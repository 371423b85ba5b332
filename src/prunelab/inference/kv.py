"""KV-cache eviction: selection per KV group from a press' token scores (its ``score``
hook, :class:`~prunelab.inference.config.Press`) and the real shrinking of the cache
tensors. Nothing here knows a press by its class.

The cache stores one key/value per KV head, so selection is per KV group: each KV head
keeps its own ``keep`` tokens (the same count for every KV head, so the cache stays a dense
``[B, G, keep, D]`` tensor); query heads of a group share their KV head's choice. Order is
preserved, and the keys were rotated (RoPE) before caching, so kept tokens keep their
original positions; new tokens continue from the original length (see ``press.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prunelab.inference.scores import keep_top, n_removed

if TYPE_CHECKING:  # the configs call this module (their default eviction)
    from prunelab.inference.config import Press


def fixed_positions(config: Press, length: int, keep: int, device, protect: int = 0
                    ) -> torch.Tensor:
    """Bool ``[length]``: the tokens a scoring press always keeps (they count in ``keep``):
    the first and last tokens its :meth:`~prunelab.inference.config.Press.protected` names
    (SnapKV's window, H2O's recent share, TOVA's last token, the sinks) and the last
    ``protect`` tokens (a question in query-aware mode). When they exceed ``keep``, the
    ``keep`` most recent instead."""
    first, last = config.protected(length, keep)
    fixed = torch.zeros(length, dtype=torch.bool, device=device)
    fixed[:max(min(int(first), length), 0)] = True
    if last:
        fixed[max(length - int(last), 0):] = True
    if protect:
        fixed[max(length - protect, 0):] = True
    if int(fixed.sum()) > keep:  # the window alone exceeds the budget: the most recent
        fixed[:] = False
        fixed[length - keep:] = True
    return fixed


def keep_indices(config: Press, length: int, keep: int, scores: torch.Tensor | None,
                 batch: int, groups: int, device, protect: int = 0) -> torch.Tensor:
    """Sorted token indices ``[B, G, keep]`` each KV head keeps out of ``length``: the
    ``keep`` highest ``scores`` ``[B, G, length]`` (the press' own, from its score hook),
    its fixed tokens first (see :func:`fixed_positions`). ``scores`` ``None`` (a block the
    press saw no attention call of): the ``keep`` most recent."""
    if scores is None:
        idx = torch.arange(length - keep, length, device=device)
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
