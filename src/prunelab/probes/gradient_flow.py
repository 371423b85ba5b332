"""``gradient-flow`` (CascadeFlow, this repository's seed method; see
:mod:`prunelab.probes.cascadeflow`): a short LoRA fine-tune (next-token cross-entropy on
the calibration windows) accumulating, per block, the gradient norm of its trainable
parameters (``measure="params"``) or of the residual stream at its output
(``measure="residual"``). ``value`` is the mean accumulated norm: low = the training
signal barely reaches the block = removable. The LoRA is dropped at the end (the model's
weights are unchanged). No dense boundary pass is needed (``forward=False``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.probes.base import PROBES, ProbeResult, check_range, config_dict
from prunelab.probes.cascadeflow import fan_in_profile, gradient_flow


@PROBES.register("gradient-flow", forward=False)
@dataclass(frozen=True)
class GradientFlow:
    """CascadeFlow: mean accumulated block gradient norm over a short LoRA fine-tune.

    ``steps`` optimizer steps at learning rate ``lr`` with LoRA rank ``rank`` (batches of
    ``batch_size`` windows, data order and LoRA init from ``seed``); ``measure``: params
    (LoRA gradient norm of the block) or residual (gradient norm of its output stream)."""

    steps: int = field(default=20, metadata={"help": "LoRA fine-tune steps"})
    lr: float = field(default=2e-4, metadata={"help": "learning rate"})
    rank: int = field(default=8, metadata={"help": "LoRA rank"})
    batch_size: int = field(default=4, metadata={"help": "windows per step"})
    seed: int = field(default=0, metadata={"help": "data order and LoRA init"})
    measure: str = field(default="params", metadata={"help": (
        "params (block parameters' gradient) or residual (gradient of its output stream)")})

    def __post_init__(self):
        check_range("steps", self.steps, 1, 10**6, integer=True)
        check_range("lr", self.lr, 0.0, 10.0)
        check_range("rank", self.rank, 1, 4096, integer=True)
        check_range("batch_size", self.batch_size, 1, 10**5, integer=True)
        check_range("seed", self.seed, 0, 2**31 - 1, integer=True)
        if self.measure not in ("params", "residual"):
            raise ConfigError(f"measure must be params or residual, got {self.measure!r}")

    def run(self, ctx) -> ProbeResult:
        if ctx.encoder:
            raise UnsupportedOperationError(f"{ctx.lm.spec} is an encoder: gradient-flow trains "
                                            "the LM loss")
        values, facts = gradient_flow(ctx.lm, ctx.input_ids, steps=self.steps, lr=self.lr,
                                      rank=self.rank, seed=self.seed, measure=self.measure,
                                      batch_size=self.batch_size)
        scores = [{"layers": [i], "value": v} for i, v in enumerate(values)]
        profile = fan_in_profile(values)
        return ProbeResult("gradient-flow", config_dict(self), scores, kind="layer",
                           num_blocks=len(values),
                           meta={"training": facts, "spearman_depth": profile["spearman_depth"]})
