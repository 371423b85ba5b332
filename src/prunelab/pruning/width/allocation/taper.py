"""``taper``: width tapered with depth (an unpublished proposal, "CascadeFormer"): the
fraction of a block's units kept falls linearly with depth, ``keep_i = keep + slope (1/2 -
x_i)`` with ``x_i = i / (n - 1)`` (first block 0, last block 1), so the first block keeps
``slope`` more of its units than the last; the parameter-weighted mean removal is the budget
exactly (clipping to ``[0, 0.95]`` removal, then one shift: :func:`taper_fractions`). A
negative slope widens with depth. Within a block, the score's order decides which units go.
Per-block widths: the checkpoint needs ``trust_remote_code=True``."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.pruning.allocation import rescale_to_target
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.allocation.base import WIDTH_ALLOCATIONS, WidthAllocation
from prunelab.pruning.width.plan import attn_params, mlp_params, unit_params
from prunelab.registry import check_range


def taper_fractions(n: int, removal: float, slope: float,
                    weights: list[float] | None = None, high: float = 0.95) -> list[float]:
    """Per-block removal fractions ``r_i = removal - slope (1/2 - x_i)`` (the kept
    fractions taper by ``slope`` from first to last block), clipped to ``[0, high]`` and
    shifted so the ``weights``-weighted mean is ``removal``."""
    if n == 1:
        return [float(removal)]
    raw = [removal - slope * (0.5 - i / (n - 1)) for i in range(n)]
    return rescale_to_target(raw, weights, removal, 0.0, high)


@WIDTH_ALLOCATIONS.register("taper")
@dataclass(frozen=True)
class Taper(WidthAllocation):
    """kept width falls linearly with depth (CascadeFormer; per-block widths)"""

    slope: float = field(default=0.2, metadata={
        "cli": "taper_slope", "help": "taper: kept fraction of the first block minus that of "
                                      "the last (negative: widen with depth)"})

    uniform = False

    def __post_init__(self):
        check_range("taper_slope", self.slope, -1.0, 1.0)

    def counts(self, job, steps, kind):
        return taper_counts(job.lm, job.cfg, kind, job.budget, self.slope)


def taper_counts(lm, cfg, kind: str, budget: int, slope: float) -> list[int]:
    """Steps removed per block under the taper (FFN widths kept at multiples of
    ``round_to``; heads as whole groups / query heads, at least one left)."""
    ad = lm.adapter
    n = ad.num_blocks
    size = mlp_params if kind == "ffn" else attn_params
    fr = taper_fractions(n, budget / unit_params(ad, kind, cfg.heads), slope,
                         [float(size(ad, i)) for i in range(n)])
    counts = []
    for i, r in enumerate(fr):
        if kind == "ffn":
            width = ad.ffn_width(i)
            counts.append(width - S.round_width(width, width * (1 - r), cfg.round_to))
        else:
            geo = ad.head_geometry(i)
            units = geo.num_kv_heads if cfg.heads == "groups" else geo.group_size
            counts.append(min(int(round(r * units)), units - 1))
    if not any(counts):
        raise ConfigError("the tapered budget removes no unit in any block: ask for more")
    return counts
