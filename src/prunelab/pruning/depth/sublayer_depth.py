"""Apply a sub-block depth plan (BlockPruner, Zhong et al. 2024): remove the chosen
attention / MLP branches for real (:func:`prunelab.models.sublayer.remove_sublayers`;
blocks that lose both are deleted, so a plan of whole blocks stays a plain checkpoint),
repair every cut in order on the calibration windows, and account parameters and FLOPs
per sub-block.

Cuts are runs of removed units (see :mod:`prunelab.pruning.depth.removal_plan`); each is repaired
at the output of the block holding the last kept unit before it (the embeddings for a run
from block 0's attention), towards the dense stream after the run. ``ghost`` and ``lra``
repair every cut; ``foldable`` folds into that block's MLP, so a cut after a block that
lost its MLP (or at the embeddings) stays unrepaired, and the report says so. With
``recovery_in_loop`` only the cuts whose repair helped in the search are repaired.
"""

from __future__ import annotations

from dataclasses import dataclass

from prunelab.calib.runner import BlockRunner
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.log import info
from prunelab.models.custom import flops_per_token
from prunelab.models.sublayer import branch_paths, remove_sublayers, sublayer_params
from prunelab.pruning.depth.config import select
from prunelab.pruning.depth.recoveries import RECOVERIES
from prunelab.pruning.depth.removal_plan import PlanScorer, cut_block, cuts_of, unit_name, unit_of
from prunelab.pruning.depth.report import DepthReport


@dataclass
class SublayerDepthReport(DepthReport):
    """:class:`DepthReport` of a sub-block plan: ``removed_blocks`` are the blocks that lost
    both branches (deleted); ``removed_sublayers`` every removed ``[block, part]``
    (0-based, original numbering); ``accounting`` parameters and FLOPs per sub-block."""

    granularity: str = "sublayer"
    removed_sublayers: list | None = None
    partial_blocks: list | None = None
    accounting: dict | None = None

    def history(self) -> dict:
        return {**super().history(), "removed_sublayers": self.removed_sublayers}


def sublayer_accounting(lm, parts) -> dict:
    """Parameters and FLOPs per token (multiply-adds x 2 of its linears) of each removed
    ``(block, part)`` branch, before removal."""
    rows = []
    for b, part in parts:
        branch, _ = branch_paths(lm.adapter, b, part)
        rows.append({"block": b, "part": part,
                     "params": sublayer_params(lm.adapter, b, part),
                     "flops_per_token": flops_per_token(lm.adapter.block(b)
                                                        .get_submodule(branch))})
    return {"sublayers": rows, "params_removed": sum(r["params"] for r in rows),
            "flops_per_token_removed": sum(r["flops_per_token"] for r in rows)}


def _refusal(recovery, adapter, k_new: int, mlp_gone: bool) -> str | None:
    """Why ``recovery`` cannot repair a cut after block ``k_new`` (new numbering)."""
    if k_new >= 0 and mlp_gone and not hasattr(recovery, "make_bridge"):
        return f"{RECOVERIES.name_of(recovery)} needs the MLP of the block before the cut"
    try:
        recovery.check(adapter, k_new)
    except UnsupportedOperationError as exc:
        return str(exc)
    return None


def fit_cuts(lm, recovery, ctx, units, kept: list[int], targets: dict, repair,
             batch_size: int) -> list[dict]:
    """Repair the cuts of ``units`` (original numbering) on the shortened ``lm`` in order,
    each seeing the repaired model's state; ``kept``: original positions of the kept
    blocks; ``targets``: dense stream after each cut; ``repair``: cuts to repair."""
    records, todo = [], {}
    for cut in cuts_of(units):
        k = cut_block(cut[0])
        k_new = kept.index(k) if k >= 0 else -1
        why = "not repaired: no gain in the search" if cut not in repair else \
            _refusal(recovery, lm.adapter, k_new, 2 * k + 1 in units)
        span = [list(unit_name(cut[0])), list(unit_name(cut[1]))]
        if why is not None:
            records.append({"units": span, "skipped": why})
        else:
            todo[k_new] = (span, targets[cut])
    if not todo:
        return records
    runner = BlockRunner(lm, ctx.input_ids, batch_size=batch_size)
    runner.capture()
    if -1 in todo:
        span, y = todo.pop(-1)
        runner.inputs, stats = recovery.at_embeddings(runner, runner.inputs, y)
        records.append({"units": span, "after": "embeddings", **stats})

    def on_block(i, inputs):
        if i in todo:
            span, y = todo[i]
            stats = recovery.at_block(runner, i, inputs, y)
            records.append({"units": span, "after": f"block {i} (new numbering)", **stats})

    if todo:
        runner.run(on_block=on_block, propagate="modified", until=max(todo),
                   desc="recovery")
    return records


def run_sublayer_depth(lm, cfg, ctx, batch_size: int, evals0: float,
                       n: int) -> SublayerDepthReport:
    """Select sub-blocks with ``cfg``'s strategy, remove them and repair the cuts
    (``lm`` in place; ``ctx``: the dense model's probe context)."""
    n_orig = lm.adapter.num_blocks
    if cfg.sublayers:
        bad = [list(p) for p in cfg.sublayers if p[0] >= n_orig]
        if bad:
            raise ConfigError(f"sublayers {bad} invalid for {n_orig} blocks")
        if len(cfg.sublayers) == 2 * n_orig:
            raise ConfigError(f"sublayers remove every branch of all {n_orig} blocks")
        parts, how = list(cfg.sublayers), {"strategy": "explicit", "granularity": "sublayer"}
    else:
        parts, how = select(lm, cfg, ctx, n)
    parts = [(int(b), str(p)) for b, p in parts]
    info(f"prunelab: removing sub-blocks {parts} (0-based) of {n_orig} blocks")
    ctx.ensure_cached()
    units = frozenset(unit_of(b, p) for b, p in parts)
    scorer = PlanScorer(ctx)
    targets = {cut: scorer.target(cut[1]) for cut in cuts_of(units)}  # before surgery
    repair = {tuple(c) for c in how["repaired_cuts"]} if cfg.recovery_in_loop \
        else set(targets)
    accounting = sublayer_accounting(lm, parts)
    accounting["flops_per_token_before"] = flops_per_token(lm.model)
    rec = remove_sublayers(lm, parts)
    accounting["flops_per_token_after"] = flops_per_token(lm.model)
    kl_none = ctx.model_divergence(lm)
    records = fit_cuts(lm, cfg.recovery, ctx, units, rec["kept_blocks"], targets, repair,
                       batch_size) if cfg.recovery.fits else []
    fitted = any("skipped" not in r for r in records)
    kl_after = ctx.model_divergence(lm) if fitted else kl_none
    return SublayerDepthReport(
        removed_blocks=rec["deleted_blocks"], kept_blocks=rec["kept_blocks"],
        num_blocks_before=n_orig, num_blocks_after=lm.adapter.num_blocks,
        selection={k: v for k, v in how.items() if k != "layer_values"},
        probe_layer_values=None, recovery=RECOVERIES.name_of(cfg.recovery), cuts=records,
        calib_divergence=ctx.divergence_name,
        calib_kl_before_recovery=kl_none[1], calib_kl_after_recovery=kl_after[1],
        calib_kl_last_before_recovery=kl_none[0], calib_kl_last_after_recovery=kl_after[0],
        needs_remote_code=bool(rec["partial_blocks"]) or
        (fitted and cfg.recovery.needs_remote_code),
        block_evaluations=ctx.block_evaluations - evals0,
        removed_sublayers=[list(p) for p in sorted(parts)],
        partial_blocks=rec["partial_blocks"], accounting=accounting)


def refuse_given_blocks() -> None:
    raise ConfigError("--granularity sublayer selects its own sub-blocks: removed blocks "
                      "cannot be given")
