"""Structured width pruning, end to end: score, allocate, slice, compensate, report.

1. Early checks (:meth:`WidthPruner.precheck`, before any calibration work): multi-query
   models cannot lose KV groups, query heads need separate q/k/v projections, scores that
   measure the LM loss need an LM head.
2. Scores (the config's registered :class:`~prunelab.pruning.width.scoring.WidthScore`):
   weight-only (magnitude profile), from one dense statistics pass over the consumers'
   inputs (wanda-sp, FLAP, Putri channels), or from ablations (ablation-kl, Putri heads
   round by round, CoCurve).
3. Allocation (the registered allocation): uniform counts per block, or global under the
   parameter budget.
4. Slicing through the adapter; with ``compensate`` a second, block-by-block pass on the
   *pruned* stream refits each consumer (``o_proj``, ``down_proj``) by least squares, so
   later blocks see earlier updates; FLAP bias compensation where the consumer has a bias.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Gram, MeanVar
from prunelab.errors import UnsupportedOperationError
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.models.size import model_size
from prunelab.models.streaming import holding
from prunelab.pruning.base import EXPERTS, FACTORED, PRUNERS, SKIPPED, TOKENS, MethodReport, Pruner
from prunelab.pruning.width import plan as P
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.config import Width


def check_width(lm, cfg: Width) -> None:
    """Errors a user can cause, raised before any calibration work."""
    ad = lm.adapter
    geo = ad.head_geometry(0)
    fused = "qkv" in ad.spec.attn_proj
    if cfg.unit in ("heads", "joint") and cfg.heads == "groups" and geo.num_kv_heads == 1:
        raise UnsupportedOperationError(
            f"{lm.spec} is multi-query (1 KV head shared by {geo.num_heads} query heads): "
            "removing a KV group would remove all attention; prune query heads inside the "
            "group with --unit heads --heads query" + (
                " (joint/cocurve units are whole KV groups)" if cfg.unit == "joint" else ""))
    if cfg.unit == "heads" and cfg.heads == "query" and (fused or geo.group_size == 1):
        raise UnsupportedOperationError(
            f"{ad.family}: --heads query needs grouped (GQA/MQA) attention with separate "
            "q/k/v projections; use --heads groups")
    if cfg.score.needs_lm_head(cfg.unit) and ad.head() is None:
        raise UnsupportedOperationError(
            f"{cfg.score_name} measures the LM loss: {lm.spec} has no LM head")


def _has_bias(ad, kind: str) -> bool:
    roles = ("o",) if kind == "heads" else ("down",)
    get = ad.attn_projections if kind == "heads" else ad.mlp_projections
    return any(getattr(get(0)[r], "bias", None) is not None for r in roles)


@dataclass
class WidthReport(MethodReport):
    """What width pruning did: kept/removed units per block (0-based), the budget, the
    parameters removed, compensation done; ``extra``: the score's own entries
    (``putri_rounds``, ``cocurve``), flattened by :meth:`to_dict`."""

    unit: str
    score: str
    allocation: str
    budget_params: int
    removed_params: int
    blocks: list
    compensation: dict
    needs_remote_code: bool
    vanilla_problems: list
    block_evaluations: float
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = super().to_dict()
        extra = d.pop("extra")
        return {**d, **extra}

    def history(self) -> dict:
        return {"removed_params": self.removed_params}


def run_width(lm, cfg: Width, input_ids, batch_size: int = 8) -> WidthReport:
    """Prune ``lm`` in place by ``cfg`` (checked by :func:`check_width` first)."""
    check_width(lm, cfg)
    ad = lm.adapter
    params_before = model_size(lm.model)["params"]
    shapes_before = _shapes(ad)
    budget = P.removal_budget(lm, cfg, params_before)
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    kinds = ("heads", "ffn") if cfg.unit == "joint" else (cfg.unit,)
    bias = any(_has_bias(ad, k) for k in kinds)
    stats = P.collect_stats(lm, cfg, runner) if P.needs_stats(cfg, bias) else None
    plans = [P.BlockPlan(i) for i in range(ad.num_blocks)]
    job = P.WidthJob(lm, cfg, input_ids, batch_size, runner, stats, budget, plans)
    extra = cfg.score.plan(job)
    compensation = apply_plans(lm, cfg, runner, plans, stats)
    return WidthReport(
        unit=cfg.unit, score=cfg.score_name, allocation=cfg.allocation_name,
        budget_params=budget, removed_params=params_before - model_size(lm.model)["params"],
        blocks=_block_report(ad, plans, shapes_before), compensation=compensation,
        needs_remote_code=bool(ad.vanilla_problems()),
        vanilla_problems=ad.vanilla_problems(),
        block_evaluations=runner.block_evals / max(len(runner.batches), 1), extra=extra)


def prune_width(lm, cfg: Width, input_ids, data_info: dict | None = None,
                batch_size: int = 8) -> dict:
    """:func:`run_width` as a dict, plus ``size_before``, ``size_after``, ``seconds`` and
    ``data`` (what :func:`prunelab.prune` adds for its callers)."""
    start = time.perf_counter()
    before = model_size(lm.model)
    report = run_width(lm, cfg, input_ids, batch_size=batch_size)
    return {**report.to_dict(), "size_before": before, "size_after": model_size(lm.model),
            "seconds": time.perf_counter() - start, "data": data_info or {}}


@PRUNERS.register(Width)
class WidthPruner(Pruner):
    """Width pruning as a :func:`prunelab.prune` method."""

    operation = "prune-width"
    refuses_kinds = FACTORED | EXPERTS | SKIPPED | TOKENS

    def precheck(self, lm, config: Width) -> None:
        check_width(lm, config)

    def run(self, lm, config: Width, input_ids, *, batch_size: int) -> WidthReport:
        return run_width(lm, config, input_ids, batch_size=batch_size)


# ---------------------------------------------------------------- slicing + compensation
def _consumer_keep(ad, i: int, p: P.BlockPlan) -> torch.Tensor | None:
    geo = ad.head_geometry(i)
    units = S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim,
                         "query" if p.query is not None else "groups")
    if p.groups is not None and len(p.groups) < geo.num_kv_heads:
        return torch.cat([units[g] for g in p.groups])
    if p.query is not None and len(p.query[0]) < geo.group_size:
        gs = geo.group_size
        return torch.cat([units[g * gs + h] for g, hs in enumerate(p.query) for h in hs])
    return None


def _slice_attention(ad, i: int, p: P.BlockPlan) -> None:
    if p.groups is not None:
        ad.slice_kv_groups(i, p.groups)
    else:
        ad.slice_query_heads(i, p.query)


def _set_consumer(module, w_new, db) -> None:
    set_weight_out_in(module, w_new)
    if db is not None:
        with torch.no_grad():
            module.bias.add_(db.to(module.bias.dtype).to(module.bias.device))


def _new_consumer(cfg: Width, runner: BlockRunner, i: int, name: str, module, keep,
                  inputs, stats, done: dict):
    """The consumer's weight over its kept input columns and a bias change (or ``None``):
    refitted on the pruned stream's ``inputs`` when given, else sliced (with FLAP's bias
    compensation from the dense input means where the consumer has a bias)."""
    w = weight_out_in(module).detach().clone()
    has_b = getattr(module, "bias", None) is not None
    if inputs is not None:
        accs = runner.collect(i, inputs, {name: module}, lambda n: [Gram(), MeanVar()])[name]
        w_new, db = S.refit_consumer(w, accs[0].xtx, keep, accs[1].s1 if has_b else None,
                                     accs[0].tokens, damp=cfg.damp)
        done["least_squares"].append(f"{i}:{name}")
        return w_new, db
    if has_b and cfg.bias_compensation and stats and name in stats[i]:
        kept = set(keep.tolist())
        removed = torch.tensor([c for c in range(w.shape[1]) if c not in kept])
        done["bias"].append(f"{i}:{name}")
        return w[:, keep], S.flap_bias(w, removed, stats[i][name][1].mean())
    return w[:, keep], None


def apply_plans(lm, cfg: Width, runner: BlockRunner, plans, stats) -> dict:
    """Slice every block by its plan. With ``cfg.compensate``: block by block on the pruned
    stream, gather ``X^T X`` (and ``sum X``) of the consumer's full input, slice, refit.
    Otherwise FLAP bias compensation (dense input means) where the consumer has a bias."""
    ad = lm.adapter
    done = {"least_squares": [], "bias": []}

    def one(i, inputs):
        p = plans[i]
        ffn_keep = torch.tensor(p.ffn) if p.ffn is not None and len(p.ffn) < \
            ad.ffn_width(i) else None
        jobs = [("o", _consumer_keep(ad, i, p), lambda: _slice_attention(ad, i, p),
                 ad.attn_projections(i)["o"]),
                ("down", ffn_keep, lambda: ad.slice_ffn(i, p.ffn),
                 ad.mlp_projections(i)["down"])]
        for name, keep, do_slice, module in jobs:
            if keep is not None:
                w_new, db = _new_consumer(cfg, runner, i, name, module, keep, inputs, stats,
                                          done)
                do_slice()  # the adapter slices the consumer together with its producers
                _set_consumer(module, w_new, db)

    if cfg.compensate:
        runner.run(on_block=one, propagate="modified", desc="width compensation")
    else:
        for i in range(ad.num_blocks):
            with holding(runner, ad.block(i)):  # a streamed block: read from disk
                one(i, None)
    return done


# ---------------------------------------------------------------- report
def _shapes(ad) -> list[dict]:
    out = []
    for i in range(ad.num_blocks):
        g = ad.head_geometry(i)
        out.append({"heads": g.num_heads, "kv_heads": g.num_kv_heads, "ffn": ad.ffn_width(i)})
    return out


def _block_report(ad, plans, before) -> list[dict]:
    rows = []
    for i, p in enumerate(plans):
        g = ad.head_geometry(i)
        b = before[i]
        row = {"block": i, "heads_before": b["heads"], "heads_after": g.num_heads,
               "kv_heads_before": b["kv_heads"], "kv_heads_after": g.num_kv_heads,
               "ffn_before": b["ffn"], "ffn_after": ad.ffn_width(i)}
        if p.groups is not None:
            row["kept_groups"] = list(p.groups)
            row["removed_groups"] = [x for x in range(b["kv_heads"]) if x not in p.groups]
        if p.query is not None:
            row["kept_query_heads"] = [list(q) for q in p.query]
        if p.ffn is not None:
            kept = set(p.ffn)
            row["removed_channels"] = [c for c in range(b["ffn"]) if c not in kept]
        rows.append(row)
    return rows


