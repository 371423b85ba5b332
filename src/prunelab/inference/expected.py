"""Expected attention: score cached tokens by the attention that *future* queries are
expected to give them, estimated from the statistics of the prompt's queries (after
kvpress' ``ExpectedAttentionPress``, NVIDIA 2025; Devoto et al. 2025, "Expected Attention:
KV Cache Compression by Estimating Attention from Future Queries Distribution").

Per block and query head, from the prompt's queries before RoPE, ``q~_p = R_p^-1 q_p``
(``p`` past the ``sinks`` first tokens; ``queries > 0``: the last ``queries`` only):

* mean ``mu`` and covariance ``S`` (population, ``1 / n``) of the ``q~_p``;
* ``Rbar``: the RoPE rotation averaged over the next ``horizon`` positions
  ``L .. L + horizon - 1`` (``L`` the prompt length), and ``mu' = Rbar mu``,
  ``S' = Rbar S Rbar^T``;
* for a Gaussian query ``q ~ N(mu', S')``, ``E[exp(s q.k)] = exp(s mu'.k + s^2 k^T S' k / 2)``
  (``s`` the block's attention scaling, ``1 / sqrt(d)`` in most families; kvpress writes
  ``1 / sqrt(d)``), so the expected logit of key ``k_j`` is ``z_j = s mu'.k_j +
  s^2 k_j^T S' k_j / 2`` (``covariance=False``: the first term only); the score is
  ``softmax_j(z)`` over the non-sink keys, averaged over the query heads of each KV group
  and, with ``vnorm``, multiplied by ``||v_j||`` (after adding ``epsilon``). The first
  ``sinks`` tokens are always kept.

The rotation comes from the model itself: the ``(cos, sin)`` each attention block receives
(captured by a pre-hook) and the family's own ``apply_rotary_pos_emb``, which is linear in
``(cos, sin)``, so ``R_p^-1 x = apply(x, cos_p / m^2, -sin_p / m^2)`` and ``Rbar x =
apply(x, mean_t cos_t, mean_t sin_t)`` (``m = |cos_0|``, the rotary scaling; the future
angles are the per-dimension angle at position 1 times the position). Partial rotary
(GPT-NeoX) is handled by that function; a family without rotary embeddings (GPT-2) is
refused in one line. Logit softcapping (Gemma 2) is left out of the expectation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.inference.base import CACHE_BUDGET, PRESSES, Press
from prunelab.inference.scores import ScoreInputs
from prunelab.registry import check_range


@PRESSES.register("expected-attention")
@dataclass(frozen=True)
class ExpectedAttention(Press):
    """Evict the tokens future queries are expected to attend least: the softmax of the
    expected logit ``s mu'.k + s^2 k^T S' k / 2`` under the prompt queries' mean ``mu`` and
    covariance ``S`` (before RoPE, rotated by the RoPE averaged over the next ``horizon``
    positions), averaged over each KV group's query heads, times ``||v||``; the first
    ``sinks`` tokens are kept and left out of the statistics. After kvpress'
    ExpectedAttentionPress (Devoto et al. 2025, "Expected Attention: KV Cache Compression
    by Estimating Attention from Future Queries Distribution"). Needs RoPE."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    horizon: int = field(default=512, metadata={"help": (
        "expected-attention: future positions whose RoPE rotation is averaged")})
    sinks: int = field(default=4, metadata={"help": (
        "first tokens always kept (attention sinks)")})
    queries: int = field(default=0, metadata={"help": (
        "expected-attention: the last N prompt queries give the statistics (0: every "
        "query after the sinks)")})
    covariance: bool = field(default=True, metadata={"help": (
        "expected-attention: add the query covariance term s^2 k^T S k / 2")})
    vnorm: bool = field(default=True, metadata={"help": (
        "expected-attention: multiply the scores by the value norms")})
    epsilon: float = field(default=0.0, metadata={"help": (
        "expected-attention: added to the scores before the value norms")})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("horizon", self.horizon, 1, None, integer=True)
        check_range("sinks", self.sinks, 0, None, integer=True)
        check_range("queries", self.queries, 0, None, integer=True)
        check_range("epsilon", self.epsilon, 0.0, None)
        for name in ("covariance", "vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """:func:`expected_scores` of the block's prefill, with the rotary ``(cos, sin)``
        it received and its family's ``apply_rotary_pos_emb``."""
        rope = inputs.rope
        if not isinstance(rope, tuple) or len(rope) != 2:
            raise UnsupportedOperationError(
                f"press expected-attention needs the rotary (cos, sin) of every attention "
                f"block; {type(inputs.module).__name__} receives none")
        cos, sin = rope
        return expected_scores(self, inputs.query, inputs.key, inputs.value, inputs.scaling,
                               cos[0], sin[0], rope_function(inputs.module))

    def protected(self, length: int, keep: int) -> tuple[int, int]:
        return self.sinks, 0

    def check(self, lm) -> None:
        rope_function(lm.adapter.attention(0))  # no RoPE: one line, before any forward


def rope_function(module):
    """The family's ``apply_rotary_pos_emb(q, k, cos, sin)`` for an attention ``module``."""
    fn = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    if fn is None:
        raise UnsupportedOperationError(
            f"press expected-attention needs rotary position embeddings (RoPE); "
            f"{type(module).__name__} has none")
    return lambda x, cos, sin: fn(x, x, cos, sin)[0]


def future_rotation(cos: torch.Tensor, sin: torch.Tensor, start: int, horizon: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean cos, mean sin)`` ``[r]`` over positions ``start .. start + horizon - 1``, from
    the ``cos`` / ``sin`` ``[P, r]`` of positions ``0 .. P - 1`` (``P >= 2``): the angle per
    dimension is that of position 1, the rotary scaling ``m`` that of position 0."""
    c, s = cos.double(), sin.double()
    m = torch.sqrt(c[0] ** 2 + s[0] ** 2)
    angle = torch.atan2(s[1], c[1])
    t = torch.arange(start, start + horizon, dtype=torch.float64, device=cos.device)
    phase = t[:, None] * angle[None]
    return m * torch.cos(phase).mean(0), m * torch.sin(phase).mean(0)


def query_statistics(query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply,
                     sinks: int, last: int, covariance: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean ``[B, H, D]`` and covariance ``[B, H, D, D]`` (``None`` without ``covariance``)
    of the prompt queries ``[B, H, L, D]`` (after RoPE, ``cos`` / ``sin`` ``[L, r]``) before
    RoPE, over positions ``sinks ..`` (the last ``last`` with ``last > 0``)."""
    length = query.shape[2]
    c, s = cos.float(), sin.float()
    m2 = (c[0] ** 2 + s[0] ** 2)[None]
    plain = apply(query.float(), (c / m2)[None], (-s / m2)[None])  # R_p^-1 q_p
    first = sinks if not last else max(sinks, length - last)
    q = plain[:, :, min(first, length - 1):]
    mu = q.mean(2)
    if not covariance:
        return mu, None
    centred = q - mu[:, :, None]
    return mu, centred.transpose(-1, -2) @ centred / q.shape[2]


def rotate_statistics(mu: torch.Tensor, cov: torch.Tensor | None, cbar: torch.Tensor,
                      sbar: torch.Tensor, apply) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(Rbar mu, Rbar S Rbar^T)`` with ``Rbar x = apply(x, cbar, sbar)``."""
    c, s = cbar.float()[None, None], sbar.float()[None, None]
    mu_r = apply(mu[:, :, None], c, s)[:, :, 0]
    if cov is None:
        return mu_r, None
    d = mu.shape[-1]
    rbar_t = apply(torch.eye(d, device=mu.device)[None, None], c, s)[0, 0]  # rows: Rbar e_i
    return mu_r, rbar_t.T @ cov @ rbar_t


def expected_scores(config: ExpectedAttention, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scaling: float, cos: torch.Tensor, sin: torch.Tensor,
                    apply) -> torch.Tensor:
    """Token scores ``[B, G, L]`` of one block's prefill: queries ``[B, H, L, D]`` and keys
    / values ``[B, G, L, D]`` after RoPE, ``cos`` / ``sin`` ``[L, r]`` of positions
    ``0 .. L - 1``; the sinks get the largest score + 1."""
    b, h, length, d = query.shape
    g = key.shape[1]
    sinks = min(config.sinks, length)
    if length - sinks < 1 or length < 2:
        return key.new_zeros(b, g, length, dtype=torch.float32)
    mu, cov = query_statistics(query, cos, sin, apply, sinks, config.queries,
                               config.covariance)
    cbar, sbar = future_rotation(cos, sin, length, config.horizon)
    mu, cov = rotate_statistics(mu, cov, cbar, sbar, apply)
    k = key[:, :, sinks:].float().repeat_interleave(h // g, dim=1)  # [B, H, L', D]
    logits = scaling * (k @ mu[..., None])[..., 0]
    if cov is not None:
        logits = logits + 0.5 * scaling ** 2 * ((k @ cov) * k).sum(-1)
    probs = logits.softmax(-1).view(b, g, h // g, -1).mean(2)  # [B, G, L']
    if config.vnorm:
        probs = (probs + config.epsilon) * value[:, :, sinks:].float().norm(dim=-1)
    top = probs.max() + 1 if probs.numel() else probs.new_tensor(1.0)
    return torch.cat([top.expand(b, g, sinks), probs], dim=-1)
