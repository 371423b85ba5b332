"""Typed config of structured width pruning (heads, FFN channels, joint budgets).

``prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.2, compensate=True),
data)``; the config validates at construction and round-trips through :func:`to_dict` /
:func:`from_dict`. Formulas: ``methods.md`` section 4; each score cites its paper in
:mod:`prunelab.pruning.width.scores`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prunelab.errors import ConfigError
from prunelab.registry import check_range

UNITS = ("heads", "ffn", "joint")
HEAD_SCORES = ("wanda-sp", "magnitude-profile", "flap", "ablation-kl", "putri")
FFN_SCORES = ("wanda-sp", "magnitude-profile", "flap", "putri", "ablation-kl")
JOINT_SCORES = ("cocurve",)
SCORES = tuple(dict.fromkeys(HEAD_SCORES + FFN_SCORES + JOINT_SCORES))
# scores that run the whole model (need an LM head, cost forward passes per unit)
ABLATION_SCORES = ("ablation-kl", "putri-heads", "cocurve")


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
    ``damp``: ridge of the refit, times the mean diagonal of ``X^T X``, shrinking towards
    plain slicing (default 1.0: on SmolLM2 with 8 x 256 calibration tokens it lowered the
    held-out ``down_proj`` error of blocks 0/5/15 from 0.036/0.114/0.066 (slicing) to
    0.025/0.102/0.051, where 1e-3 over-fitted to 0.051/0.271/0.109).
    ``ablation_samples``: calibration windows used by ablation scores (ablation-kl, putri
    heads, cocurve); ``channel_group``: FFN channels per CoCurve unit; ``putri_per_round``:
    units removed per Putri round.
    """

    unit: str = "ffn"
    score: str = "wanda-sp"
    ratio: float | None = None
    target_params: float | None = None
    allocation: str = "uniform"
    heads: str = "groups"
    compensate: bool = False
    bias_compensation: bool = True
    round_to: int = 8
    damp: float = 1.0
    ablation_samples: int = 4
    channel_group: int = 64
    putri_per_round: int = 1
    outlier_z: float = 3.0

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ConfigError(f"unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        allowed = {"heads": HEAD_SCORES, "ffn": FFN_SCORES, "joint": JOINT_SCORES}[self.unit]
        if self.score not in allowed:
            raise ConfigError(f"score for unit {self.unit} must be one of "
                              f"{', '.join(allowed)}, got {self.score!r}")
        if (self.ratio is None) == (self.target_params is None):
            raise ConfigError("give exactly one of ratio (--ratio) and target_params "
                              "(--target-params)")
        if self.ratio is not None:
            check_range("ratio", self.ratio, 0.0, 0.95)
        if self.target_params is not None:
            check_range("target_params", self.target_params, 1e-6, None)
        if self.allocation not in ("uniform", "global"):
            raise ConfigError(f"allocation must be uniform or global, got {self.allocation!r}")
        if self.unit == "joint" and self.allocation != "global":
            raise ConfigError("unit joint (cocurve) chooses per-block widths: use "
                              "--allocation global")
        if self.heads not in ("groups", "query"):
            raise ConfigError(f"heads must be groups or query, got {self.heads!r}")
        if self.heads == "query" and self.unit == "joint":
            raise ConfigError("unit joint prunes whole KV groups: heads must be groups")
        check_range("round_to", self.round_to, 1, 4096, integer=True)
        check_range("damp", self.damp, 0.0, 1e4)
        check_range("ablation_samples", self.ablation_samples, 1, None, integer=True)
        check_range("channel_group", self.channel_group, 1, None, integer=True)
        check_range("putri_per_round", self.putri_per_round, 1, None, integer=True)
        check_range("outlier_z", self.outlier_z, 0.0, None)


def to_dict(cfg: Width) -> dict:
    d = dataclasses.asdict(cfg)
    d["method"] = "width"
    return d


def from_dict(d: dict) -> Width:
    names = {f.name for f in dataclasses.fields(Width)}
    return Width(**{k: v for k, v in d.items() if k in names})
