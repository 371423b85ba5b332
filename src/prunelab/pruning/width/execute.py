"""Structured width pruning, end to end: score, allocate, slice, compensate, report.

1. Early checks (before any calibration work): multi-query models cannot lose KV groups,
   ablation scores need an LM head.
2. Scores: weight-only (magnitude profile), from one dense statistics pass over the
   consumers' inputs (wanda-sp, FLAP, Putri channels), or from whole-model ablations
   (ablation-kl, Putri heads round by round, CoCurve).
3. Allocation: uniform counts per block, or global under the parameter budget.
4. Slicing through the adapter; with ``compensate`` a second, block-by-block pass on the
   *pruned* stream refits each consumer (``o_proj``, ``down_proj``) by least squares, so
   later blocks see earlier updates; FLAP bias compensation where the consumer has a bias.
"""

from __future__ import annotations

import time

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Gram, MeanVar
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.models.size import model_size
from prunelab.pruning.width import plan as P
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.ablation import loss_deltas, putri_rounds
from prunelab.pruning.width.config import Width, to_dict


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
    if cfg.score in ("ablation-kl", "cocurve") or (cfg.score == "putri" and
                                                   cfg.unit == "heads"):
        if ad.head() is None:
            raise UnsupportedOperationError(
                f"{cfg.score} measures the LM loss: {lm.spec} has no LM head")
    if cfg.score == "putri" and cfg.unit == "heads" and cfg.heads == "query":
        raise ConfigError("putri removes whole KV groups round by round: use --heads groups")


def _has_bias(ad, kind: str) -> bool:
    roles = ("o",) if kind == "heads" else ("down",)
    get = ad.attn_projections if kind == "heads" else ad.mlp_projections
    return any(getattr(get(0)[r], "bias", None) is not None for r in roles)


def prune_width(lm, cfg: Width, input_ids, data_info: dict | None = None,
                batch_size: int = 8) -> dict:
    """Prune ``lm`` in place by ``cfg``; returns the report (kept/removed units per block,
    parameters and bytes before/after)."""
    check_width(lm, cfg)
    start = time.perf_counter()
    ad = lm.adapter
    before = model_size(lm.model)
    shapes_before = _shapes(ad)
    budget = P.removal_budget(lm, cfg, before["params"])
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    kinds = ("heads", "ffn") if cfg.unit == "joint" else (cfg.unit,)
    bias = any(_has_bias(ad, k) for k in kinds)
    stats = P.collect_stats(lm, cfg, runner) if P.needs_stats(cfg, bias) else None
    plans = [P.BlockPlan(i) for i in range(ad.num_blocks)]
    extra: dict = {}
    if cfg.unit == "joint":
        extra = _plan_cocurve(lm, cfg, input_ids, batch_size, stats, budget, plans)
    elif cfg.unit == "heads" and cfg.score == "putri":
        extra = _plan_putri_heads(lm, cfg, input_ids, budget, plans)
    else:
        _plan_scored(lm, cfg, input_ids, batch_size, stats, budget, plans)
    compensation = apply_plans(lm, cfg, runner, plans, stats)
    after = model_size(lm.model)
    report = {
        "method": "width", "config": to_dict(cfg), "unit": cfg.unit, "score": cfg.score,
        "allocation": cfg.allocation, "budget_params": budget,
        "removed_params": before["params"] - after["params"],
        "blocks": _block_report(ad, plans, shapes_before),
        "compensation": compensation, "size_before": before, "size_after": after,
        "needs_remote_code": bool(ad.vanilla_problems()),
        "vanilla_problems": ad.vanilla_problems(), "data": data_info or {},
        "block_evaluations": runner.block_evals / max(len(runner.batches), 1),
        "seconds": time.perf_counter() - start, **extra}
    return report


# ---------------------------------------------------------------- planning
def _plan_scored(lm, cfg, input_ids, batch_size, stats, budget, plans) -> None:
    ad = lm.adapter
    kind = cfg.unit
    if cfg.score == "ablation-kl":
        per_block = (P.ablation_head_scores(lm, cfg, input_ids, batch_size) if kind == "heads"
                     else P.ablation_ffn_scores(lm, cfg, input_ids, batch_size, stats))
        scored = [(s, None) for s in per_block]
    else:
        fn = P.head_scores if kind == "heads" else P.ffn_scores
        scored = [fn(lm, cfg, i, stats) for i in range(ad.num_blocks)]
    steps = []
    for i, (s, protect) in enumerate(scored):
        plans[i].scores[kind] = s
        if cfg.allocation == "global" and cfg.score == "flap":
            s = S.standardise(s)
        steps.append(P.block_steps(lm, cfg, i, s, protect, kind))
    counts = (P.uniform_counts(lm, cfg, kind, budget) if cfg.allocation == "uniform"
              else P.global_counts(lm, cfg, steps, kind, budget))
    P.plan_from_counts(lm, cfg, steps, counts, kind, plans)


def _kv_group_units(ad, i_blocks):
    """``(block, group, o_proj, o's input columns of the group)`` for every KV group of the
    given blocks: the units Putri and CoCurve ablate."""
    for i in i_blocks:
        geo = ad.head_geometry(i)
        o = ad.attn_projections(i)["o"]
        for g, cols in enumerate(S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim)):
            yield i, g, o, cols


def _plan_putri_heads(lm, cfg, input_ids, budget, plans) -> dict:
    """Putri heads: KV groups removed round by round by masked perplexity on one window."""
    ad = lm.adapter
    units, where = [], []
    for i, g, o, cols in _kv_group_units(ad, i_blocks=range(ad.num_blocks)):
        units.append((o, cols))
        where.append((i, g, P.group_cost(ad, i)))
    if cfg.allocation == "uniform":
        per_block = P.uniform_counts(lm, cfg, "heads", budget)
        n_remove = sum(per_block)

        def allowed(removed, u):
            i = where[u][0]
            return sum(where[r][0] == i for r in removed) < per_block[i]
    else:
        n_remove = len(units)

        def allowed(removed, u):
            i = where[u][0]
            spent = sum(where[r][2] for r in removed)
            left = ad.head_geometry(i).num_kv_heads - sum(where[r][0] == i for r in removed)
            return spent < budget and left > 1
    log = putri_rounds(lm.model, input_ids[:1], units, n_remove, allowed,
                       per_round=cfg.putri_per_round)
    gone = {(where[u][0], where[u][1]) for u, _ in log}
    for i in range(ad.num_blocks):
        plans[i].groups = [g for g in range(ad.head_geometry(i).num_kv_heads)
                           if (i, g) not in gone]
    return {"putri_rounds": [{"block": where[u][0], "group": where[u][1], "perplexity": p}
                             for u, p in log]}


def _plan_cocurve(lm, cfg, input_ids, batch_size, stats, budget, plans) -> dict:
    """CoCurve: KV groups and FFN channel chunks (wanda-sp order, ``channel_group`` each)
    ablated once; box QP under the parameter budget; greedy rounding."""
    ad = lm.adapter
    units, meta = [], []
    for i in range(ad.num_blocks):
        for _, g, o, cols in _kv_group_units(ad, i_blocks=(i,)):
            units.append((o, cols))
            meta.append(("heads", i, g, P.group_cost(ad, i), len(cols)))
        down = ad.mlp_projections(i)["down"]
        ws = S.wanda_sp_columns(weight_out_in(down).detach(), stats[i]["down"][0].sum_sq)
        for chunk in torch.argsort(ws, stable=True).split(cfg.channel_group):
            units.append((down, chunk))
            meta.append(("ffn", i, chunk.tolist(), P.channel_cost(ad, i) * len(chunk),
                         len(chunk)))
    deltas = loss_deltas(lm.model, input_ids[:cfg.ablation_samples], units, batch_size)
    a, f = S.cocurve_features(deltas)
    c = torch.tensor([m[3] for m in meta], dtype=torch.float64)
    z = S.solve_box_qp(a, f, c, float(budget))

    def allowed(chosen, u):
        kind, i = meta[u][0], meta[u][1]
        same = [v for v in chosen if meta[v][0] == kind and meta[v][1] == i]
        if kind == "heads":
            return len(same) + 1 < ad.head_geometry(i).num_kv_heads
        left = ad.ffn_width(i) - sum(meta[v][4] for v in same) - meta[u][4]
        return left >= min(cfg.round_to, ad.ffn_width(i))
    chosen = S.greedy_round(z, c, float(budget), allowed, a, f)
    for i in range(ad.num_blocks):
        gone_g = {meta[u][2] for u in chosen if meta[u][:2] == ("heads", i)}
        gone_c = {ch for u in chosen if meta[u][:2] == ("ffn", i) for ch in meta[u][2]}
        plans[i].groups = [g for g in range(ad.head_geometry(i).num_kv_heads)
                           if g not in gone_g]
        keep = [ch for ch in range(ad.ffn_width(i)) if ch not in gone_c]
        width = S.round_width(ad.ffn_width(i), len(keep), cfg.round_to)
        if width > len(keep):  # give back the best-scored removed channels
            ws = S.wanda_sp_columns(weight_out_in(ad.mlp_projections(i)["down"]).detach(),
                                    stats[i]["down"][0].sum_sq)
            back = sorted(gone_c, key=lambda ch: -float(ws[ch]))[:width - len(keep)]
            keep = sorted(keep + back)
        elif width < len(keep):
            ws = S.wanda_sp_columns(weight_out_in(ad.mlp_projections(i)["down"]).detach(),
                                    stats[i]["down"][0].sum_sq)
            keep = sorted(sorted(keep, key=lambda ch: -float(ws[ch]))[:width])
        plans[i].ffn = keep
    return {"cocurve": {"units": len(units), "qp_objective": S.quadratic_cost(a, f, chosen),
                        "relaxed_removed_cost": float(c @ z)}}


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


def apply_plans(lm, cfg: Width, runner: BlockRunner, plans, stats) -> dict:
    """Slice every block by its plan. With ``cfg.compensate``: block by block on the pruned
    stream, gather ``X^T X`` (and ``sum X``) of the consumer's full input, slice, refit.
    Otherwise FLAP bias compensation (dense input means) where the consumer has a bias."""
    ad = lm.adapter
    done = {"least_squares": [], "bias": []}

    def one(i, inputs):
        p = plans[i]
        jobs = [("o", _consumer_keep(ad, i, p), lambda: _slice_attention(ad, i, p),
                 ad.attn_projections(i)["o"])]
        ffn_keep = torch.tensor(p.ffn) if p.ffn is not None and len(p.ffn) < \
            ad.ffn_width(i) else None
        jobs.append(("down", ffn_keep, lambda: ad.slice_ffn(i, p.ffn),
                     ad.mlp_projections(i)["down"]))
        for name, keep, do_slice, module in jobs:
            if keep is None:
                continue
            w = weight_out_in(module).detach().clone()
            width = w.shape[1]
            has_b = getattr(module, "bias", None) is not None
            kept = set(keep.tolist())
            removed = torch.tensor([c for c in range(width) if c not in kept])
            if inputs is not None:
                accs = runner.collect(i, inputs, {name: module},
                                      lambda n: [Gram(), MeanVar()])[name]
                w_new, db = S.refit_consumer(w, accs[0].xtx, keep,
                                             accs[1].s1 if has_b else None, accs[0].tokens,
                                             damp=cfg.damp)
                done["least_squares"].append(f"{i}:{name}")
            else:
                w_new, db = w[:, keep], None
                if has_b and cfg.bias_compensation and stats and name in stats[i]:
                    db = S.flap_bias(w, removed, stats[i][name][1].mean())
                    done["bias"].append(f"{i}:{name}")
            do_slice()  # the adapter slices the consumer together with its producers
            _set_consumer(module, w_new, db)

    if cfg.compensate:
        runner.run(on_block=one, propagate="modified", desc="width compensation")
    else:
        for i in range(ad.num_blocks):
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


