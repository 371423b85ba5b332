"""The record a heal run leaves in the model's history and the manifest."""

from __future__ import annotations

import math

from prunelab.registry import to_dict
from prunelab.train.lora import zero_count


def heal_record(run, after: float | None, completed: bool) -> dict:
    """The ``healing`` record of a run: loss and weights, mode, steps and tokens, the
    learning-rate schedule, held-out NLL / perplexity before, after and at every evaluation,
    best step, early stop, wall time, zero counts, prune events."""
    cfg = run.cfg
    before = run.evals[0]["nll"] if run.evals and run.evals[0]["step"] == 0 else None
    warm = round(cfg.warmup * run.total)
    rec = {
        "loss": cfg.loss, "weights": cfg.weights(), "mode": "full" if cfg.full else "lora",
        "lora_rank": None if cfg.full else cfg.lora_rank,
        "lora_alpha": None if cfg.full else cfg.lora_alpha,
        "steps": run.step, "planned_steps": run.total,
        "tokens": run.step * cfg.batch_size * run.window, "window": run.window,
        "lr_schedule": {"peak": cfg.peak_lr, "warmup_steps": warm,
                        "schedule": "linear warm-up, cosine decay",
                        "final": cfg.peak_lr * cfg.final_lr_ratio},
        "held_out": {"before": _metric(before), "after": _metric(after),
                     "history": run.evals},
        "best_step": run.best["step"] if run.best else run.step,
        "early_stopped": run.stopped_early, "completed": completed,
        "train_loss_first": run.losses[0] if run.losses else None,
        "train_loss_last": run.losses[-1] if run.losses else None,
        "wall_seconds": run.seconds, "resumed_from_step": run.resumed_from,
        "zeros_before": run.zeros_before,
        "zeros_after": zero_count(run.lm.model, run.lm.adapter),
        "not_adapted": run.trainables.skipped, "bridges_trained": cfg.train_bridges,
        "config": to_dict(cfg),
    }
    if run.pruner is not None:
        rec["prune"] = run.pruner.report(run)
    return rec


def _metric(nll: float | None) -> dict | None:
    if nll is None:
        return None
    return {"nll": nll, "perplexity": math.exp(min(nll, 700.0))}
