"""Block-by-block execution of the sparsity methods.

For every block its linears are pruned sublayer group by sublayer group (``[q, k, v]`` ->
``o`` -> ``[gate, up]`` -> ``down``): each group's input statistics are gathered over all
calibration batches with the earlier groups already pruned, then the group is pruned.
:meth:`BlockRunner.sequential` does this in about one pass through the block: every stage
stops once its group's inputs were seen, and the outputs of pruned linears and of finished
attention / MLP branches are recorded once and replayed, so nothing is computed twice that
cannot have changed. The pruned block's outputs (a by-product of the last stage) are the
next block's inputs (``propagate="dense"`` passes on the dense outputs instead: one extra
pass). Linears that receive the same tensor (q, k, v; gate, up) share one set of
statistics, and SparseGPT prunes them as one row-stacked matrix (one column sweep).
OWL and PALS need every block's statistics before choosing per-block sparsities: one
extra dense statistics pass. Linears are selected through the adapter (never the LM head
or the embeddings); Wanda norms are float64, SparseGPT Hessians and masks float32.
"""

from __future__ import annotations

import fnmatch
import time

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import AbsQuantile, Gram, SumSquares
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.models.size import model_size
from prunelab.pruning.sparsity import allocation as alloc
from prunelab.pruning.sparsity import masks, scores
from prunelab.pruning.sparsity.config import Owl, Pals, QKWanda, Ramp, SparsityConfig, to_dict
from prunelab.pruning.sparsity.methods import prune_linears

ROLE_ORDER = (("q", "k", "v", "qkv"), ("o",), ("gate", "up"), ("down",))


def _blocks_prefix(lm) -> str:
    blocks = lm.adapter.blocks()
    return next(name for name, m in lm.model.named_modules() if m is blocks)


def selected_linears(lm, index: int, cfg: SparsityConfig) -> dict[str, torch.nn.Module]:
    """The block's linears that ``targets`` / ``ignore`` select, by path in the block
    (QK-Wanda with ``scope="qk"`` prunes, and so selects, only q and k)."""
    prefix = f"{_blocks_prefix(lm)}.{index}."
    out = {}
    qk_only = isinstance(cfg, QKWanda) and cfg.scope == "qk"
    qk = {lm.adapter.spec.attn_proj.get(r) for r in ("q", "k")}
    for path, module in lm.adapter.linears(index).items():
        if qk_only and path not in qk:
            continue
        names = (path, prefix + path)
        if cfg.targets and not any(fnmatch.fnmatch(n, p) for n in names for p in cfg.targets):
            continue
        if any(fnmatch.fnmatch(n, p) for n in names for p in cfg.ignore):
            continue
        out[path] = module
    return out


def role_groups(lm, index: int, chosen: dict) -> list[dict[str, torch.nn.Module]]:
    """Selected linears grouped by the sublayer order they are pruned in."""
    roles = {**lm.adapter.spec.attn_proj, **lm.adapter.spec.mlp_proj}
    groups = []
    for names in ROLE_ORDER:
        g = {roles[r]: chosen[roles[r]] for r in names if r in roles and roles[r] in chosen}
        if g:
            groups.append(g)
    return groups


def _accumulators(cfg: SparsityConfig):
    if cfg.method == "magnitude":
        return None
    if cfg.method == "sparsegpt":
        return lambda name: [Gram(torch.float32)]
    if cfg.method == "rose":
        return lambda name: [SumSquares(), Gram(torch.float32)]
    return lambda name: [SumSquares()]


def allocate(lm, cfg: SparsityConfig, runner: BlockRunner) -> list[float]:
    """Per-block sparsity whose parameter-weighted mean equals the target."""
    n = lm.adapter.num_blocks
    weights = [sum(m.weight.numel() for m in selected_linears(lm, i, cfg).values())
               for i in range(n)]
    a = cfg.allocation
    if isinstance(a, Ramp):
        return alloc.ramp(n, cfg.sparsity, span=a.span, increasing=a.increasing,
                          weights=weights)
    if not isinstance(a, (Owl, Pals)):
        return alloc.uniform(n, cfg.sparsity)
    ratios, p99 = [], []

    def on_block(i, inputs):
        chosen = selected_linears(lm, i, cfg)
        accs = runner.collect(i, inputs, chosen, lambda name: [SumSquares(), AbsQuantile(
            200_000, seed=i)], stop_early=False)
        if isinstance(a, Owl):
            mats = [scores.wanda_scores(weight_out_in(m).detach(), accs[p][0].sum_sq)
                    for p, m in chosen.items()]
            ratios.append(alloc.outlier_ratio(mats, m=a.m))
        else:
            p99.append(max(accs[p][1].quantile(0.99) for p in chosen))

    runner.run(on_block=on_block, propagate="dense", desc="allocation statistics")
    if isinstance(a, Owl):
        return alloc.owl(ratios, cfg.sparsity, lam=a.lam, weights=weights)
    return alloc.pals(p99, cfg.sparsity, delta=a.delta, weights=weights)


def _qk_group(lm, runner, index, inputs, group, cfg, sparsity) -> dict:
    """QK-Wanda: q and k share one budget; v by Wanda when scope is "block"."""
    ad = lm.adapter
    proj = ad.attn_projections(index)
    if "qkv" in proj:
        raise UnsupportedOperationError(f"qk-wanda needs separate q/k projections; "
                                        f"{ad.family} fuses them")
    q, k = proj["q"], proj["k"]
    _, outs = runner.tap(index, inputs, {"q": q, "k": k})
    geo = ad.head_geometry(index)
    wq, wk = weight_out_in(q).detach(), weight_out_in(k).detach()
    if cfg.variant == "causal":
        _, xs = runner.tap(index, inputs, {"x": q}, what="input")
        a_q = a_k = 0
        for x, qo, ko in zip(xs["x"], outs["q"], outs["k"], strict=True):
            dq, dk = scores.qk_wanda_causal_stats(x, qo, ko)
            a_q, a_k = a_q + dq, a_k + dk
        sq, sk = scores.qk_wanda_causal_scores(wq, wk, a_q, a_k, geo.num_heads,
                                               geo.num_kv_heads, geo.head_dim)
    else:
        ins = runner.collect(index, inputs, {"x": q}, lambda n: SumSquares())["x"][0]
        q_act = sum(o.double().pow(2).reshape(-1, o.shape[-1]).sum(0) for o in outs["q"])
        k_act = sum(o.double().pow(2).reshape(-1, o.shape[-1]).sum(0) for o in outs["k"])
        sq, sk = scores.qk_wanda_scores(wq, wk, ins.sum_sq, k_act, q_act, geo.num_heads,
                                        geo.num_kv_heads, geo.head_dim)
    mq, mk = scores.shared_budget_masks([sq, sk], sparsity)
    done = {}
    for path, module, mask in ((_path(ad, "q"), q, mq), (_path(ad, "k"), k, mk)):
        set_weight_out_in(module, weight_out_in(module).detach() * mask.to(module.weight.device))
        done[path] = module
    return done


def _path(ad, role: str) -> str:
    return ad.spec.attn_proj[role]


def prune_block(lm, runner, index, inputs, cfg: SparsityConfig, sparsity: float,
                taylor: dict | None = None) -> dict:
    """Prune block ``index`` group by group; returns achieved sparsity per linear path.
    ``taylor``: MOONSHOT Taylor terms by ``"{block}:{path}"`` (SparseGPT/ROSE blend)."""
    chosen = selected_linears(lm, index, cfg)
    make = _accumulators(cfg)
    achieved = {}
    groups = [chosen] if cfg.within_block == "dense" and chosen else \
        role_groups(lm, index, chosen)
    for group in groups:
        if isinstance(cfg, QKWanda):
            roles = lm.adapter.spec.attn_proj
            if roles.get("q") in group:
                _qk_group(lm, runner, index, inputs, group, cfg, sparsity)
                group = {p: m for p, m in group.items() if p not in (roles["q"], roles["k"])}
            if cfg.scope == "qk":
                group = {}
        if not group:
            continue
        accs = runner.collect(index, inputs, group, make, share=True) if make else {}
        if taylor:
            for path in group:
                accs[path].append(taylor[f"{index}:{path}"])
        prune_linears(group, accs, cfg, sparsity)
    for path, module in chosen.items():
        achieved[path] = masks.achieved_sparsity(weight_out_in(module))
    return achieved


def _lca(paths) -> str:
    """The deepest module path containing every path (``""``: the block itself)."""
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


def branch_containers(lm, index: int) -> list[torch.nn.Module]:
    """The attention and MLP sub-modules of block ``index`` that hold all their
    projections (the block itself excluded): replaying them skips attention."""
    blk = lm.adapter.block(index)
    out = []
    for roles in (lm.adapter.spec.attn_proj, lm.adapter.spec.mlp_proj):
        path = _lca(roles.values()) if roles else ""
        if path:
            out.append(blk.get_submodule(path))
    return out


def prune_block_sequential(lm, runner, index, inputs, cfg: SparsityConfig, sparsity: float,
                           taylor: dict | None = None) -> tuple[dict, list[torch.Tensor]]:
    """Prune block ``index`` group by group in about one block pass
    (:meth:`BlockRunner.sequential`); returns the achieved sparsity per linear path and the
    pruned block's outputs. Same pruning as :func:`prune_block`."""
    chosen = selected_linears(lm, index, cfg)
    groups = role_groups(lm, index, chosen)

    def on_group(g, accs):
        group = groups[g]
        if taylor:
            for path in group:
                accs[path].append(taylor[f"{index}:{path}"])
        prune_linears(group, accs, cfg, sparsity)

    outs = runner.sequential(index, inputs, groups, _accumulators(cfg), on_group,
                             containers=branch_containers(lm, index))
    achieved = {path: masks.achieved_sparsity(weight_out_in(m)) for path, m in chosen.items()}
    return achieved, outs


def prune_block_on_dense_pass(lm, runner, index, inputs, cfg: SparsityConfig,
                              sparsity: float, taylor: dict | None = None
                              ) -> tuple[dict, list[torch.Tensor]]:
    """``within_block="dense"`` with ``propagate="dense"``: one dense pass gives every
    linear's statistics and the outputs passed on; then the block is pruned (1 pass)."""
    chosen = selected_linears(lm, index, cfg)
    make = _accumulators(cfg)
    outs: list[torch.Tensor] = []
    accs = runner.collect(index, inputs, chosen, make, stop_early=False, outputs=outs,
                          share=True) if make else {}
    if not make:
        outs = runner.run_block(index, inputs)
    if taylor:
        for path in chosen:
            accs[path].append(taylor[f"{index}:{path}"])
    prune_linears(chosen, accs, cfg, sparsity)
    achieved = {path: masks.achieved_sparsity(weight_out_in(m)) for path, m in chosen.items()}
    return achieved, outs


def prune_sparsity(lm, cfg: SparsityConfig, input_ids, data_info: dict | None = None,
                   batch_size: int = 8) -> dict:
    """Prune every block of ``lm`` in place; returns the report."""
    if cfg.method == "qk-wanda" and "qkv" in lm.adapter.spec.attn_proj:
        raise UnsupportedOperationError(f"qk-wanda needs separate q/k projections; "
                                        f"{lm.adapter.family} fuses them")
    start = time.perf_counter()
    before = model_size(lm.model)
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    per_block = allocate(lm, cfg, runner)
    evals_alloc = runner.block_evals / max(len(runner.batches), 1)
    taylor = None
    if getattr(cfg, "hessian_alpha", 0.0) > 0:
        from prunelab.calib.gradients import taylor_terms

        mods = {f"{i}:{p}": m for i in range(lm.adapter.num_blocks)
                for p, m in selected_linears(lm, i, cfg).items()}
        taylor = taylor_terms(lm, input_ids, mods, batch_size=max(1, batch_size // 2))
    layers: list[dict] = []

    one_dense_pass = (cfg.within_block == "dense" and cfg.propagate == "dense"
                      and not isinstance(cfg, QKWanda))

    def on_block(i, inputs):
        outs = None
        if one_dense_pass:
            achieved, outs = prune_block_on_dense_pass(lm, runner, i, inputs, cfg,
                                                       per_block[i], taylor)
        elif isinstance(cfg, QKWanda) or cfg.within_block == "dense":
            achieved = prune_block(lm, runner, i, inputs, cfg, per_block[i], taylor)
        else:
            achieved, outs = prune_block_sequential(lm, runner, i, inputs, cfg,
                                                    per_block[i], taylor)
        layers.append({"block": i, "target": per_block[i], "linears": achieved})
        return outs

    runner.run(on_block=on_block, propagate="modified" if one_dense_pass else cfg.propagate,
               desc=f"{cfg.method} pruning")
    if not any(ly["linears"] for ly in layers):
        raise ConfigError("--targets/--ignore selected no linear layer")
    total = sum(m.weight.numel() for i in range(lm.adapter.num_blocks)
                for m in selected_linears(lm, i, cfg).values())
    zeros = sum(int((weight_out_in(m) == 0).sum()) for i in range(lm.adapter.num_blocks)
                for m in selected_linears(lm, i, cfg).values())
    report = {"method": cfg.method, "config": to_dict(cfg), "per_block_sparsity": per_block,
              "layers": layers, "achieved_sparsity": zeros / max(total, 1),
              "pruned_linear_params": total, "size_before": before,
              "size_after": model_size(lm.model), "data": data_info or {},
              "block_evaluations": runner.block_evals / max(len(runner.batches), 1),
              "allocation_block_evaluations": evals_alloc,
              "seconds": time.perf_counter() - start}
    return report
