"""The commands that write a pruned model (``prune depth|sparsity|width``) and the depth
sweep; one helper loads, prunes, saves and guards the output for every ``prune``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab import log
from prunelab.cli.apps import prune_app, sweep_app
from prunelab.cli.common import (
    BatchOpt,
    CpusOpt,
    DeviceOpt,
    DtypeOpt,
    GpusOpt,
    LoadArgs,
    MissingOpt,
    ModelOpt,
    OffloadOpt,
    PickleOpt,
    RayOpt,
    RemoteOpt,
    StackOpt,
    StreamOpt,
    check_positive,
    fmt_bytes,
    out,
    parse_blocks,
    parse_list,
    parse_settings,
    writing,
)
from prunelab.errors import ConfigError


def _choices(kind: str, describe: bool = True) -> str:
    """The registered names of ``kind`` with their one-line descriptions (width scores
    grouped by the units they rank), for a command's --help."""
    from prunelab.pruning import RECOVERIES, STRATEGIES, WIDTH_ALLOCATIONS, WIDTH_SCORES

    reg = {"strategies": STRATEGIES, "recoveries": RECOVERIES, "width scores": WIDTH_SCORES,
           "width allocations": WIDTH_ALLOCATIONS}[kind]

    def one(name: str) -> str:
        doc = (reg.get(name).__doc__ or "").strip().splitlines()
        return f"{name} ({doc[0].rstrip('.')})" if describe and doc else name

    if kind != "width scores":
        return " | ".join(one(n) for n in reg.names())
    groups = [f"{u}: " + " | ".join(n for n in reg.names() if u in reg.get(n).units)
              for u in ("heads", "ffn", "joint")]
    return "; ".join(groups)


def _registry_help(kind: str) -> str:
    """``name | name | ...`` of the registered sparsity methods or allocations (the list a
    command accepts is read again at run time, so methods registered later work too)."""
    from prunelab.pruning.sparsity.config import ALLOCATIONS, sparsity_methods

    names = list(sparsity_methods()) if kind == "sparsity" else ALLOCATIONS.names()
    return " | ".join(names)


def build_config(cls: type, label: str, flat: dict, settings: list[str] | None = None,
                 **fixed):
    """``cls(**options)`` from the flags given (``flat``: field -> (flag, value); ``None``
    means not given, so the class default holds) and ``--set`` items; a flag given for a
    field ``cls`` does not have is an error naming it, never ignored."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls)}
    opts = dict(fixed)
    for name, (flag, value) in flat.items():
        if value is None:
            continue
        if name not in fields:
            raise ConfigError(f"{flag} does not apply to {label}")
        opts[name] = value
    opts.update(parse_settings(settings, cls))
    return cls(**opts)


def prune_and_save(load: LoadArgs, cfg, out_dir: Path, overwrite: bool, *, data: str,
                   seqlen: int, samples: int, seed: int, batch_size: int,
                   metrics: tuple[str, ...], show=None):
    """Guard ``out_dir``, load, prune with ``cfg``, save the checkpoint with its manifest
    (the report, and ``metrics`` of it as the manifest's metrics), then ``show(lm,
    report)`` prints the family's table; returns ``(lm, report)``."""
    from prunelab import api

    check_positive("--batch-size", batch_size)
    check_positive("--samples", samples)
    with writing(out_dir, "checkpoint", overwrite):
        lm = load.load()
        if getattr(lm, "streamer", None) is not None:  # --stream: stage beside the output
            lm.streamer.work_dir = out_dir.parent
        rep = api.prune(lm, cfg, data=data, seqlen=seqlen, samples=samples, seed=seed,
                        batch_size=batch_size)
        api.save(lm, out_dir, overwrite=overwrite, data=rep["data"],
                 before=rep["size_before"], metrics={k: rep[k] for k in metrics},
                 extra={"report": rep.to_dict()})
    if show is not None:
        show(lm, rep)
    if getattr(lm, "streamer", None) is not None:
        lm.streamer.close()  # the staged blocks are in the checkpoint now
    return lm, rep


@prune_app.command("depth")
def prune_depth_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        remove: Optional[int] = typer.Option(None, help="number of blocks to remove"),
        target_params: Optional[float] = typer.Option(None, help="parameters to keep: a "
                                                      "fraction (<= 1) or a count"),
        probe_name: str = typer.Option("block-influence", "--probe", help="probe that ranks "
                                       "blocks (run on the calibration data)"),
        from_probe: Optional[Path] = typer.Option(None, help="a saved DIR/NAME.json instead"),
        strategy: Optional[str] = typer.Option(None, help=_choices("strategies") + " (default "
                                               "from the probe kind)"),
        recovery: str = typer.Option("none", help=_choices("recoveries")),
        rank: Optional[int] = typer.Option(None, help="lra: rank of the adapter"),
        token_aware: bool = typer.Option(False, "--token-aware", help="ghost/lra: separate "
                                         "map for the first position"),
        blocks: Optional[str] = typer.Option(None, help="explicit 0-based blocks, e.g. 3,5"),
        sublayers: Optional[str] = typer.Option(
            None, help="explicit 0-based sub-blocks BLOCK:PART (attention or mlp), e.g. "
            "5:attention,16:mlp (as a report's removed_sublayers; implies --granularity "
            "sublayer)"),
        window: int = typer.Option(1, help="pair probes: |i - j| <= W"),
        blend_probe: Optional[str] = typer.Option(None, help="blend: the second probe "
                                                  "(default contraction)"),
        beam_width: Optional[int] = typer.Option(None, help="beam: width (default 3)"),
        beam_seeds: Optional[int] = typer.Option(None, help="beam: candidate blocks "
                                                 "(default 12)"),
        beam_score: Optional[str] = typer.Option(None, help="beam: kl or perplexity "
                                                 "(default kl)"),
        sleb_score: Optional[str] = typer.Option(None, help="sleb: nll or kl (default nll)"),
        sleb_resume: Optional[str] = typer.Option(
            None, help="sleb: continue a greedy search from these removed blocks (5,16) or "
            "sub-blocks (5:attention,16:mlp), e.g. the steps of an interrupted or smaller "
            "run (not with --recovery-in-loop)"),
        val_metric: Optional[str] = typer.Option(
            None, help="validation: task metric (embed-cos, knn-agree, lfw-acc, wer, "
            "perplexity; default auto: embed-cos for vision, perplexity for text)"),
        val_width: Optional[int] = typer.Option(None, help="validation: beam width "
                                                "(default 1: greedy)"),
        val_options: Optional[str] = typer.Option(None, help="validation: metric options "
                                                  "KEY=VALUE,..."),
        protect_ends: bool = typer.Option(False, "--protect-ends", help="sleb: never remove "
                                          "the first or the last block"),
        granularity: Optional[str] = typer.Option(
            None, help="block (default), or sublayer: attention and MLP sub-blocks searched "
            "separately (--remove N = N blocks' worth of parameters)"),
        recovery_in_loop: bool = typer.Option(
            False, "--recovery-in-loop", help="beam / sleb / iterative / validation: score "
            "each candidate after its closed-form recovery"),
        recovery_holdout: Optional[float] = typer.Option(
            None, help="--recovery-in-loop with sleb / beam: share of the calibration "
            "batches held out to score each candidate's fit (default 0.25; 0: fit and score "
            "on all)"),
        search_windows: Optional[int] = typer.Option(
            None, help="sleb / beam / iterative: score the candidates on the first N "
            "calibration windows only (default: all); the recovery fits on all"),
        bootstrap: Optional[int] = typer.Option(
            None, help="resamples of the windows re-deriving the removal set (default 200; "
            "0: off)"),
        max_instability: Optional[float] = typer.Option(
            None, help="warn when more than this share of the resamples gives another "
            "removal set (default 0.5)"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="window length in tokens"),
        seed: int = typer.Option(0, help="window sampling / random strategy seed"),
        batch_size: int = BatchOpt,
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt, stream: bool = StreamOpt,
        stack: Optional[str] = StackOpt):
    """Remove whole blocks chosen by a probe, repair the cut in closed form, save."""
    from prunelab.pruning import depth_from_cli

    if sleb_resume is not None and not sleb_resume.strip(" ,"):
        raise ConfigError("--sleb-resume is empty: give blocks (5,16) or sub-blocks "
                          "(5:attention,16:mlp)")
    cfg = depth_from_cli(remove=remove, target_params=target_params, probe=probe_name,
                         from_probe=str(from_probe) if from_probe else None,
                         strategy=strategy, recovery=recovery, rank=rank,
                         token_aware=token_aware, blocks=parse_blocks(blocks), window=window,
                         sublayers=sublayers or (),
                         blend_probe=blend_probe, beam_width=beam_width,
                         beam_seeds=beam_seeds, beam_score=beam_score,
                         sleb_score=sleb_score, sleb_resume=sleb_resume,
                         protect_ends=protect_ends,
                         val_metric=val_metric, val_width=val_width, val_options=val_options,
                         granularity=granularity, recovery_in_loop=recovery_in_loop or None,
                         recovery_holdout=recovery_holdout, bootstrap=bootstrap,
                         search_windows=search_windows,
                         max_instability=max_instability, seed=seed)
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload, stream, stack=stack)
    prune_and_save(load, cfg, out_dir, overwrite, data=data, seqlen=seqlen,
                   samples=samples, seed=seed, batch_size=batch_size,
                   metrics=("calib_kl_before_recovery",
                            "calib_kl_after_recovery"),
                   show=lambda lm, rep: _show_depth(lm, rep, model, out_dir, recovery))


@prune_app.command("sparsity")
def prune_sparsity_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        method: str = typer.Option("wanda", help=_registry_help("sparsity")),
        sparsity: Optional[float] = typer.Option(None, help="unstructured target (mean over "
                                                 "layers; default 0.5)"),
        pattern: Optional[str] = typer.Option(None, help="N:M pattern, e.g. 2:4 (instead of "
                                              "--sparsity)"),
        allocation: str = typer.Option("uniform", help=_registry_help("allocation")),
        owl_m: Optional[float] = typer.Option(None, help="owl: outlier threshold M "
                                              "(default 5)"),
        owl_lambda: Optional[float] = typer.Option(None, help="owl: lambda (default 0.08)"),
        pals_delta: Optional[float] = typer.Option(None, help="pals: delta (default 0.05)"),
        ramp_span: Optional[float] = typer.Option(None, help="ramp: +- span around the "
                                                  "target (default 0.1)"),
        taper_slope: Optional[float] = typer.Option(
            None, help="taper (sparsity / width allocation): kept density (width) of the "
            "first block minus the last's (default 0.2)"),
        ramp_down: bool = typer.Option(False, "--ramp-down", help="ramp: sparsity falls "
                                       "with depth"),
        group: Optional[str] = typer.Option(None, help="unstructured comparison group: row "
                                            "(default) or layer"),
        targets: Optional[str] = typer.Option(None, help="glob patterns of linears to prune"),
        ignore: Optional[str] = typer.Option(None, help="glob patterns of linears to keep"),
        propagate: Optional[str] = typer.Option(
            None, help="modified or dense block outputs passed on (default: the method's; "
            "dense for wanda, modified otherwise)"),
        within_block: Optional[str] = typer.Option(
            None, help="sequential (each sublayer group calibrated after the earlier ones "
            "were pruned) or dense (the whole block calibrated dense); default: the "
            "method's (dense for wanda, sequential otherwise)"),
        scope: Optional[str] = typer.Option(None, help="qk-wanda: qk (default) or block"),
        qk_variant: Optional[str] = typer.Option(None, help="qk-wanda: unmasked (default: "
                                                 "every query-key pair) or causal (pairs "
                                                 "the mask keeps)"),
        no_reorder: bool = typer.Option(False, "--no-reorder", help="rose: no reordering"),
        hessian_alpha: Optional[float] = typer.Option(None, help="sparsegpt/rose: Taylor "
                                                      "blend (MOONSHOT; default 0)"),
        mask_from: Optional[str] = typer.Option(None, help="admm/cactus: mask from wanda "
                                                "(default), sparsegpt or magnitude"),
        gradual: bool = typer.Option(False, "--gradual", help="admm/cactus: choose the mask "
                                     "inside the ADMM iterations (cubic schedule)"),
        iterations: Optional[int] = typer.Option(None, help="admm/cactus: ADMM iterations "
                                                 "(default 20)"),
        rank: Optional[int] = typer.Option(None, help="cactus: rank of the low-rank term L "
                                           "(sparse + low-rank; checkpoint needs remote code)"),
        fold_lowrank: bool = typer.Option(False, "--fold-lowrank", help="cactus: fold L into "
                                          "S (a plain dense checkpoint, for quality "
                                          "comparison only: it saves nothing)"),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="KEY=VALUE: any option of the method's config (repeatable; "
            "e.g. --set percdamp=0.02, or the options of a method you registered)"),
        samples: int = typer.Option(64, help="calibration windows"),
        seqlen: int = typer.Option(512, help="window length in tokens"),
        seed: int = typer.Option(0, help="window sampling seed"),
        batch_size: int = BatchOpt,
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt, stream: bool = StreamOpt):
    """Unstructured or N:M sparsity (Wanda, SparseGPT, ROSE, QK-Wanda, magnitude, ADMM,
    CACTUS)."""
    from prunelab.pruning.sparsity.config import ALLOCATIONS, sparsity_methods

    methods = sparsity_methods()
    if method not in methods:
        raise ConfigError(f"--method must be one of {', '.join(methods)}, got {method!r}")
    cls = methods[method]
    alloc_cls = ALLOCATIONS.get(allocation)
    alloc = build_config(alloc_cls, f"--allocation {allocation}", {
        "m": ("--owl-m", owl_m), "lam": ("--owl-lambda", owl_lambda),
        "delta": ("--pals-delta", pals_delta), "span": ("--ramp-span", ramp_span),
        "increasing": ("--ramp-down", False if ramp_down else None),
        "slope": ("--taper-slope", taper_slope)})
    flat = {"sparsity": ("--sparsity", sparsity), "pattern": ("--pattern", pattern),
            "group": ("--group", group), "targets": ("--targets", parse_list(targets) or None),
            "ignore": ("--ignore", parse_list(ignore) or None),
            "propagate": ("--propagate", propagate),
            "within_block": ("--within-block", within_block),
            "scope": ("--scope", scope), "variant": ("--qk-variant", qk_variant),
            "reorder": ("--no-reorder", False if no_reorder else None),
            "hessian_alpha": ("--hessian-alpha", hessian_alpha),
            "mask_from": ("--mask-from", mask_from),
            "gradual": ("--gradual", True if gradual else None),
            "iterations": ("--iterations", iterations), "rank": ("--rank", rank),
            "fold_lowrank": ("--fold-lowrank", True if fold_lowrank else None)}
    cfg = build_config(cls, f"--method {method}", flat, settings, allocation=alloc)
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload, stream)
    prune_and_save(load, cfg, out_dir, overwrite, data=data, seqlen=seqlen,
                   samples=samples, seed=seed, batch_size=batch_size,
                   metrics=("achieved_sparsity",),
                   show=lambda lm, rep: _show_sparsity(lm, rep, model, out_dir, method))


@prune_app.command("width")
def prune_width_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        unit: str = typer.Option("ffn", help="heads | ffn | joint"),
        score: str = typer.Option("wanda-sp", help=_choices("width scores")),
        ratio: Optional[float] = typer.Option(None, help="fraction of the unit's parameters "
                                              "removed"),
        target_params: Optional[float] = typer.Option(None, help="parameters the model keeps: "
                                                      "a fraction (<= 1) or a count"),
        allocation: str = typer.Option("uniform", help=_choices("width allocations")),
        heads: str = typer.Option("groups", help="groups (KV groups; heads without GQA) | "
                                  "query (query heads inside every group)"),
        compensate: bool = typer.Option(False, "--compensate", help="least-squares refit of "
                                        "o_proj / down_proj, block by block"),
        no_bias_compensation: bool = typer.Option(False, "--no-bias-compensation",
                                                  help="no FLAP bias compensation"),
        round_to: int = typer.Option(8, help="FFN widths kept are multiples of this"),
        damp: float = typer.Option(1.0, help="refit ridge (times mean diag of X^T X), "
                                   "shrinking towards plain slicing"),
        ablation_samples: Optional[int] = typer.Option(None, help="windows for ablation-kl "
                                                       "/ cocurve (default 4)"),
        channel_group: Optional[int] = typer.Option(None, help="FFN channels per ablation / "
                                                    "cocurve unit (default 64)"),
        rep_lie_steps: Optional[int] = typer.Option(None, help="rep-lie: LoRA fine-tune "
                                                    "steps (default 20)"),
        rep_lie_lr: Optional[float] = typer.Option(None, help="rep-lie: learning rate "
                                                   "(default 2e-4)"),
        lora_rank: Optional[int] = typer.Option(None, help="rep-lie: LoRA rank (default 8)"),
        rep_lie_seed: Optional[int] = typer.Option(None, help="rep-lie: seed (default 0)"),
        elastic_ranking: Optional[str] = typer.Option(
            None, help="elastic: an elastic.json (default: the model's own, or fit one)"),
        elastic_steps: Optional[int] = typer.Option(None, help="elastic: fit steps when no "
                                                    "ranking is found (default 200)"),
        taper_slope: Optional[float] = typer.Option(
            None, help="--allocation taper: kept fraction of the first block minus the "
            "last's (default 0.2)"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="window length in tokens"),
        seed: int = typer.Option(0, help="window sampling seed"),
        batch_size: int = BatchOpt,
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt, stream: bool = StreamOpt,
        stack: Optional[str] = StackOpt):
    """Structured width pruning: KV groups / heads / query heads and FFN channels removed
    physically (0-based blocks)."""
    from prunelab.pruning import width_from_cli

    cfg = width_from_cli(unit=unit, score=score, ratio=ratio, target_params=target_params,
                         allocation=allocation, heads=heads, compensate=compensate,
                         bias_compensation=not no_bias_compensation, round_to=round_to,
                         damp=damp, ablation_samples=ablation_samples,
                         channel_group=channel_group, rep_lie_steps=rep_lie_steps,
                         rep_lie_lr=rep_lie_lr, lora_rank=lora_rank, rep_lie_seed=rep_lie_seed,
                         elastic_ranking=elastic_ranking, elastic_steps=elastic_steps,
                         taper_slope=taper_slope)
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload, stream, stack=stack)
    prune_and_save(load, cfg, out_dir, overwrite, data=data, seqlen=seqlen,
                   samples=samples, seed=seed, batch_size=batch_size,
                   metrics=("removed_params",),
                   show=lambda lm, rep: _show_width(lm, rep, model, out_dir, unit, score,
                                                    allocation))


def _show_depth(lm, rep, model: str, out_dir: Path, recovery: str) -> None:
    """Print what depth pruning did (0-based blocks)."""
    t = Table(title=f"depth pruning of {model}", show_header=False)
    div = "1 - cos (pooled)" if lm.is_encoder else "KL"
    b, a = rep["size_before"], rep["size_after"]
    hidden = {"beam", "selection_stability", "steps", "repaired_cuts", "repair_spans",
              "layer_values"}
    rows = [("removed blocks (0-based, original numbering)", str(rep["removed_blocks"])),
            ("blocks", f"{rep['num_blocks_before']} -> {rep['num_blocks_after']}"),
            ("selection", ", ".join(f"{k}={v}" for k, v in rep["selection"].items()
                                    if v is not None and k not in hidden))]
    if rep.get("removed_sublayers"):
        rows.append(("removed sub-blocks (0-based, original numbering)",
                     ", ".join(f"{i}:{'attn' if p == 'attention' else 'mlp'}"
                               for i, p in rep["removed_sublayers"])))
    stab = rep["selection"].get("selection_stability")
    if stab:
        rows.append(("selection stability", f"{stab['share_same']:.0%} of "
                     f"{stab.get('resamples', stab.get('bootstrap', '?'))} resamples give "
                     "the same blocks"))
    rows += [
            ("recovery", rep["recovery"]),
            ("parameters", f"{b['params']:,} -> {a['params']:,} "
                           f"({a['params'] / b['params']:.1%})"),
            ("bytes", f"{fmt_bytes(b['bytes'])} -> {fmt_bytes(a['bytes'])}"),
            (f"calibration {div} before recovery", f"{rep['calib_kl_before_recovery']:.5f}"),
            (f"calibration {div} after recovery", f"{rep['calib_kl_after_recovery']:.5f}"),
            ("checkpoint", str(out_dir))]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    if rep["needs_remote_code"]:
        from prunelab.checkpoint.remote import load_hint

        why = ("blocks that kept one branch" if rep.get("partial_blocks")
               else f"{recovery} adds linear bridges")
        out.print(f"note: {why}: load the checkpoint with {load_hint(lm.model)}")


def _show_sparsity(lm, rep, model: str, out_dir: Path, method: str) -> None:
    """Print what sparsity pruning did (0-based blocks)."""
    t = Table(title=f"{method} sparsity of {model} (blocks 0-based)")
    for col in ("block", "target", "achieved (mean over linears)"):
        t.add_column(col)
    for layer in rep["layers"]:
        vals = list(layer["linears"].values())
        t.add_row(str(layer["block"]), f"{layer['target']:.4f}",
                  f"{sum(vals) / max(len(vals), 1):.4f}")
    out.print(t)
    out.print(f"achieved sparsity over pruned linears: {rep['achieved_sparsity']:.4f}; "
              f"{rep['seconds']:.1f} s; checkpoint {out_dir} (plain transformers)")


def _show_width(lm, rep, model: str, out_dir: Path, unit: str, score: str, allocation: str) -> None:
    """Print what width pruning did (0-based blocks)."""
    t = Table(title=f"width pruning of {model}: {unit} by {score}, {allocation} "
                    "(blocks 0-based)")
    for col in ("block", "heads (q/kv)", "ffn", "removed"):
        t.add_column(col, overflow="fold")
    for b in rep["blocks"]:
        gone = []
        if b.get("removed_groups"):
            gone.append("groups " + ",".join(map(str, b["removed_groups"])))
        if "kept_query_heads" in b:
            gone.append("kept q heads " + str(b["kept_query_heads"]))
        if b.get("removed_channels") is not None:
            gone.append(f"{len(b['removed_channels'])} channels")
        t.add_row(str(b["block"]), f"{b['heads_before']}/{b['kv_heads_before']} -> "
                  f"{b['heads_after']}/{b['kv_heads_after']}",
                  f"{b['ffn_before']} -> {b['ffn_after']}", "; ".join(gone) or "-")
    out.print(t)
    bf, af = rep["size_before"], rep["size_after"]
    out.print(f"parameters {bf['params']:,} -> {af['params']:,} "
              f"({af['params'] / bf['params']:.1%}); bytes {fmt_bytes(bf['bytes'])} -> "
              f"{fmt_bytes(af['bytes'])}; compensation: "
              f"{len(rep['compensation']['least_squares'])} least-squares refits, "
              f"{len(rep['compensation']['bias'])} bias updates; {rep['seconds']:.1f} s")
    if rep["needs_remote_code"]:
        from prunelab.checkpoint.remote import load_hint

        out.print(f"note: per-block widths ({'; '.join(rep['vanilla_problems'])}): load "
                  f"{out_dir} with {load_hint(lm.model)}")
    else:
        out.print(f"checkpoint {out_dir} (plain transformers)")


def ray_load_args(args: LoadArgs) -> dict:
    """How a Ray worker reloads the model (``api.load`` keyword arguments)."""
    from dataclasses import asdict

    d = asdict(args)
    return {"spec": d.pop("model"), **d}


@sweep_app.command("depth")
def sweep_depth_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        test: str = typer.Option("wiki-vital:test", help="test data spec"),
        probes: str = typer.Option("block-influence", help="comma-separated probes; "
                                   "last-n and random are baselines"),
        remove: str = typer.Option("1..4", help="N..M or a list N,M,..."),
        recovery: str = typer.Option("none,foldable", help="comma-separated: " +
                                     _choices("recoveries", describe=False)),
        out_dir: Path = typer.Option(..., "--out", help="output directory (resumable)"),
        strategy: Optional[str] = typer.Option(None, help="override the per-probe default"),
        window: int = typer.Option(1, help="pair probes: |i - j| <= W"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="calibration window length"),
        test_samples: int = typer.Option(16, help="test windows"),
        test_seqlen: int = typer.Option(512, help="test window length"),
        seed: int = typer.Option(0, help="window sampling / random baseline seed"),
        batch_size: int = BatchOpt,
        overwrite: bool = typer.Option(False, help="replace a sweep made with other settings, "
                                       "or files prunelab did not write"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt, ray: Optional[str] = RayOpt,
        cpus_per_point: float = CpusOpt, gpus_per_point: float = GpusOpt):
    """Test perplexity and KL to dense against blocks removed, per probe x recovery."""
    from prunelab import api
    from prunelab.report.folder import record_command
    from prunelab.workflow.sweep import parse_range, sweep_depth

    removes = parse_range(remove)
    if ray is None and (cpus_per_point != 1.0 or gpus_per_point != 0.0):
        raise ConfigError("--cpus-per-point and --gpus-per-point need --ray")
    from prunelab.workflow.ray_backend import check_resources

    check_resources(cpus_per_point, gpus_per_point)
    for name, value in (("--batch-size", batch_size), ("--samples", samples),
                        ("--test-samples", test_samples)):
        check_positive(name, value)
    with writing(out_dir, None, overwrite, on_interrupt=f"finished points are in "
                 f"{out_dir}/points.json; rerun the same command to resume"):
        load_args = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                             allow_missing_weights, offload)
        lm = load_args.load()
        calib = api.tokens_for(lm, data, seqlen=seqlen, samples=samples, seed=seed,
                               mode="calib")
        test_b = api.tokens_for(lm, test, seqlen=test_seqlen, samples=test_samples,
                                mode="test")
        points = sweep_depth(lm, list(parse_list(probes)), removes,
                             list(parse_list(recovery)), calib.input_ids, test_b.input_ids,
                             out_dir, batch_size=batch_size, window=window, seed=seed,
                             strategy=strategy, data_info=calib.to_dict(),
                             test_info=test_b.to_dict(), overwrite=overwrite, ray=ray,
                             load=ray_load_args(load_args), cpus_per_point=cpus_per_point,
                             gpus_per_point=gpus_per_point)
        record_command(out_dir)
    print((out_dir / "curve.md").read_text())
    log.info(f"wrote {out_dir}/ (curve.png, curve.csv, curve.md, points.json); "
             f"{len(points)} points")


