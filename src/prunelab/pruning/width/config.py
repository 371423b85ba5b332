"""Typed config of structured width pruning (heads, FFN channels, joint budgets).

``prunelab.prune(lm, Width(unit="ffn", score=WandaSP(), ratio=0.2, compensate=True),
data)``; the score and the allocation are registered configs
(:mod:`prunelab.pruning.width.scoring`, :mod:`prunelab.pruning.width.allocation`) with
their own parameters (``AblationKL(samples=4, channel_group=64)``, ``Putri(per_round=1)``,
``MagnitudeProfile(outlier_z=3.0)``); names are accepted (``score="wanda-sp"``: the
registered defaults). The config validates at construction and round-trips through
:func:`prunelab.registry.to_dict` / ``METHODS.from_dict``; :func:`width_from_cli` maps the
flat command-line options onto it. Each score cites its paper in its module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prunelab.checkpoint.gguf_export import QUANT_TYPES
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.pruning.base import METHODS
from prunelab.pruning.options import piece_from_flat
from prunelab.pruning.width.allocation import WIDTH_ALLOCATIONS, WidthAllocation
from prunelab.pruning.width.scoring import WIDTH_SCORES, WidthScore
from prunelab.registry import check_range, strict_kwargs

UNITS = ("heads", "ffn", "joint")


def _help(text: str, default=None, budget: str | None = None):
    return field(default=default,
                 metadata={"help": text, **({"budget": budget} if budget else {})})


def scores_for(unit: str) -> list[str]:
    """Registered width scores that rank ``unit``."""
    return [n for n in WIDTH_SCORES if unit in WIDTH_SCORES.get(n).units]



#: Width scores computed from weights and one statistics pass through the runner.
STREAMABLE_WIDTH_SCORES = ("wanda-sp", "flap", "magnitude-profile")

@METHODS.register("width")
@dataclass(frozen=True)
class Width:
    """Structured width pruning: physically smaller attention and MLP layers.

    ``unit``: ``heads`` (a KV group, i.e. one key/value head and the query heads sharing
    it, on GQA models; a head otherwise; ``heads="query"`` prunes query heads inside every
    group, keeping the groups equal), ``ffn`` (MLP channels) or ``joint`` (heads and FFN
    channel groups under one budget, ``score="cocurve"``).
    ``ratio``: fraction of the unit's parameters removed (attention projections for heads,
    MLP projections for ffn, both for joint); or ``target_params``: parameters the whole
    model keeps (a count, or a fraction <= 1 of the current count).
    ``allocation``: ``uniform`` (every block keeps the same counts; a plain config holds the
    result) or ``global`` (units compete across blocks; the checkpoint needs
    ``trust_remote_code=True``).
    ``compensate``: least-squares refit of the consumer projection (``o_proj``,
    ``down_proj``) on calibration activations, block by block on the pruned stream.
    ``bias_compensation``: FLAP's ``b += W[:, removed] mean(X_removed)`` where the consumer
    has a bias (always folded into the fit when ``compensate`` is on and a bias exists).
    ``round_to``: FFN widths kept are multiples of this (1 = no rounding).
    ``gguf_type``: the llama.cpp quantized type the result is meant for; ``round_to``
    becomes the least common multiple of itself and that type's block (llama.cpp quantizes
    rows in blocks of 32 or 256 values and stores a weight whose input width is not a
    multiple in a wider fallback type, see :func:`prunelab.checkpoint.gguf_export.fallbacks`).
    ``damp``: ridge of the refit, times the mean diagonal of ``X^T X``, shrinking towards
    plain slicing (default 1.0: on SmolLM2 with 8 x 256 calibration tokens it lowered the
    held-out ``down_proj`` error of blocks 0/5/15 from 0.036/0.114/0.066 (slicing) to
    0.025/0.102/0.051, where 1e-3 over-fitted to 0.051/0.271/0.109); Putri's FFN saliency
    uses ``max(damp, 0.01)``.
    """

    unit: str = _help("heads | ffn | joint", "ffn")
    score: WidthScore | str = _help("how units are ranked", "wanda-sp")
    ratio: float | None = _help("fraction of the unit's parameters removed",
                                budget="remove-units")
    target_params: float | None = _help("parameters the model keeps: a fraction (<= 1) or "
                                        "a count", budget="keep-params")
    allocation: WidthAllocation | str = _help("uniform (plain config) | global (per-block "
                                              "widths, needs trust_remote_code)", "uniform")
    heads: str = _help("groups (KV groups; heads without GQA) | query (query heads inside "
                       "every group)", "groups")
    compensate: bool = _help("least-squares refit of o_proj / down_proj, block by block",
                             False)
    bias_compensation: bool = _help("FLAP bias compensation where the consumer has a bias",
                                    True)
    round_to: int = _help("FFN widths kept are multiples of this", 8)
    gguf_type: str | None = _help("the llama.cpp type the result will be quantized to: FFN "
                                  "widths are rounded to its block (32 for q8_0, 256 for "
                                  "the k-quants) so no weight falls back to a wider type")
    damp: float = _help("refit ridge (times mean diag of X^T X), shrinking towards plain "
                        "slicing", 1.0)

    _registries = {"score": WIDTH_SCORES, "allocation": WIDTH_ALLOCATIONS}

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ConfigError(f"unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        allowed = scores_for(self.unit)
        name = self.score if isinstance(self.score, str) else WIDTH_SCORES.name_of(self.score)
        if name not in allowed:
            raise ConfigError(f"score for unit {self.unit} must be one of "
                              f"{', '.join(allowed)}, got {name!r}")
        object.__setattr__(self, "score", WIDTH_SCORES.make(self.score))
        if (self.ratio is None) == (self.target_params is None):
            raise ConfigError("give exactly one of ratio (--budget remove-units:F) and "
                              "target_params (--budget keep-params:F)")
        if self.ratio is not None:
            check_range("ratio", self.ratio, 0.0, 0.95)
        if self.target_params is not None:
            check_range("target_params", self.target_params, 1e-6, None)
        object.__setattr__(self, "allocation", WIDTH_ALLOCATIONS.make(self.allocation))
        if self.unit == "joint" and self.allocation.uniform:
            raise ConfigError("unit joint (cocurve) chooses per-block widths: use "
                              "--allocation global")
        if self.heads not in ("groups", "query"):
            raise ConfigError(f"heads must be groups or query, got {self.heads!r}")
        if self.heads == "query" and self.unit == "joint":
            raise ConfigError("unit joint prunes whole KV groups: heads must be groups")
        check_range("round_to", self.round_to, 1, 4096, integer=True)
        if self.gguf_type is not None:
            if not isinstance(self.gguf_type, str) or self.gguf_type not in QUANT_TYPES:
                raise ConfigError(f"gguf_type must be one of {', '.join(QUANT_TYPES)}, got "
                                  f"{self.gguf_type!r}")
            block = QUANT_TYPES[self.gguf_type].block
            object.__setattr__(self, "round_to", math.lcm(self.round_to, block))
        check_range("damp", self.damp, 0.0, 1e4)
        self.score.validate(self)

    @property
    def score_name(self) -> str:
        return WIDTH_SCORES.name_of(self.score)

    @property
    def allocation_name(self) -> str:
        return WIDTH_ALLOCATIONS.name_of(self.allocation)

    def check_streamable(self) -> None:
        """``--stream``: only the scores computed from weights and one statistics pass."""
        if self.score_name not in STREAMABLE_WIDTH_SCORES:
            raise UnsupportedOperationError(
                f"--stream: width score {self.score_name} needs the whole model (ablations "
                f"or gradients); streamable: {', '.join(STREAMABLE_WIDTH_SCORES)}")


def width_from_cli(*, score: str | None = None, allocation: str | None = None,
                   **flat) -> Width:
    """The :class:`Width` config of the flat ``prunelab prune width`` options.

    ``score`` / ``allocation`` name the pieces (default ``wanda-sp`` / ``uniform``); the
    options of a piece (``ablation_samples``, ``channel_group``, ``putri_per_round``,
    ``outlier_z``: see :func:`prunelab.pruning.options.flat_options`) go to it, and one
    given for a score not chosen is a :class:`ConfigError` (``--channel-group applies to
    --score ablation-kl or cocurve only``). ``None`` means "not given"; the rest are
    :class:`Width` fields."""
    sc, owned_s = piece_from_flat(WIDTH_SCORES, score or "wanda-sp", flat, "--score")
    al, owned_a = piece_from_flat(WIDTH_ALLOCATIONS, allocation or "uniform", flat,
                                  "--allocation")
    rest = {k: v for k, v in flat.items() if k not in owned_s | owned_a and v is not None}
    strict_kwargs(Width, rest, "prune width")
    return Width(score=sc, allocation=al, **rest)
