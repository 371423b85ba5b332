"""The contract of a width allocation: how many removal steps each block takes.

An allocation is a frozen dataclass registered in :data:`WIDTH_ALLOCATIONS`;
:meth:`WidthAllocation.counts` gets the job (:class:`~prunelab.pruning.width.plan.WidthJob`:
model, config, budget in parameters) and every block's ordered removal steps
(:class:`~prunelab.pruning.width.plan.Step`: score, parameter cost) and returns the number
of steps each block removes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from prunelab.registry import Registry

#: Width allocations by name ("uniform", "global").
WIDTH_ALLOCATIONS = Registry("width allocation")


@dataclass(frozen=True)
class WidthAllocation:
    """Base of the registered width allocations."""

    #: every block keeps the same counts (a plain config holds the result)
    uniform: ClassVar[bool] = True

    def counts(self, job, steps: list, kind: str) -> list[int]:
        """Steps removed in every block (``kind``: ``heads`` or ``ffn``)."""
        raise TypeError(f"{type(self).__name__} does not define counts()")
