"""Mid-prefill token pruning: after block ``layer`` the hidden states of dropped tokens are
removed, so blocks ``layer + 1 ...`` run on the kept tokens only, with the kept tokens'
original RoPE position embeddings, position ids and attention-mask rows and columns. After
the prefill, the cache entries of the dropped tokens are removed from blocks ``0..layer``
too, so every cache layer holds the kept tokens.

Methods: LazyLLM (Fu et al. 2024; last-token attention, fixed layer) and EntroPrefill (the
seed of prunelab issue 18; observer-window attention, entropy-proposed cut, exact deletion
envelope under a per-head attention-mass bound).
"""

from __future__ import annotations

import torch

from prunelab.inference.config import EntroPrefill, LazyLLM, Press
from prunelab.inference.scores import (
    deletion_envelope,
    discarded_mass,
    group_heads,
    keep_top,
    n_removed,
    proposed_keep,
    renyi_entropy,
)


def lazyllm_keep(config: LazyLLM, probs: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Kept token indices ``[B, K]`` from the last token's attention ``probs``
    ``[B, H, 1, L]`` (mean over heads); the last token is always kept."""
    b, _, _, length = probs.shape
    score = probs[:, :, -1].mean(1)
    remove = min(n_removed(length, config.ratio), length - 1)
    fixed = torch.zeros(length, dtype=torch.bool, device=probs.device)
    fixed[-1] = True
    keep = keep_top(score, length - remove, fixed)
    mass = discarded_mass(probs[:, :, -1], _complement(keep, length))
    return keep, {"removed": remove, "discarded_mass": mass}


def entroprefill_keep(config: EntroPrefill, probs: torch.Tensor, groups: int
                      ) -> tuple[torch.Tensor, dict]:
    """Kept token indices ``[B, K]`` from the observers' attention ``probs``
    ``[B, H, w, L]`` (see :class:`EntroPrefill`). The removal is the smaller of the
    entropy proposal (capped at ``max_ratio``) and the deletion envelope, minimised over
    the batch so that one length fits every row; the bound then holds on every head of
    every row. Info: per-row proposal, envelope, entropy and per-head discarded mass."""
    b, h, w, length = probs.shape
    head_mass = probs.mean(2)  # [B, H, L]: each head's distribution over the prompt
    n_cand = max(length - w - 1, 0)
    if n_cand == 0:
        keep = torch.arange(length, device=probs.device).expand(b, length)
        return keep, {"removed": 0, "discarded_mass": head_mass.new_zeros(b, h).double()}
    per_group = group_heads(head_mass, groups, config.mix)  # [B, G, L]
    token = (1 - config.mix) * per_group.mean(1) + config.mix * per_group.amax(1)
    cand = token[:, 1:1 + n_cand]  # the sink (0) and the observers are isolated
    order = torch.sort(cand, dim=-1, stable=True).indices + 1  # least attended first
    proposal = n_cand - proposed_keep(cand, config.alpha, config.keep_scale)
    proposal = proposal.clamp(max=min(n_removed(length, config.max_ratio), n_cand))
    envelope = deletion_envelope(head_mass, order, config.mass_bound)
    remove = int(torch.minimum(proposal, envelope).min())
    removed = order[:, :remove]
    keep = _complement(removed, length)
    info = {"removed": remove, "proposal": proposal.tolist(), "envelope": envelope.tolist(),
            "entropy": renyi_entropy(cand, config.alpha).tolist(),
            "discarded_mass": discarded_mass(head_mass, removed)}
    return keep, info


def _complement(idx: torch.Tensor, length: int) -> torch.Tensor:
    """Sorted indices ``[B, length - n]`` of ``0..length-1`` not in ``idx`` ``[B, n]``."""
    mask = torch.ones(idx.shape[0], length, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, False)
    return mask.nonzero()[:, 1].view(idx.shape[0], length - idx.shape[1])


def _jaccard_removed(a: torch.Tensor, b: torch.Tensor, length: int) -> float:
    """Jaccard overlap of the removed sets (complements of kept ``[B, K]`` indices),
    over the batch; 1 when both remove nothing."""
    ra = torch.ones(a.shape[0], length, dtype=torch.bool, device=a.device)
    rb = torch.ones_like(ra)
    ra.scatter_(1, a, False)
    rb.scatter_(1, b, False)
    union = int((ra | rb).sum())
    return 1.0 if union == 0 else int((ra & rb).sum()) / union


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
        return self.config.window if isinstance(self.config, EntroPrefill) else 1

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
            prev, _ = entroprefill_keep(self.config, self.probs.pop(index - 1),
                                        self.session.groups)
            self.previous = prev
        probs = self.probs.pop(index)
        if isinstance(self.config, EntroPrefill):
            keep, info = entroprefill_keep(self.config, probs, self.session.groups)
        else:
            keep, info = lazyllm_keep(self.config, probs)
        if self.adaptive and index < self.max_layer:
            overlap = _jaccard_removed(self.previous, keep, probs.shape[-1])
            self.previous = keep
            if overlap < self.config.stability:
                return None
        return keep, info

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
        from prunelab.inference.kv import shrink_layer
        for i in range(self.layer + 1):
            layer = cache.layers[i]
            if getattr(layer, "keys", None) is None or layer.keys.shape[2] == self.keep.shape[1]:
                continue
            g = layer.keys.shape[1]
            shrink_layer(layer, self.keep[:, None, :].expand(-1, g, -1))
