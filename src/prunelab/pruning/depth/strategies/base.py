"""The contract of a depth selection strategy: which blocks to remove.

A strategy is a frozen dataclass registered in :data:`STRATEGIES` under its CLI name; its
fields are its own parameters (each with ``metadata={"help": ...}`` and, where the flat CLI
name differs from the field, ``"cli"``). :meth:`Strategy.choose` gets a
:class:`SelectJob` (the model, the :class:`~prunelab.pruning.depth.config.Depth` config, the probe
context of the dense model and the number of blocks ``n``) and returns the sorted 0-based
blocks and a dict saying how they were chosen (the report's ``selection``).

Strategies that rank blocks by the probe's per-block removability derive from
:class:`ScoredStrategy` and implement :meth:`ScoredStrategy.pick`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prunelab.registry import Registry

#: Depth selection strategies by name ("one-shot", "beam", ...).
STRATEGIES = Registry("selection strategy")


@dataclass
class SelectJob:
    """What a strategy may use: ``lm``, ``cfg`` (the Depth config), ``ctx`` (a probe
    context of the dense model on the calibration windows), ``n`` (blocks to remove),
    ``run_probe(name, ctx, n)`` (a probe run with the config's options) and the main probe
    result (:meth:`result`: given, loaded from ``from_probe``, or run once on demand)."""

    lm: Any
    cfg: Any
    ctx: Any
    n: int
    run_probe: Callable[[str, Any, int], Any]
    load_result: Callable[[], Any]
    _result: Any = field(default=None, repr=False)

    def result(self):
        if self._result is None:
            self._result = self.load_result()
        return self._result


@dataclass(frozen=True)
class Strategy:
    """Base of the registered selection strategies."""

    #: whether the strategy ranks blocks by the main probe (last-n, random: no)
    uses_probe: ClassVar[bool] = True

    def choose(self, job: SelectJob) -> tuple[list[int], dict]:
        """Sorted 0-based blocks to remove and how they were chosen."""
        raise TypeError(f"{type(self).__name__} does not define choose()")


@dataclass(frozen=True)
class ScoredStrategy(Strategy):
    """A strategy over the main probe's per-block removability (lower = more removable)."""

    def choose(self, job: SelectJob) -> tuple[list[int], dict]:
        result = job.result()
        values = result.layer_values()
        how = {"strategy": STRATEGIES.name_of(self), "probe": result.probe,
               "from_probe": job.cfg.from_probe, "layer_values": values}
        return self.pick(job, result, values, how), how

    def pick(self, job: SelectJob, result, values: list, how: dict) -> list[int]:
        """The blocks (``how`` may gain entries)."""
        raise TypeError(f"{type(self).__name__} does not define pick()")
