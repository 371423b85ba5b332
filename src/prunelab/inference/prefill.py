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
    """Hooks on the blocks of one model that shorten the prefill after ``config.layer``.
    Active only while ``session.phase == "prefill"``; ``remove()`` takes every hook off."""

    def __init__(self, session, config: Press):
        self.session, self.config = session, config
        blocks = session.lm.adapter.blocks()
        self.layer = config.layer
        self.probs: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None
        self.exit_hidden: torch.Tensor | None = None
        self.info: dict = {}
        self.handles = [blocks[self.layer].register_forward_hook(self._after_layer)]
        for blk in list(blocks)[self.layer + 1:]:
            self.handles.append(blk.register_forward_pre_hook(self._before_layer,
                                                              with_kwargs=True))

    @property
    def rows(self) -> int:
        return self.config.window if isinstance(self.config, EntroPrefill) else 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def reset(self) -> None:
        self.probs = self.keep = self.exit_hidden = None

    def _after_layer(self, module, args, output):
        if self.session.phase != "prefill" or self.probs is None:
            return output
        hidden = output[0] if isinstance(output, tuple) else output
        groups = self.session.groups
        if isinstance(self.config, EntroPrefill):
            keep, self.info = entroprefill_keep(self.config, self.probs, groups)
        else:
            keep, self.info = lazyllm_keep(self.config, self.probs)
        self.probs = None
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
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            mask = _gather_seq(mask, keep, 2)
            kwargs["attention_mask"] = _gather_seq(mask, keep, 3)
        return args, kwargs

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
