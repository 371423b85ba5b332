"""Task metrics: one number that says how good a (possibly modified) model is on a task.

Leave-one-out by a task metric (``probe --probe leave-one-out --metric wer``) and
validation-driven block selection (``--strategy validation``) both need "evaluate this
model, give me one float". A metric is registered once by name with a factory that receives
the dense model (so references such as the dense embeddings or transcripts are computed
once) and the metric's options; the factory returns a :class:`TaskMetric` whose ``fn`` is
then called on the modified model, as many times as the search needs.

Families register their metrics in their own modules of :mod:`prunelab.eval` with
``@TASK_METRICS.register(name, description=...)`` (speech: ``wer``; vision: ``embed-cos``,
``knn-agree``, ``lfw-acc``); ``perplexity`` is built into the validation strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prunelab.errors import ConfigError
from prunelab.registry import Registry, import_submodules


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


#: name -> ``factory(lm, **options) -> TaskMetric``, registered with
#: ``@TASK_METRICS.register(name, description="one line")`` (meta ``description``).
TASK_METRICS = Registry("task metric", configs=False)


def _load_builtin() -> None:
    """Import the family modules of this package that register metrics (speech, vision)."""
    import_submodules("prunelab.eval")


def make_task_metric(name: str, lm, **options) -> TaskMetric:
    """The metric ``name`` bound to the dense model ``lm`` (one-line error if unknown)."""
    _load_builtin()
    if name not in TASK_METRICS:
        known = ", ".join(sorted(TASK_METRICS)) or "none"
        raise ConfigError(f"unknown task metric {name!r} (known: {known})")
    return TASK_METRICS.get(name)(lm, **options)
