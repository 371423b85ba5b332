"""Task metrics: one number that says how good a (possibly modified) model is on a task.

Leave-one-out by a task metric (``probe --probe leave-one-out --metric wer``) and
validation-driven block selection (``--strategy validation``) both need "evaluate this
model, give me one float". A metric is registered once by name with a factory that receives
the dense model (so references such as the dense embeddings or transcripts are computed
once) and the metric's options; the factory returns a :class:`TaskMetric` whose ``fn`` is
then called on the modified model, as many times as the search needs.

Families register their metrics in their own modules (speech: ``wer``; vision:
``embed-cos``, ``knn-agree``, ``lfw-acc``; text: ``perplexity``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prunelab.errors import ConfigError


@dataclass(frozen=True)
class TaskMetric:
    """A bound metric: ``fn(lm) -> float``; ``higher_is_better`` orders candidates."""

    name: str
    fn: Callable[[Any], float]
    higher_is_better: bool

    def __call__(self, lm) -> float:
        return float(self.fn(lm))

    def loss(self, value: float) -> float:
        """``value`` turned into "lower is better" (for searches that minimise)."""
        return -value if self.higher_is_better else value


# name -> (factory(lm, **options) -> TaskMetric, one-line description, module it lives in)
TASK_METRICS: dict[str, tuple[Callable[..., TaskMetric], str]] = {}


def register_task_metric(name: str, description: str):
    """Decorator: register ``factory(lm, **options) -> TaskMetric`` under ``name``."""

    def deco(factory):
        if name in TASK_METRICS:
            raise ValueError(f"task metric {name!r} is already registered")
        TASK_METRICS[name] = (factory, description)
        return factory

    return deco


def _load_builtin() -> None:
    # Importing the family modules registers their metrics; each import is optional so a
    # family whose extra packages are missing only loses its own metrics.
    import importlib

    for mod in ("prunelab.eval.metrics_text", "prunelab.eval.speech", "prunelab.eval.vision"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("prunelab"):
                raise


def make_task_metric(name: str, lm, **options) -> TaskMetric:
    """The metric ``name`` bound to the dense model ``lm`` (one-line error if unknown)."""
    _load_builtin()
    if name not in TASK_METRICS:
        known = ", ".join(sorted(TASK_METRICS)) or "none"
        raise ConfigError(f"unknown task metric {name!r} (known: {known})")
    return TASK_METRICS[name][0](lm, **options)
