"""Block-by-block execution of every sparsity method: the executor knows no method by
name, only the hooks of :class:`~prunelab.pruning.sparsity.config.SparsityConfig`.

For every block its linears are pruned sublayer group by sublayer group (``[q, k, v]`` ->
``o`` -> ``[gate, up]`` -> ``down``): each group's input statistics (the method's
:meth:`~SparsityConfig.accumulators`) are gathered over all calibration batches with the
earlier groups already pruned, then the group is pruned. :meth:`BlockRunner.sequential`
does this in about one pass through the block: every stage stops once its group's inputs
were seen, and the outputs of pruned linears and of finished attention / MLP branches are
recorded once and replayed, so nothing is computed twice that cannot have changed. The
pruned block's outputs (a by-product of the last stage) are the next block's inputs
(``propagate="dense"`` passes on the dense outputs instead: one extra pass). Linears that
receive the same tensor (q, k, v; gate, up) share one set of statistics, and a method may
prune them jointly (:meth:`~SparsityConfig.joint_key`; SparseGPT stacks their rows: one
column sweep). A method whose :meth:`~SparsityConfig.prune_group` runs passes of its own
(``own_block_passes``, QK-Wanda) is pruned group by group with separate passes. OWL and
PALS need every block's statistics before choosing per-block sparsities: one extra dense
statistics pass. Linears are selected through the adapter (never the LM head or the
embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.errors import ConfigError
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.models.memory import release_free_memory
from prunelab.models.streaming import mark_modified
from prunelab.pruning.base import MethodReport, method_name
from prunelab.pruning.linears import branch_containers, selected_linears
from prunelab.pruning.sparsity import masks
from prunelab.pruning.sparsity.config import BlockStage, SparsityConfig


def check_sparsity_config(lm, cfg: SparsityConfig) -> None:
    """The errors a user can cause, before any data is read: the method's own
    :meth:`~SparsityConfig.precheck`, then a selection that holds no linear."""
    cfg.precheck(lm)
    if not any(selected_linears(lm, i, cfg) for i in range(lm.adapter.num_blocks)):
        raise ConfigError("--targets/--ignore selected no linear layer")


def role_groups(lm, index: int, chosen: dict) -> list[dict[str, torch.nn.Module]]:
    """Selected linears grouped by the sublayer order they are pruned in (the adapter's
    :meth:`~prunelab.models.adapters.Adapter.linear_groups`: fused gate/up included)."""
    return lm.adapter.linear_groups(index, chosen)


def allocate(lm, cfg: SparsityConfig, runner: BlockRunner) -> list[float]:
    """Per-block sparsity whose parameter-weighted mean equals the target (one dense
    statistics pass when the allocation needs statistics)."""
    n = lm.adapter.num_blocks
    weights = [sum(m.weight.numel() for m in selected_linears(lm, i, cfg).values())
               for i in range(n)]
    a = cfg.allocation
    values = None
    if a.accumulators(0) is not None:  # the allocation reads calibration statistics
        values = []

        def on_block(i, inputs):
            chosen = selected_linears(lm, i, cfg)
            accs = runner.collect(i, inputs, chosen, a.accumulators(i), stop_early=False)
            values.append(a.block_value({p: weight_out_in(m).detach()
                                         for p, m in chosen.items()}, accs))

        runner.run(on_block=on_block, propagate="dense", desc="allocation statistics")
    return a.sparsities(cfg.target_sparsity, weights, values)


@torch.no_grad()
def prune_linear(module, accs: list | None, cfg: SparsityConfig, sparsity: float) -> None:
    """Prune ``module`` (``nn.Linear`` or ``Conv1D``) in place with the method's
    :meth:`~SparsityConfig.prune_weight`; ``accs``: its accumulators (``None`` for a
    method without statistics). Nothing happens at sparsity 0 without a pattern."""
    if sparsity <= 0 and cfg.nm is None:
        return
    set_weight_out_in(module, cfg.prune_weight(weight_out_in(module).detach(), accs,
                                               sparsity))


@torch.no_grad()
def prune_linears(modules: dict, accs: dict, cfg: SparsityConfig, sparsity: float) -> None:
    """Prune ``modules`` (path -> linear) in place: alone, or together with the linears
    sharing its :meth:`~SparsityConfig.joint_key` through
    :meth:`~SparsityConfig.prune_joint` (SparseGPT: linears sharing one Gram as one
    row-stacked matrix, one column sweep instead of three)."""
    joint: dict = {}
    for path, module in modules.items():
        key = cfg.joint_key(weight_out_in(module), accs.get(path))
        if key is None:
            prune_linear(module, accs.get(path), cfg, sparsity)
        else:
            joint.setdefault(key, []).append(path)
    for paths in joint.values():
        if len(paths) == 1 or (sparsity <= 0 and cfg.nm is None):
            for p in paths:
                prune_linear(modules[p], accs.get(p), cfg, sparsity)
            continue
        ws = [weight_out_in(modules[p]).detach() for p in paths]
        new = cfg.prune_joint(ws, [accs[p] for p in paths], sparsity)
        for p, w in zip(paths, new, strict=True):
            set_weight_out_in(modules[p], w)


def _add_model_stats(accs: dict, group: dict, index: int, extra: dict | None) -> None:
    """Append each linear's whole-model statistic (``"{block}:{path}"``) to its list."""
    if extra:
        for path in group:
            accs.setdefault(path, []).append(extra[f"{index}:{path}"])


def _achieved(chosen: dict) -> dict[str, float]:
    return {path: masks.achieved_sparsity(weight_out_in(m)) for path, m in chosen.items()}


def prune_block(lm, runner, index, inputs, cfg: SparsityConfig, sparsity: float,
                extra: dict | None = None) -> dict:
    """Prune block ``index`` group by group, a pass per group (all linears as one group
    with ``within_block="dense"``); returns achieved sparsity per linear path. ``extra``:
    whole-model statistics by ``"{block}:{path}"`` (:meth:`~SparsityConfig.model_statistics`)."""
    chosen = selected_linears(lm, index, cfg)
    make = cfg.accumulators()
    groups = [chosen] if cfg.within_block == "dense" and chosen else \
        role_groups(lm, index, chosen)
    stage = BlockStage(lm, runner, index, inputs)
    for group in groups:
        group = cfg.prune_group(stage, group, sparsity)
        if not group:
            continue
        accs = runner.collect(index, inputs, group, make, share=True) if make else {}
        _add_model_stats(accs, group, index, extra)
        prune_linears(group, accs, cfg, sparsity)
    return _achieved(chosen)


def prune_block_sequential(lm, runner, index, inputs, cfg: SparsityConfig, sparsity: float,
                           extra: dict | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Prune block ``index`` group by group in about one block pass
    (:meth:`BlockRunner.sequential`); returns the achieved sparsity per linear path and the
    pruned block's outputs. Same pruning as :func:`prune_block`."""
    chosen = selected_linears(lm, index, cfg)
    groups = role_groups(lm, index, chosen)
    stage = BlockStage(lm, runner, index, inputs)

    def on_group(g, accs):
        group = cfg.prune_group(stage, groups[g], sparsity)
        _add_model_stats(accs, group, index, extra)
        prune_linears(group, accs, cfg, sparsity)

    outs = runner.sequential(index, inputs, groups, cfg.accumulators(), on_group,
                             containers=branch_containers(lm, index))
    return _achieved(chosen), outs


def prune_block_on_dense_pass(lm, runner, index, inputs, cfg: SparsityConfig,
                              sparsity: float, extra: dict | None = None
                              ) -> tuple[dict, list[torch.Tensor]]:
    """``within_block="dense"`` with ``propagate="dense"``: one dense pass gives every
    linear's statistics and the outputs passed on; then the block is pruned (1 pass)."""
    chosen = selected_linears(lm, index, cfg)
    make = cfg.accumulators()
    outs: list[torch.Tensor] = []
    accs = runner.collect(index, inputs, chosen, make, stop_early=False, outputs=outs,
                          share=True) if make else {}
    if not make:
        outs = runner.run_block(index, inputs)
    group = cfg.prune_group(BlockStage(lm, runner, index, inputs), chosen, sparsity)
    _add_model_stats(accs, group, index, extra)
    prune_linears(group, accs, cfg, sparsity)
    return _achieved(chosen), outs


@dataclass
class SparsityReport(MethodReport):
    """A sparsity run: ``per_block_sparsity`` (targets, 0-based blocks), ``layers`` (per
    block: ``block``, ``target``, ``linears`` {path: achieved sparsity}),
    ``achieved_sparsity`` over the pruned linears, ``pruned_linear_params``,
    ``block_evaluations`` (block passes per batch, pruning) and
    ``allocation_block_evaluations`` (of which the allocation's statistics)."""

    per_block_sparsity: list[float]
    layers: list[dict]
    achieved_sparsity: float
    pruned_linear_params: int
    block_evaluations: float
    allocation_block_evaluations: float

    def history(self) -> dict:
        return {"achieved_sparsity": self.achieved_sparsity}


def _prune_all_blocks(lm, cfg: SparsityConfig, runner: BlockRunner, per_block: list[float],
                      extra: dict | None) -> list[dict]:
    """Run the blocks in order, each pruned in the cheapest order the config allows."""
    layers: list[dict] = []
    one_dense_pass = (cfg.within_block == "dense" and cfg.propagate == "dense"
                      and not cfg.own_block_passes)

    def on_block(i, inputs):
        outs = None
        args = (lm, runner, i, inputs, cfg, per_block[i], extra)
        if one_dense_pass:
            achieved, outs = prune_block_on_dense_pass(*args)
        elif cfg.own_block_passes or cfg.within_block == "dense":
            achieved = prune_block(*args)
        else:
            achieved, outs = prune_block_sequential(*args)
        layers.append({"block": i, "target": per_block[i], "linears": achieved})
        mark_modified(runner, lm.adapter.block(i))  # streamed: staged when it leaves memory
        release_free_memory()  # the block's freed activations go back to the system
        return outs

    runner.run(on_block=on_block, propagate="modified" if one_dense_pass else cfg.propagate,
               desc=f"{method_name(cfg)} pruning")
    return layers


def prune_sparsity(lm, cfg: SparsityConfig, input_ids: torch.Tensor,
                   batch_size: int = 8) -> SparsityReport:
    """Prune every block of ``lm`` in place on calibration ``input_ids`` ``[N, T]``."""
    check_sparsity_config(lm, cfg)
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    per_block = allocate(lm, cfg, runner)
    evals_alloc = runner.block_evals / max(len(runner.batches), 1)
    selected = [selected_linears(lm, i, cfg) for i in range(lm.adapter.num_blocks)]
    extra = cfg.model_statistics(lm, input_ids, {f"{i}:{p}": m for i, sel in
                                                 enumerate(selected) for p, m in sel.items()},
                                 batch_size)
    layers = _prune_all_blocks(lm, cfg, runner, per_block, extra)
    total = sum(m.weight.numel() for sel in selected for m in sel.values())
    zeros = sum(int((weight_out_in(m) == 0).sum()) if not m.weight.is_meta  # streamed:
                else round(layers[i]["linears"][p] * m.weight.numel())  # block on disk
                for i, sel in enumerate(selected) for p, m in sel.items())
    return SparsityReport(per_block_sparsity=per_block, layers=layers,
                          achieved_sparsity=zeros / max(total, 1), pruned_linear_params=total,
                          block_evaluations=runner.block_evals / max(len(runner.batches), 1),
                          allocation_block_evaluations=evals_alloc)
