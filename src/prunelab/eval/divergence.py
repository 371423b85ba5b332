"""Pure divergence maths between next-token distributions."""

from __future__ import annotations

import torch


def kl_from_logits(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(p_ref || p)`` per position, in float32: ``[..., V] -> [...]``."""
    logp_ref = torch.log_softmax(ref_logits.float(), dim=-1)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1.0 where both distributions have the same argmax, per position."""
    return (ref_logits.argmax(-1) == logits.argmax(-1)).float()


def nll_sum(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of ``input_ids[:, 1:]`` under ``logits[:, :-1]``
    (float32 log-softmax)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = input_ids[:, 1:].to(logp.device).unsqueeze(-1)
    return -logp.gather(-1, target).sum()
