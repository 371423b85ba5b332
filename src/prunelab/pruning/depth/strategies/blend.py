"""``blend``: rank average of the main probe and a second one (e.g. contraction and block
influence), then the ``n`` lowest."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.probes.base import PROBES
from prunelab.pruning.depth import selection as sel
from prunelab.pruning.depth.strategies.base import STRATEGIES, ScoredStrategy


@STRATEGIES.register("blend")
@dataclass(frozen=True)
class Blend(ScoredStrategy):
    """rank average of the probe and a second probe, then the n lowest"""

    probe: str = field(default="contraction", metadata={
        "cli": "blend_probe", "help": "blend: the second probe"})

    def __post_init__(self):
        if self.probe not in PROBES:
            raise ConfigError(f"unknown probe {self.probe!r}; available: "
                              f"{', '.join(PROBES.names())}")

    def pick(self, job, result, values, how):
        other = job.run_probe(self.probe, job.ctx, job.n)
        how["blend_probe"] = other.probe
        return sel.blend(values, other.layer_values(), job.n)
