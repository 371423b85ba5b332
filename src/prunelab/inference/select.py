"""How a prefill press picks the tokens it keeps, from the attention captured at its block
(tensors in, tensors out; the configs are in :mod:`prunelab.inference.config`):

* LazyLLM (Fu et al. 2024, "LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM
  Inference"): the last prompt token's attention, averaged over the heads;
* EntroPrefill (prunelab's own rule, no paper: a Renyi-entropy proposal of the cut checked
  against the exact deletion envelope of a per-head attention-mass bound; see
  :class:`~prunelab.inference.config.EntroPrefill`).
"""

from __future__ import annotations

import torch

from prunelab.inference.scores import (
    deletion_envelope,
    discarded_mass,
    group_heads,
    keep_top,
    n_removed,
    proposed_keep,
    renyi_entropy,
)


def lazyllm_keep(config, probs: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Kept token indices ``[B, K]`` from the last token's attention ``probs``
    ``[B, H, 1, L]`` (mean over heads); the last token is always kept."""
    b, _, _, length = probs.shape
    score = probs[:, :, -1].mean(1)
    remove = min(n_removed(length, config.ratio), length - 1)
    fixed = torch.zeros(length, dtype=torch.bool, device=probs.device)
    fixed[-1] = True
    keep = keep_top(score, length - remove, fixed)
    mass = discarded_mass(probs[:, :, -1], complement(keep, length))
    return keep, {"removed": remove, "discarded_mass": mass}


def entroprefill_keep(config, probs: torch.Tensor, groups: int
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
    keep = complement(removed, length)
    info = {"removed": remove, "proposal": proposal.tolist(), "envelope": envelope.tolist(),
            "entropy": renyi_entropy(cand, config.alpha).tolist(),
            "discarded_mass": discarded_mass(head_mass, removed)}
    return keep, info


def complement(idx: torch.Tensor, length: int) -> torch.Tensor:
    """Sorted indices ``[B, length - n]`` of ``0..length-1`` not in ``idx`` ``[B, n]``."""
    mask = torch.ones(idx.shape[0], length, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, False)
    return mask.nonzero()[:, 1].view(idx.shape[0], length - idx.shape[1])


def jaccard_removed(a: torch.Tensor, b: torch.Tensor, length: int) -> float:
    """Jaccard overlap of the removed sets (complements of kept ``[B, K]`` indices),
    over the batch; 1 when both remove nothing."""
    ra = torch.ones(a.shape[0], length, dtype=torch.bool, device=a.device)
    rb = torch.ones_like(ra)
    ra.scatter_(1, a, False)
    rb.scatter_(1, b, False)
    union = int((ra | rb).sum())
    return 1.0 if union == 0 else int((ra & rb).sum()) / union
