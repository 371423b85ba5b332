"""Apply a depth-pruning decision: delete the blocks, repair every cut, measure the KL."""

from __future__ import annotations

import time

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.log import info
from prunelab.models.size import model_size
from prunelab.probes import ProbeContext
from prunelab.pruning.bridges import LinearBridge, attach_bridge, fit_bridge
from prunelab.pruning.depth import Depth, blocks_to_remove, select
from prunelab.pruning.recovery import check_additive, fit_boundary, fit_foldable
from prunelab.pruning.selection import contiguous_spans


def _first_masks(hidden):
    masks = []
    for h in hidden:
        m = torch.zeros(h.shape[0], h.shape[1], dtype=torch.bool)
        m[:, 0] = True
        masks.append(m)
    return masks


def _bridge(cfg: Depth, xs, ys, dim: int, dtype) -> LinearBridge:
    masks = _first_masks(xs) if cfg.token_aware else None
    fits = fit_bridge(xs, ys, cfg.recovery, rank=cfg.rank, ridge=cfg.ridge, first_masks=masks)
    bridge = LinearBridge(dim, rank=cfg.rank, bias=cfg.recovery == "lra",
                          token_aware=cfg.token_aware, dtype=dtype)
    bridge.load_fit(fits[0])
    if cfg.token_aware:
        bridge.load_fit(fits[1], prefix="first_")
    return bridge


def _cut_error(xs, ys) -> float:
    return sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(xs, ys,
                                                                           strict=True))


def recover(lm, cfg: Depth, ctx: ProbeContext, removed: list[int], batch_size: int) -> list:
    """Fit the recovery at every cut of the (already shortened) model, in order."""
    spans = contiguous_spans(removed)
    cuts = {}  # new index of the last kept block before the cut -> dense target
    for s, e in spans:
        k = s - 1 - sum(1 for r in removed if r < s)
        cuts[k] = (s, e, ctx.boundary(e))
    runner = BlockRunner(lm, ctx.input_ids, batch_size=batch_size)
    runner.capture()
    dtype = next(lm.model.parameters()).dtype
    dim = lm.adapter.hidden_size()
    records = []
    if -1 in cuts:  # span starting at block 0: repair the embeddings' output
        s, e, y = cuts.pop(-1)
        if cfg.recovery in ("foldable", "boundary"):
            from prunelab.errors import UnsupportedOperationError

            raise UnsupportedOperationError(
                f"{cfg.recovery} recovery needs a kept block before the cut; blocks from 0 "
                "were removed (use ghost or lra)")
        xs = runner.inputs
        bridge = _bridge(cfg, xs, y, dim, dtype)
        attach_bridge(lm.adapter.embeddings(), bridge)
        runner.inputs = [bridge(x.to(dtype), m if cfg.token_aware else None).detach()
                         for x, m in zip(xs, _first_masks(xs), strict=True)]
        records.append({"span": [s, e], "after": "embeddings",
                        "error_before": _cut_error(xs, y),
                        "error_after": _cut_error(runner.inputs, y)})
    if not cuts:
        return records
    if cfg.recovery in ("foldable", "boundary"):
        for k in cuts:
            check_additive(lm.adapter, k, cfg.recovery)

    def on_block(i, inputs):
        if i not in cuts:
            return
        s, e, y = cuts[i]
        if cfg.recovery == "foldable":
            stats = fit_foldable(runner, i, inputs, y, cfg.ridge)
        elif cfg.recovery == "boundary":
            stats = fit_boundary(runner, i, inputs, y, cfg.ridge)
        else:
            xs = runner.run_block(i, inputs)
            bridge = _bridge(cfg, xs, y, dim, dtype)
            attach_bridge(lm.adapter.block(i), bridge)
            stats = {"error_before": _cut_error(xs, y),
                     "error_after": _cut_error(runner.run_block(i, inputs), y)}
        records.append({"span": [s, e], "after": f"block {i} (new numbering)", **stats})

    runner.run(on_block=on_block, propagate="modified", until=max(cuts), desc="recovery")
    return records


def prune_depth(lm, cfg: Depth, input_ids, data_info: dict | None = None,
                batch_size: int = 8, ctx: ProbeContext | None = None,
                removed: list[int] | None = None) -> dict:
    """Select, delete and repair; returns the report (0-based original block numbers).

    ``ctx``: a probe context of the dense model on the same windows (e.g. shared by the
    points of a sweep, where ``lm`` is a copy of that model); ``removed``: skip selection.
    """
    start = time.perf_counter()
    before = model_size(lm.model)
    n_orig = lm.adapter.num_blocks
    own = ctx is None
    ctx = ctx or ProbeContext(lm, input_ids, batch_size=batch_size, lazy=True)
    evals0 = ctx.block_evaluations
    try:
        if removed is None:
            removed, how = select(lm, cfg, ctx, blocks_to_remove(lm, cfg))
        else:
            removed, how = sorted(removed), {"strategy": "given"}
        info(f"prunelab: removing blocks {removed} (0-based) of {n_orig}")
        ctx.ensure_cached()
        lm.adapter.delete_blocks(removed)
        kl_none = ctx.model_divergence(lm)
        records = recover(lm, cfg, ctx, removed, batch_size) if cfg.recovery != "none" else []
        kl_after = ctx.model_divergence(lm) if records else kl_none
    finally:
        if own:
            ctx.close()
    report = {
        "removed_blocks": removed, "kept_blocks": [i for i in range(n_orig) if i not in removed],
        "num_blocks_before": n_orig, "num_blocks_after": lm.adapter.num_blocks,
        "selection": {k: v for k, v in how.items() if k != "layer_values"},
        "probe_layer_values": how.get("layer_values"),
        "recovery": cfg.recovery, "cuts": records,
        "calib_divergence": ctx.divergence_name,
        "calib_kl_before_recovery": kl_none[1], "calib_kl_after_recovery": kl_after[1],
        "calib_kl_last_before_recovery": kl_none[0], "calib_kl_last_after_recovery": kl_after[0],
        "size_before": before, "size_after": model_size(lm.model),
        "needs_remote_code": cfg.recovery in ("ghost", "lra"),
        "block_evaluations": ctx.block_evaluations - evals0, "seconds": time.perf_counter() - start,
        "data": data_info or {},
    }
    return report
