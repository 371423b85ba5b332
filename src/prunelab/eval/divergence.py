"""Pure divergence maths between next-token distributions: the one implementation of KL
and token NLL that the evaluator, the probes and the pruners share.

* :func:`kl_from_logits`: ``KL(p_ref || p)`` per position in float32 (evaluator's
  ``kl_to_reference``; the probes' all-positions value).
* :func:`kl_from_logits_float64`: the same in float64 with ``q`` clamped ``>= 1e-40`` (the
  "No Free Swap" last-position protocol of the probes).
* :func:`token_nll` / :func:`nll_sum`: next-token negative log-likelihood (float32
  log-softmax).
"""

from __future__ import annotations

import torch

Q_FLOOR = 1e-40  # smallest q in the float64 KL: log q stays finite where p > 0


def kl_from_logits(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(p_ref || p)`` per position, in float32: ``[..., V] -> [...]``."""
    logp_ref = torch.log_softmax(ref_logits.float(), dim=-1)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)


def kl_from_logits_float64(ref_logits: torch.Tensor, logits: torch.Tensor,
                           q_floor: float = Q_FLOOR) -> torch.Tensor:
    """``KL(p_ref || p)`` per position in float64: ``[..., V] -> [...]``.

    Softmax in float64; ``q`` clamped ``>= q_floor`` and ``p`` terms with ``p = 0`` count
    zero, so the value is finite whenever ``p_ref`` is (the protocol of Chen et al., "No
    Free Swap", for the KL at the last position of each window)."""
    p = torch.softmax(ref_logits.double(), dim=-1)
    q = torch.softmax(logits.double(), dim=-1).clamp_min(q_floor)
    logp = torch.log(p.clamp_min(1e-300))
    return torch.where(p > 0, p * (logp - torch.log(q)), torch.zeros_like(p)).sum(-1)


def top1_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """1.0 where both distributions have the same argmax, per position."""
    return (ref_logits.argmax(-1) == logits.argmax(-1)).float()


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Negative log-likelihood of each next token, ``[B, T, V], [B, T] -> [B, T-1]``:
    ``-log p(input_ids[:, t+1] | logits[:, t])`` (log-softmax in ``dtype``: float32 for
    perplexity, float64 where loss differences are compared)."""
    logp = torch.log_softmax(logits[:, :-1].to(dtype), dim=-1)
    target = input_ids[:, 1:].to(logp.device).unsqueeze(-1)
    return -logp.gather(-1, target).squeeze(-1)


def nll_sum(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed :func:`token_nll` of ``input_ids[:, 1:]`` under ``logits[:, :-1]``
    (float32)."""
    return token_nll(logits, input_ids).sum()
