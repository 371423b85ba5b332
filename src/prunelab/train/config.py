"""Typed config of healing: a short fine-tune of a pruned model (LoRA through ``peft``, or
full fine-tuning of the blocks), optionally pruning while it trains (REP-LIE width units,
CascadeFlow blocks).

``HealConfig(loss="kd", lora_rank=8, tokens=200_000, eval_every=25, patience=3)``;
validated at construction (:func:`prunelab.registry.check_range`: nan / inf and values out
of range are a :class:`~prunelab.errors.ConfigError` naming the field) and round-trips
through :func:`prunelab.registry.to_dict` / :func:`HealConfig.from_dict`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.registry import check_range, strict_kwargs, to_dict

LOSSES = ("ce", "kd", "hidden", "mix")
PRUNE_MODES = ("rep-lie", "cascadeflow")
FLOW_MEASURES = ("params", "residual")
DEFAULT_STEPS = 100


def _help(text: str, default=None, **more):
    return field(default=default, metadata={"help": text, **more})


@dataclass(frozen=True)
class HealConfig:
    """How a pruned model is healed (see the field helps; 0-based block numbers).

    Losses: ``ce`` next-token cross-entropy; ``kd`` ``T^2 KL(p_teacher^T || p_student^T)``
    (temperature ``T``); ``hidden`` MSE at matched block boundaries, each normalised by the
    teacher's mean square there; ``mix`` ``ce_weight * ce + kd_weight * kd +
    hidden_weight * hidden``. Budget: ``steps`` or ``tokens`` (input tokens; steps =
    ceil(tokens / (batch_size x window length))); neither: 100 steps. ``lr`` default:
    2e-4 with LoRA, 2e-5 with ``full``. Schedule: linear warm-up over ``warmup`` x steps,
    then cosine down to ``final_lr_ratio`` x lr.
    """

    loss: str = _help("ce | kd | hidden | mix (default ce); encoders: mse | cosine (default "
                      "mse)", "ce")
    ce_weight: float = _help("mix: weight of the cross-entropy", 1.0)
    kd_weight: float = _help("mix: weight of the logit distillation", 1.0)
    hidden_weight: float = _help("mix: weight of the hidden-state MSE (default 1); encoders: "
                                 "weight of the matched block boundaries (default 0)", 1.0)
    temperature: float = _help("kd: softmax temperature T (loss scaled by T^2)", 2.0)
    lora_rank: int = _help("LoRA rank r", 8)
    lora_alpha: float = _help("LoRA alpha (scale s = alpha / r)", 16.0)
    full: bool = _help("train every block parameter instead of LoRA", False)
    steps: int | None = _help("optimizer steps (or tokens)")
    tokens: int | None = _help("training tokens (or steps)")
    lr: float | None = _help("peak learning rate (default 2e-4 LoRA, 2e-5 full)")
    warmup: float = _help("warm-up fraction of the steps", 0.05)
    final_lr_ratio: float = _help("cosine ends at this fraction of lr", 0.1)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    max_grad_norm: float = _help("gradient clipping (0 = off)", 1.0)
    seqlen: int = _help("window length when windows are made from a data spec", 256)
    batch_size: int = _help("windows per step", 4)
    eval_every: int = _help("held-out NLL every K steps (0 = only before and after)", 25)
    patience: int = _help("stop after P evaluations without improvement (0 = never)", 3)
    min_delta: float = _help("improvement below this does not count", 0.0)
    seed: int = _help("LoRA init and data order", 0)
    train_bridges: bool = _help("train linear bridges of depth-pruned models too", False)
    quiet: bool = _help("no progress output", False)
    prune: str | None = _help("prune while tuning: rep-lie | cascadeflow")
    unit: str = _help("rep-lie: ffn | heads (KV groups)", "ffn")
    ratio: float | None = _help("rep-lie: fraction of the unit's channels / groups removed "
                                "(default 0.2)", None, budget="remove-units")
    prune_every: int = field(default=10, metadata={"help": "prune events every K steps",
                                                   "aliases": ("--every",)})
    prune_fraction: float = _help("rep-lie: fraction of the original units per event", 0.05)
    stability: float = _help("rep-lie: a unit is stably unimportant when it sat among the "
                             "event's lowest in at least this fraction of the steps", 0.5)
    round_to: int = _help("rep-lie: FFN widths kept are multiples of this", 8)
    remove: int | None = _help("cascadeflow: blocks removed (one per event; default 1)", None,
                               budget="remove-blocks")
    flow_measure: str = _help("cascadeflow: params (block's trainable parameters' gradient "
                              "norm) | residual (gradient norm of the stream at its output)",
                              "params")

    def __post_init__(self):
        if self.loss not in LOSSES:
            raise ConfigError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        for name in ("ce_weight", "kd_weight", "hidden_weight"):
            check_range(name, getattr(self, name), 0.0, 1e6)
        if self.loss == "mix" and self.ce_weight + self.kd_weight + self.hidden_weight <= 0:
            raise ConfigError("loss mix needs a positive ce_weight, kd_weight or hidden_weight")
        check_range("temperature", self.temperature, 1e-3, 1e3)
        check_range("lora_rank", self.lora_rank, 1, 4096, integer=True)
        check_range("lora_alpha", self.lora_alpha, 1e-6, 1e6)
        if self.steps is not None and self.tokens is not None:
            raise ConfigError("give steps (--steps) or tokens (--tokens), not both")
        if self.steps is not None:
            check_range("steps", self.steps, 1, 10**9, integer=True)
        if self.tokens is not None:
            check_range("tokens", self.tokens, 1, 10**15, integer=True)
        if self.lr is not None:
            check_range("lr", self.lr, 0.0, 10.0)
            if self.lr == 0:
                raise ConfigError("lr must be > 0 (a learning rate of 0 trains nothing)")
        check_range("warmup", self.warmup, 0.0, 0.9)
        check_range("final_lr_ratio", self.final_lr_ratio, 0.0, 1.0)
        check_range("weight_decay", self.weight_decay, 0.0, 10.0)
        check_range("max_grad_norm", self.max_grad_norm, 0.0, 1e6)
        check_range("seqlen", self.seqlen, 2, 10**6, integer=True)
        check_range("batch_size", self.batch_size, 1, 10**5, integer=True)
        check_range("eval_every", self.eval_every, 0, 10**9, integer=True)
        check_range("patience", self.patience, 0, 10**6, integer=True)
        check_range("min_delta", self.min_delta, 0.0, 1e3)
        check_range("seed", self.seed, 0, 2**31 - 1, integer=True)
        self._check_prune()

    def _check_prune(self) -> None:
        if self.prune is not None and self.prune not in PRUNE_MODES:
            raise ConfigError(f"prune must be one of {', '.join(PRUNE_MODES)}, got "
                              f"{self.prune!r}")
        if self.unit not in ("ffn", "heads"):
            raise ConfigError(f"unit must be ffn or heads, got {self.unit!r}")
        for name, mode, default, kind in (("ratio", "rep-lie", 0.2, "remove-units:F"),
                                          ("remove", "cascadeflow", 1, "remove-blocks:N")):
            if getattr(self, name) is None:
                if self.prune == mode:
                    object.__setattr__(self, name, default)
            elif self.prune != mode:
                raise ConfigError(f"{name} (--budget {kind}) applies to prune {mode} only; "
                                  f"give prune {mode} (--prune {mode}) or drop it")
        if self.ratio is not None:
            check_range("ratio", self.ratio, 0.0, 0.95)
            if self.ratio == 0:
                raise ConfigError("ratio 0 (--budget remove-units:0) removes no unit while "
                                  "tuning; drop --prune rep-lie to tune only")
        check_range("prune_every", self.prune_every, 1, 10**9, integer=True)
        check_range("prune_fraction", self.prune_fraction, 1e-6, 0.95)
        check_range("stability", self.stability, 0.0, 1.0)
        check_range("round_to", self.round_to, 1, 4096, integer=True)
        if self.remove is not None:
            check_range("remove", self.remove, 1, 10**6, integer=True)
        if self.flow_measure not in FLOW_MEASURES:
            raise ConfigError(f"flow_measure must be params or residual, got "
                              f"{self.flow_measure!r}")
        if self.prune == "rep-lie" and self.full:
            raise ConfigError("prune rep-lie reads the LoRA matrices: it cannot run with full")

    # ---------------------------------------------------------------- derived
    @property
    def peak_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 2e-5 if self.full else 2e-4

    @property
    def needs_teacher(self) -> bool:
        if self.loss == "mix":
            return self.kd_weight > 0 or self.hidden_weight > 0
        return self.loss in ("kd", "hidden")

    def weights(self) -> dict[str, float]:
        """Loss term -> weight."""
        if self.loss == "mix":
            return {"ce": self.ce_weight, "kd": self.kd_weight, "hidden": self.hidden_weight}
        return {self.loss: 1.0}

    def total_steps(self, window: int) -> int:
        """Optimizer steps of the run for windows of ``window`` tokens."""
        if self.steps is not None:
            return self.steps
        if self.tokens is not None:
            return max(1, math.ceil(self.tokens / (self.batch_size * window)))
        return DEFAULT_STEPS

    def prune_events(self) -> int:
        """How many prune events the run makes (0 without ``prune``)."""
        if self.prune == "cascadeflow":
            return self.remove
        if self.prune == "rep-lie":
            return max(1, math.ceil(self.ratio / self.prune_fraction - 1e-9)) \
                if self.ratio > 0 else 0
        return 0

    def lr_at(self, step: int, total: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based) of ``total``: linear warm-up
        to the peak over ``round(warmup * total)`` steps, then cosine to
        ``final_lr_ratio * peak`` at the last step."""
        peak = self.peak_lr
        warm = round(self.warmup * total)
        if step < warm:
            return peak * (step + 1) / warm
        span = max(total - warm - 1, 1)
        progress = min(max(step - warm, 0) / span, 1.0)
        floor = self.final_lr_ratio
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HealConfig:
        strict_kwargs(cls, d, "heal")
        d = dict(d)
        # records written before ratio / remove applied to their prune mode only held
        # their defaults (0.2, 1) whatever prune was
        for name, mode, old in (("ratio", "rep-lie", 0.2), ("remove", "cascadeflow", 1)):
            if d.get("prune") != mode and d.get(name) == old:
                d[name] = None
        return cls(**d)

    def replace(self, **changes) -> HealConfig:
        strict_kwargs(HealConfig, changes, "heal")
        return dataclasses.replace(self, **changes)
