"""Interval probe (VGGT layer-redundancy study): cost of deleting contiguous intervals.

Measures the KL of the model with blocks ``[start, end)`` removed for every interval of
length ``1..max_length`` (each run starts from the cached input of ``start``). Interval
additivity (the cost of deleting two disjoint intervals is about the sum of their costs)
then searches, for every total length ``n`` up to ``2 * max_length``, the best pair of
disjoint, non-touching intervals by summed cost, instead of O(L^4) evaluations.
Each score keeps its per-window values (``windows``, ``windows_all_positions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.log import progress
from prunelab.probes.base import PROBES, ProbeResult, check_range, config_dict


def best_interval_pairs(costs: dict[tuple[int, int], float], max_total: int) -> list[dict]:
    """For each total length ``n``, the disjoint, non-adjacent pair of measured intervals
    with the smallest summed cost (``[start, end)`` each, sorted)."""
    items = sorted(costs.items())
    best: dict[int, dict] = {}
    for a, (ia, ca) in enumerate(items):
        for ib, cb in items[a + 1:]:
            (s1, e1), (s2, e2) = sorted([ia, ib])
            if s2 <= e1:  # overlapping or touching: that is one longer interval
                continue
            n = (e1 - s1) + (e2 - s2)
            if n > max_total:
                continue
            total = ca + cb
            if n not in best or total < best[n]["predicted_cost"]:
                best[n] = {"removed_blocks": n, "intervals": [[s1, e1], [s2, e2]],
                           "predicted_cost": total}
    return [best[n] for n in sorted(best)]


@PROBES.register("interval", resumable=True)
@dataclass(frozen=True)
class Interval:
    """Divergence to dense with each interval of blocks removed, up to ``max_length`` long."""

    max_length: int = field(default=4, metadata={"help": "longest interval measured"})

    def __post_init__(self):
        check_range("max_length", self.max_length, 1, None, integer=True)

    def run(self, ctx, resume=None, on_progress=None) -> ProbeResult:
        n = ctx.num_blocks
        spans = [(s, s + k) for k in range(1, min(self.max_length, n - 1) + 1)
                 for s in range(0, n - k + 1)]
        done = {tuple(s["layers"]): s for s in (resume or {}).get("scores", [])}
        scores = [done[s] for s in spans if s in done]
        for s, e in progress([sp for sp in spans if sp not in done], desc="interval"):
            per = ctx.divergence_windows(ctx.run_stack(s, range(e, n)))
            scores.append({"layers": [s, e], **per.entry()})
            if on_progress is not None:
                on_progress(scores)
        scores.sort(key=lambda x: (x["layers"][1] - x["layers"][0], x["layers"]))
        costs = {tuple(x["layers"]): x["value"] for x in scores}
        pairs = best_interval_pairs(costs, 2 * self.max_length)
        return ProbeResult("interval", config_dict(self), scores, kind="interval", num_blocks=n,
                           meta={"best_interval_pairs": pairs})
