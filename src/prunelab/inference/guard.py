"""The guard of a cache a press compressed: it remembers the tokens it has seen and refuses
to be continued outside a press' forward (see :mod:`prunelab.inference.press`)."""

from __future__ import annotations

from transformers import DynamicCache

from prunelab.errors import PressedCacheError

_STEPPING: set[int] = set()  # ids of the caches inside a press' forward right now


class _PressedCache:
    """Mixed into a cache once a press has compressed it: its ``update`` (called by every
    attention block of a forward) refuses to run outside a press' forward, where the
    model would take the shrunken cache length for the position of the new tokens."""

    prunelab_seen: int = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if id(self) not in _STEPPING:
            raise PressedCacheError(
                f"this KV cache was compressed by a press ({self.prunelab_seen} tokens seen, "
                f"{self.get_seq_length()} kept in block 0): continue it inside a `with "
                f"press(...)` block, which numbers new tokens from {self.prunelab_seen}; "
                "outside one the model would number them from the shrunken length (wrong "
                "positions)")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class PressedDynamicCache(_PressedCache, DynamicCache):
    """A :class:`~transformers.DynamicCache` a press has compressed (see
    :class:`_PressedCache`)."""


_PRESSED_CLASSES: dict[type, type] = {DynamicCache: PressedDynamicCache}


def _mark_pressed(cache, seen: int) -> None:
    """Record the tokens ``cache`` has seen and guard it against use outside a press."""
    if not isinstance(cache, _PressedCache):
        cls = type(cache)
        if cls not in _PRESSED_CLASSES:
            _PRESSED_CLASSES[cls] = type("Pressed" + cls.__name__, (_PressedCache, cls), {})
        cache.__class__ = _PRESSED_CLASSES[cls]
    cache.prunelab_seen = seen
