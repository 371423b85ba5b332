"""Typed configs of the inference-time presses, registered in :data:`PRESSES`; each
defines its hooks (:class:`~prunelab.inference.base.Press`): a KV press its ``score``, a
prefill press its ``select``.

A press changes how a loaded model runs on one input, never its weights (see
:func:`prunelab.inference.press`). Two kinds:

* ``kind = "kv"``: the prefill runs in full, then the KV cache is shrunk (real eviction:
  the cache tensors get shorter). Selection is per KV group: every KV head keeps its own
  tokens, the same number for every KV head (the query heads that share a KV head share
  its choice; per-query-head budgets would need ragged cache tensors).
* ``kind = "prefill"``: tokens are removed in the middle of the prefill, so the layers after
  ``layer`` run on a shorter sequence; kept tokens keep their original RoPE positions.

``ratio`` is always the fraction of the prompt's tokens removed (0 = the plain model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from prunelab.budget import budget_fields
from prunelab.errors import ConfigError
from prunelab.inference.base import CACHE_BUDGET, PRESSES, Press
from prunelab.inference.scores import (
    ScoreInputs,
    group_heads,
    key_norm_scores,
    last_query_scores,
    smooth,
)
from prunelab.inference.select import entroprefill_keep, lazyllm_keep
from prunelab.registry import check_range

POOLINGS = ("max", "mean")


@PRESSES.register("streaming-llm")
@dataclass(frozen=True)
class StreamingLLM(Press):
    """Keep the first ``sinks`` tokens (attention sinks) and the most recent ones; evict
    the middle. Xiao et al. 2024, "Efficient Streaming Language Models with Attention
    Sinks" (ICLR 2024). ``every > 0``: also shrink the cache back to its post-prefill size
    every ``every`` decode steps (a rolling window)."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    sinks: int = field(default=4, metadata={"help": (
        "first tokens always kept (attention sinks)")})
    every: int = field(default=0, metadata={"help": (
        "also shrink the cache back to its post-prefill size every K decode steps (0: "
        "never)")})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("sinks", self.sinks, 0, None, integer=True)
        check_range("every", self.every, 0, None, integer=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """The position (recency); the ``sinks`` first tokens above every other."""
        b, g, length = inputs.key.shape[:3]
        s = torch.arange(length, dtype=torch.float32, device=inputs.key.device)
        s[:min(self.sinks, length)] = float(length)
        return s.expand(b, g, length)


@PRESSES.register("h2o")
@dataclass(frozen=True)
class H2O(Press):
    """Heavy-hitter oracle: keep the tokens with the largest attention accumulated over
    all queries seen so far, plus a recent window of ``recent`` x the budget. Zhang et al.
    2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models" (NeurIPS 2023). ``every > 0``: accumulate during decoding and evict back to the
    post-prefill size every ``every`` decode steps."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    recent: float = field(default=0.5, metadata={"help": (
        "recent window, a fraction of the budget")})
    every: int = field(default=0, metadata={"help": (
        "also shrink the cache back to its post-prefill size every K decode steps (0: "
        "never)")})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("recent", self.recent, 0.0, 1.0)
        check_range("every", self.every, 0, None, integer=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """The attention each token received from every query of this call, summed over
        the queries, averaged over each KV group's query heads."""
        probs = inputs.attention(inputs.query.shape[2])
        return group_heads(probs.sum(2), inputs.groups)

    def protected(self, length: int, keep: int) -> tuple[int, int]:
        return 0, min(int(keep * self.recent), keep)

    def rescore(self, inputs: ScoreInputs, previous: torch.Tensor | None
                ) -> torch.Tensor | None:
        """The accumulation goes on: the step's attention added to what was kept."""
        if previous is None:
            return None
        new = self.score(inputs)
        pad = new.shape[-1] - previous.shape[-1]
        return previous if pad < 0 else F.pad(previous, (0, pad)) + new


@PRESSES.register("snapkv")
@dataclass(frozen=True)
class SnapKV(Press):
    """Score prompt tokens by the attention of the last ``window`` prompt queries (the
    observation window), smoothed by a 1-D ``pooling`` of width ``kernel`` and averaged
    over the query heads of each KV group; keep the window and the top tokens. Li et al.
    2024, "SnapKV: LLM Knows What You are Looking for Before Generation".

    Defaults: a 64-token window (kvpress' and the paper's) with max pooling (the paper's
    code; kvpress pools by the mean): of the four combinations of window 32 / 64 and max /
    mean pooling, the lowest continuation KL at 0.25, 0.5 and 0.75 of the cache removed on
    SmolLM2-135M (benchmarks/results/peers.md, section ``snapkv-settings``). A window that
    reaches the budget leaves nothing to choose (the most recent tokens are kept): give a
    short prompt a shorter ``window``."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    window: int = field(default=64, metadata={"help": (
        "observation window: the last prompt tokens whose attention scores the rest "
        "(always kept)")})
    kernel: int = field(default=5, metadata={"help": 'width of the score smoothing (odd)'})
    pooling: str = field(default="max", metadata={"help": 'score smoothing: max or avg pooling'})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("window", self.window, 1, None, integer=True)
        check_range("kernel", self.kernel, 1, None, integer=True)
        if self.kernel % 2 == 0:
            raise ConfigError(f"kernel must be odd, got {self.kernel}")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, "
                              f"got {self.pooling!r}")

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """The attention of the last ``window`` queries, summed, pooled over ``kernel``
        neighbours, averaged over each KV group's query heads."""
        probs = inputs.attention(self.window)
        return group_heads(smooth(probs.sum(2), self.kernel, self.pooling), inputs.groups)

    def protected(self, length: int, keep: int) -> tuple[int, int]:
        return 0, self.window

    def for_question(self, question: int) -> Press:
        """The question is the observation window (a window set by hand is refused)."""
        if self.window not in (SnapKV.window, question):
            raise ConfigError(f"query-aware compression: the question is SnapKV's "
                              f"observation window; do not set window ({self.window})")
        return self if self.window == question else dataclasses.replace(self, window=question)


@PRESSES.register("tova")
@dataclass(frozen=True)
class TOVA(Press):
    """Token Omission Via Attention: score every prompt token by the attention weight the
    last query gives it, averaged over all the query heads of the block, and evict the
    lowest; every KV head of a block drops the same tokens, and the last token (whose query
    scores the others) is always kept. Oren et al. 2024, "Transformers are Multi-State
    RNNs" (EMNLP 2024). ``every > 0``: also shrink the cache back to its post-prefill size
    every ``every`` decode steps, scored by that step's last query (``every=1``: the
    paper's fixed-size multi-state, one token out per token in)."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    every: int = field(default=0, metadata={"help": (
        "also shrink the cache back to its post-prefill size every K decode steps (0: "
        "never)")})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("every", self.every, 0, None, integer=True)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """The last query's attention, averaged over all query heads."""
        return last_query_scores(inputs.query, inputs.key, inputs.scaling, inputs.softcap)

    def protected(self, length: int, keep: int) -> tuple[int, int]:
        return 0, 1  # the last token, whose query scored the others


@PRESSES.register("knorm")
@dataclass(frozen=True)
class KNorm(Press):
    """Keep the cached tokens whose keys have the smallest L2 norm (score ``-||k_j||``, per
    KV head: each KV head keeps its own tokens); no attention is computed, so it needs no
    query and costs one norm per key. The norm is that of the cached keys (after RoPE,
    which preserves it, and after a family's key norm). Devoto et al. 2024, "A Simple and
    Effective L2 Norm-Based Strategy for KV Cache Compression" (EMNLP 2024)."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """Minus the L2 norm of each cached key, per KV head."""
        return key_norm_scores(inputs.key)


@PRESSES.register("lazyllm")
@dataclass(frozen=True)
class LazyLLM(Press):
    """Mid-prefill token pruning by the attention of the last prompt token at block
    ``layer`` (0-based), averaged over heads: the ``ratio`` least attended tokens are
    removed and blocks ``layer + 1 ...`` run on the rest. Baseline after Fu et al. 2024,
    "LazyLLM: Dynamic Token Pruning for Efficient Long Context LLM Inference" (fixed layer,
    no revival of pruned tokens)."""

    kind: ClassVar[str] = "prefill"
    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    layer: int = field(default=1, metadata={"help": (
        "0-based block where the prompt tokens are pruned")})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("layer", self.layer, 0, None, integer=True)

    def select(self, probs: torch.Tensor, groups: int) -> tuple[torch.Tensor, dict]:
        return lazyllm_keep(self, probs)


@PRESSES.register("entroprefill")
@dataclass(frozen=True)
class EntroPrefill(Press):
    """Mid-prefill token pruning under an attention-mass bound (EntroPrefill: prunelab's own
    rule, no published paper; LazyLLM's mid-prefill pruning, Fu et al. 2024, with the cut
    proposed by a Renyi entropy and bounded by an exact per-head attention-mass envelope).

    At block ``layer`` the last ``window`` prompt tokens (observers) give each query head a
    distribution over the prompt (their mean attention). Heads are pooled per KV group and
    the groups pooled again with ``(1 - mix) * mean + mix * max`` (mix 0: specialisation,
    mix 1: worst-head coverage); the sink (token 0) and the observers are always kept. The
    cut size is proposed from the Renyi entropy of order ``alpha`` of the pooled scores
    (keep ``ceil(keep_scale * exp(H_alpha))`` candidates: concentrated attention lets more
    go), capped at ``max_ratio`` of the prompt, and accepted only up to the deletion
    envelope: the largest removal (in pooled order) whose discarded attention mass is at
    most ``mass_bound`` for every head of the block. ``adaptive``: prune at the first block
    ``1..layer`` whose removal set overlaps the previous block's by at least ``stability``
    (Jaccard; the ranking has stabilised), else at ``layer``."""

    kind: ClassVar[str] = "prefill"
    layer: int = field(default=1, metadata={"help": (
        "0-based block where the prompt tokens are pruned")})
    mass_bound: float = field(default=0.05, metadata={"help": (
        "entroprefill: largest attention mass any head may lose")})
    window: int = field(default=8, metadata={"help": (
        "observation window: the last prompt tokens whose attention scores the rest "
        "(always kept)")})
    mix: float = field(default=0.5, metadata={"help": (
        "entroprefill: group pooling (1 - mix) mean + mix max")})
    alpha: float = field(default=2.0, metadata={"help": (
        "entroprefill: order of the Renyi entropy proposing the cut")})
    keep_scale: float = field(default=1.0, metadata={"help": (
        "entroprefill: keep keep_scale x exp(entropy) candidates")})
    max_ratio: float = field(default=0.9, metadata={
        "help": "entroprefill: largest fraction of the prompt removed",
        "budget": "remove-cache"})
    adaptive: bool = field(default=False, metadata={"help": (
        "entroprefill: prune at the first block whose removal set is stable (up to layer)")})
    stability: float = field(default=0.8, metadata={"help": (
        "entroprefill, adaptive: Jaccard overlap with the previous block's removal set")})

    def __post_init__(self) -> None:
        check_range("layer", self.layer, 0, None, integer=True)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be true or false, got {self.adaptive!r}")
        check_range("stability", self.stability, 0.0, 1.0)
        check_range("mass_bound", self.mass_bound, 0.0, 1.0)
        check_range("window", self.window, 1, None, integer=True)
        check_range("mix", self.mix, 0.0, 1.0)
        check_range("alpha", self.alpha, 0.0, None)
        if self.alpha == 1.0:
            raise ConfigError("alpha must differ from 1 (Renyi order), got 1.0")
        check_range("keep_scale", self.keep_scale, 0.0, None)
        check_range("max_ratio", self.max_ratio, 0.0, 0.99)

    @property
    def observers(self) -> int:
        return self.window

    def select(self, probs: torch.Tensor, groups: int) -> tuple[torch.Tensor, dict]:
        return entroprefill_keep(self, probs, groups)

    @property
    def is_noop(self) -> bool:
        return self.max_ratio == 0.0


def press_for(name: str, ratio: float | None = None, /, **options) -> Press:
    """The press ``name`` at compression ``ratio`` (the fraction of the prompt removed),
    for a CLI's ``--press NAME --budget remove-cache:R``: the field whose metadata names
    the ``remove-cache`` budget takes it (EntroPrefill: its cap ``max_ratio``, its cut is
    decided by the mass bound under that cap), else ``ratio``."""
    cls = PRESSES.get(name)
    if ratio is not None:
        key = next((f for f, kind in budget_fields(cls).items() if kind == "remove-cache"),
                   "ratio")
        if key in options:
            raise ConfigError(f"press {name!r}: give the ratio once (ratio or {key})")
        options[key] = ratio
    return PRESSES.make(name, **options)
