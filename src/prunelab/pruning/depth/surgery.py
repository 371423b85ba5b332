"""Apply a depth-pruning decision: delete the blocks, repair every cut, measure the KL.

:class:`DepthPruner` is the :class:`~prunelab.pruning.base.Pruner` of
:class:`~prunelab.pruning.depth.config.Depth`; :func:`prune_depth` is the same run for callers
that share a probe context (sweeps, benchmarks) and returns a plain dict.
"""

from __future__ import annotations

import time

from prunelab.log import info
from prunelab.models.size import model_size
from prunelab.probes import ProbeContext
from prunelab.pruning.base import PRUNERS, Pruner
from prunelab.pruning.depth import sublayer_depth as sd
from prunelab.pruning.depth.config import Depth, blocks_to_remove, select
from prunelab.pruning.depth.recoveries import RECOVERIES
from prunelab.pruning.depth.recovery import recover
from prunelab.pruning.depth.report import DepthReport


def run_depth(lm, cfg: Depth, input_ids, batch_size: int = 8, ctx: ProbeContext | None = None,
              removed: list[int] | None = None) -> DepthReport:
    """Select, delete and repair ``lm`` in place.

    ``ctx``: a probe context of the dense model on the same windows (e.g. shared by the
    points of a sweep, where ``lm`` is a copy of that model); ``removed``: skip selection.
    """
    n_orig = lm.adapter.num_blocks
    own = ctx is None
    ctx = ctx or ProbeContext(lm, input_ids, batch_size=batch_size, lazy=True)
    evals0 = ctx.block_evaluations
    try:
        if cfg.granularity == "sublayer":
            if removed is not None:
                sd.refuse_given_blocks()
            return sd.run_sublayer_depth(lm, cfg, ctx, batch_size, evals0,
                                         blocks_to_remove(lm, cfg))
        if removed is None:
            removed, how = select(lm, cfg, ctx, blocks_to_remove(lm, cfg))
        else:
            removed, how = sorted(removed), {"strategy": "given"}
        info(f"prunelab: removing blocks {removed} (0-based) of {n_orig}")
        ctx.ensure_cached()
        lm.adapter.delete_blocks(removed)
        kl_none = ctx.model_divergence(lm)
        records = recover(lm, cfg, ctx, removed, batch_size, how.get("repair_spans")) \
            if cfg.recovery.fits else []
        kl_after = ctx.model_divergence(lm) if records else kl_none
    finally:
        if own:
            ctx.close()
    return DepthReport(
        removed_blocks=removed, kept_blocks=[i for i in range(n_orig) if i not in removed],
        num_blocks_before=n_orig, num_blocks_after=lm.adapter.num_blocks,
        selection={k: v for k, v in how.items() if k != "layer_values"},
        probe_layer_values=how.get("layer_values"),
        recovery=RECOVERIES.name_of(cfg.recovery), cuts=records,
        calib_divergence=ctx.divergence_name,
        calib_kl_before_recovery=kl_none[1], calib_kl_after_recovery=kl_after[1],
        calib_kl_last_before_recovery=kl_none[0], calib_kl_last_after_recovery=kl_after[0],
        needs_remote_code=cfg.recovery.needs_remote_code and bool(records),
        block_evaluations=ctx.block_evaluations - evals0)


def prune_depth(lm, cfg: Depth, input_ids, data_info: dict | None = None,
                batch_size: int = 8, ctx: ProbeContext | None = None,
                removed: list[int] | None = None) -> dict:
    """:func:`run_depth` as a dict, plus ``size_before``, ``size_after``, ``seconds`` and
    ``data`` (what :func:`prunelab.prune` adds for its callers)."""
    start = time.perf_counter()
    before = model_size(lm.model)
    report = run_depth(lm, cfg, input_ids, batch_size=batch_size, ctx=ctx, removed=removed)
    return {**report.to_dict(), "size_before": before, "size_after": model_size(lm.model),
            "seconds": time.perf_counter() - start, "data": data_info or {}}


@PRUNERS.register(Depth)
class DepthPruner(Pruner):
    """Depth pruning as a :func:`prunelab.prune` method."""

    operation = "prune-depth"

    def run(self, lm, config: Depth, input_ids, *, batch_size: int) -> DepthReport:
        return run_depth(lm, config, input_ids, batch_size=batch_size)
