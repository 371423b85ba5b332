"""Healing: a short fine-tune that recovers a pruned model without breaking its structure
(LoRA through ``peft`` or full fine-tuning; CE, logit distillation, hidden-state matching),
and pruning while fine-tuning from training signals: REP-LIE (unit importance from the
LoRA matrices) and CascadeFlow (blocks ranked by accumulated gradient).

``prunelab.heal(lm, teacher, "wiki-vital:calib", "wiki-vital:test", HealConfig(loss="kd"))``
(:func:`prunelab.api.heal`) or, on token windows, :func:`heal`; pruned vision and speech
encoders: :func:`heal_encoder` (feature distillation, :mod:`prunelab.train.encoders`).
"""

from prunelab.heal import events  # noqa: F401 - the prune-while-tuning controllers
from prunelab.probes.cascadeflow import FlowAccumulator, fan_in_profile, gradient_flow
from prunelab.pruning.width.rep_lie import (
    RepLieTracker,
    lora_gradient_estimate,
    rep_lie_importances,
    unit_importance,
    weight_importance,
)
from prunelab.train.config import HealConfig
from prunelab.train.encoders import EncoderHealConfig, heal_encoder
from prunelab.train.loop import HealRun, eval_nll, heal
from prunelab.train.losses import kept_positions

__all__ = ["EncoderHealConfig", "FlowAccumulator", "HealConfig", "HealRun", "RepLieTracker",
           "eval_nll", "fan_in_profile", "gradient_flow", "heal", "heal_encoder",
           "kept_positions", "lora_gradient_estimate", "rep_lie_importances",
           "unit_importance", "weight_importance"]
