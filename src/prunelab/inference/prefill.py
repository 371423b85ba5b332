"""Mid-prefill token pruning: after block ``layer`` the hidden states of dropped tokens are
removed, so blocks ``layer + 1 ...`` run on the kept tokens only, with the kept tokens'
original RoPE position embeddings, position ids and attention-mask rows and columns. After
the prefill, the cache entries of the dropped tokens are removed from blocks ``0..layer``
too, so every cache layer holds the kept tokens.

Which tokens go is the press' own choice (its ``select`` hook, from the attention of its
``observers`` last prompt tokens at the block: LazyLLM and EntroPrefill in
:mod:`prunelab.inference.select`); this module only shortens the run.
"""

from __future__ import annotations

import torch

from prunelab.inference.base import Press, check_kept
from prunelab.inference.kv import shrink_layer
from prunelab.inference.select import jaccard_removed


def _gather_seq(t: torch.Tensor, keep: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather ``keep`` ``[B, K]`` along ``dim`` of ``t`` (batch first; a batch of one is
    broadcast)."""
    if t.shape[0] == 1 and keep.shape[0] > 1:
        t = t.expand(keep.shape[0], *t.shape[1:])
    shape = [keep.shape[0]] + [1] * (t.dim() - 1)
    shape[dim] = keep.shape[1]
    idx = keep.view(shape).expand(*[s if i != dim else keep.shape[1]
                                    for i, s in enumerate(t.shape)])
    return t.gather(dim, idx)


class TokenPruner:
    """Hooks on the blocks of one model that shorten the prefill after block ``layer`` (or,
    for an adaptive EntroPrefill, after the first block ``1..layer`` whose removal set is
    stable: Jaccard overlap with the previous block's at least ``stability``). Active only
    while ``session.phase == "prefill"``; ``remove()`` takes every hook off."""

    def __init__(self, session, config: Press):
        self.session, self.config = session, config
        blocks = list(session.lm.adapter.blocks())
        self.adaptive = bool(getattr(config, "adaptive", False))
        self.max_layer = config.layer
        first = 1 if self.adaptive and config.layer > 0 else config.layer
        self.candidates = range(first if not self.adaptive else 0, config.layer + 1)
        self.layer = config.layer
        self.probs: dict[int, torch.Tensor] = {}
        self.reset()
        self.handles = [blocks[i].register_forward_hook(self._hook(i))
                        for i in range(first, config.layer + 1)]
        for blk in blocks[first + 1:]:
            self.handles.append(blk.register_forward_pre_hook(self._before_layer,
                                                              with_kwargs=True))

    @property
    def rows(self) -> int:
        return self.config.observers

    def wants(self, layer: int) -> bool:
        """Whether the attention of block ``layer`` is needed now."""
        return not self.decided and layer in self.candidates

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def reset(self) -> None:
        self.probs = {}
        self.keep = self.exit_hidden = self.previous = None
        self.decided = False
        self.info: dict = {}

    def _hook(self, index: int):
        def hook(module, args, output):
            return self._after_layer(index, output)
        return hook

    def _decide(self, index: int) -> tuple[torch.Tensor, dict] | None:
        """Kept indices at block ``index``, or ``None`` to wait for a later block."""
        if self.adaptive and index - 1 in self.probs and self.previous is None:
            prev, _ = self._select(self.probs.pop(index - 1))
            self.previous = prev
        probs = self.probs.pop(index)
        keep, info = self._select(probs)
        if self.adaptive and index < self.max_layer:
            overlap = jaccard_removed(self.previous, keep, probs.shape[-1])
            self.previous = keep
            if overlap < self.config.stability:
                return None
        return keep, info

    def _select(self, probs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        keep, info = self.config.select(probs, self.session.groups)
        return check_kept(self.config, keep, probs.shape[0], probs.shape[-1]), dict(info)

    def _after_layer(self, index: int, output):
        if self.session.phase != "prefill" or self.decided or index not in self.probs:
            return output
        decision = self._decide(index)
        if decision is None:
            return output
        keep, self.info = decision
        self.info["layer"] = index
        self.decided, self.layer = True, index
        self.probs = {}
        hidden = output[0] if isinstance(output, tuple) else output
        if keep.shape[1] == hidden.shape[1]:
            return output
        self.keep, self.exit_hidden = keep, hidden
        short = _gather_seq(hidden, keep, 1)
        return (short, *output[1:]) if isinstance(output, tuple) else short

    def _before_layer(self, module, args, kwargs):
        if self.session.phase != "prefill" or self.keep is None:
            return None
        keep = self.keep
        pe = kwargs.get("position_embeddings")
        if pe is not None:
            kwargs["position_embeddings"] = tuple(_gather_seq(t, keep, 1) for t in pe)
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = _gather_seq(kwargs["position_ids"], keep, 1)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = self._mask(kwargs["attention_mask"])
        args = (args[0], *(self._mask(a) for a in args[1:]))  # GPT-2 passes it by position
        return args, kwargs

    def _mask(self, mask):
        """The kept rows and columns of a ``[B, 1, L, L]`` prefill mask (else unchanged)."""
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or self.exit_hidden is None:
            return mask
        n = self.exit_hidden.shape[1]
        if mask.shape[-1] != n or mask.shape[-2] != n:
            return mask
        return _gather_seq(_gather_seq(mask, self.keep, 2), self.keep, 3)

    def trim_cache(self, cache) -> None:
        """Remove the dropped tokens' entries from the cache layers ``0..layer``."""
        if self.keep is None:
            return
        for i in range(self.layer + 1):
            layer = cache.layers[i]
            if getattr(layer, "keys", None) is None or layer.keys.shape[2] == self.keep.shape[1]:
                continue
            g = layer.keys.shape[1]
            shrink_layer(layer, self.keep[:, None, :].expand(-1, g, -1))
