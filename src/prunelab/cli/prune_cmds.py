"""The commands that write a pruned model (``prune depth|sparsity|width``) and the depth
sweep; one helper loads, prunes, saves and guards the output for every ``prune``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from prunelab import log
from prunelab.cli.apps import prune_app, sweep_app
from prunelab.cli.common import (
    BudgetOpt,
    CalibDtypeOpt,
    Calibration,
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
    budget_fields,
    calibration_options,
    check_positive,
    data_paths,
    parse_blocks,
    parse_list,
    settings_over,
    writing,
)
from prunelab.cli.generated import generated_command, values
from prunelab.cli.prune_tables import show_depth, show_sparsity, show_width
from prunelab.errors import ConfigError


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
    return cls(**settings_over(opts, settings, cls))


def prune_and_save(load: LoadArgs, cfg, out_dir: Path, overwrite: bool, *,
                   calib: Calibration, metrics: tuple[str, ...], show=None):
    """Guard ``out_dir``, load, prune with ``cfg`` on the ``calib`` windows, save the
    checkpoint with its manifest (the report, and ``metrics`` of it as the manifest's
    metrics), then ``show(lm, report)`` prints the family's table; returns ``(lm,
    report)``."""
    from prunelab import api

    check_positive("--batch-size", calib.batch_size)
    check_positive("--samples", calib.samples)
    if getattr(cfg, "gguf_only", False):
        raise ConfigError("--gguf-only makes models that only go to GGUF from memory (prunelab "
                          "front's slice points, or the Python API); prunelab prune saves a "
                          "checkpoint: drop --gguf-only")
    with writing(out_dir, "checkpoint", overwrite,
                 inputs={"--model": load.model, "--data": data_paths(calib.data)}):
        lm = load.load()
        if getattr(lm, "streamer", None) is not None:  # --stream: stage beside the output
            lm.streamer.work_dir = out_dir.parent
            lm.streamer.consume_staging = True  # staged blocks move into --out as it is saved
        rep = api.prune(lm, cfg, data=calib.data, seqlen=calib.seqlen, samples=calib.samples,
                        seed=calib.seed, batch_size=calib.batch_size)
        api.save(lm, out_dir, overwrite=overwrite, data=rep["data"],
                 before=rep["size_before"], metrics={k: rep[k] for k in metrics},
                 extra={"report": rep.to_dict()})
    if show is not None:
        show(lm, rep)
    if getattr(lm, "streamer", None) is not None:
        lm.streamer.close()  # the staged blocks are in the checkpoint now
    return lm, rep


@prune_app.command("depth", cls=generated_command("strategies", "recoveries"))
@calibration_options(seed=(0, "window sampling / random strategy seed"))
def prune_depth_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        calib: Calibration = None,
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        budget: Optional[str] = BudgetOpt("remove-blocks:N (blocks removed) | keep-params:F "
                                          "(parameters kept: a fraction <= 1 or a count)"),
        probe_name: str = typer.Option("block-influence", "--probe", help="probe that ranks "
                                       "blocks (run on the calibration data)"),
        from_probe: Optional[Path] = typer.Option(None, help="a saved DIR/NAME.json instead"),
        strategy: Optional[str] = typer.Option(None, help="{strategies} (default from the "
                                               "probe kind)"),
        recovery: str = typer.Option("none", help="{recoveries}"),
        blocks: Optional[str] = typer.Option(None, help="explicit 0-based blocks, e.g. 3,5"),
        sublayers: Optional[str] = typer.Option(
            None, help="explicit 0-based sub-blocks BLOCK:PART (attention or mlp), e.g. "
            "5:attention,16:mlp (as a report's removed_sublayers; implies --granularity "
            "sublayer)"),
        window: int = typer.Option(1, help="pair probes: |i - j| <= W"),
        granularity: Optional[str] = typer.Option(
            None, help="block (default), or sublayer: attention and MLP sub-blocks searched "
            "separately (--budget remove-blocks:N = N blocks' worth of parameters)"),
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
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt, stream: bool = StreamOpt,
        stack: Optional[str] = StackOpt, calib_dtype: str = CalibDtypeOpt):
    """Remove whole blocks chosen by a probe, repair the cut in closed form, save (the
    options of each --strategy and --recovery are listed under their own headings)."""
    from prunelab.pruning import depth_from_cli

    flat = values(ctx).flat()
    sleb_resume = flat.get("sleb_resume")
    if sleb_resume is not None and not sleb_resume.strip(" ,"):
        raise ConfigError("--sleb-resume is empty: give blocks (5,16) or sub-blocks "
                          "(5:attention,16:mlp)")
    from prunelab.pruning import Depth

    cfg = depth_from_cli(**budget_fields(Depth, budget, "prune depth"), probe=probe_name,
                         from_probe=str(from_probe) if from_probe else None,
                         strategy=strategy, recovery=recovery, blocks=parse_blocks(blocks),
                         window=window, sublayers=sublayers or (), granularity=granularity,
                         recovery_in_loop=recovery_in_loop or None,
                         recovery_holdout=recovery_holdout, bootstrap=bootstrap,
                         search_windows=search_windows, max_instability=max_instability,
                         seed=calib.seed, **flat)
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload, stream, stack=stack,
                    calib_dtype=calib_dtype)
    prune_and_save(load, cfg, out_dir, overwrite, calib=calib,
                   metrics=("calib_kl_before_recovery",
                            "calib_kl_after_recovery"),
                   show=lambda lm, rep: show_depth(lm, rep, model, out_dir, recovery))


@prune_app.command("sparsity",
                   cls=generated_command("sparsity_methods", "sparsity_allocations"))
@calibration_options(samples=64, seqlen=512)
def prune_sparsity_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        calib: Calibration = None,
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        method: str = typer.Option("wanda", help="{sparsity_methods}"),
        budget: Optional[str] = BudgetOpt("remove-weights:F (of the blocks' linear weights; "
                                          "default 0.5; none with --pattern N:M)"),
        allocation: str = typer.Option("uniform", help="{sparsity_allocations}"),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="KEY=VALUE: any option of the method's config (repeatable; "
            "e.g. --set percdamp=0.02, or the options of a method you registered)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt, stream: bool = StreamOpt,
        calib_dtype: str = CalibDtypeOpt):
    """Unstructured or N:M sparsity (Wanda, SparseGPT, ROSE, QK-Wanda, magnitude, ADMM,
    CACTUS, and registered methods; each --method's and --allocation's options are listed
    under their own headings)."""
    from prunelab.pruning.sparsity.config import ALLOCATIONS, sparsity_methods

    methods = sparsity_methods()
    if method not in methods:
        raise ConfigError(f"--method must be one of {', '.join(methods)}, got {method!r}")
    gen = values(ctx)
    alloc_cls = ALLOCATIONS.get(allocation)
    alloc_opts = gen.piece("sparsity_allocations", allocation, f"--allocation {allocation}")
    alloc = alloc_cls(**alloc_opts)
    opts = {"allocation": alloc, **gen.piece("sparsity_methods", method, f"--method {method}")}
    opts.update(budget_fields(methods[method], budget, f"prune sparsity --method {method}"))
    cfg = methods[method](**settings_over(opts, settings, methods[method]))
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload, stream, calib_dtype=calib_dtype)
    prune_and_save(load, cfg, out_dir, overwrite, calib=calib, metrics=("achieved_sparsity",),
                   show=lambda lm, rep: show_sparsity(lm, rep, model, out_dir, method))


@prune_app.command("width", cls=generated_command("width_scores", "width_allocations"))
@calibration_options()
def prune_width_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        calib: Calibration = None,
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        unit: str = typer.Option("ffn", help="heads | ffn | joint"),
        score: str = typer.Option("wanda-sp", help="{width_scores}"),
        budget: Optional[str] = BudgetOpt("remove-units:F (of the unit's parameters) | "
                                          "keep-params:F (of the model's: a fraction <= 1 or "
                                          "a count)"),
        allocation: str = typer.Option("uniform", help="{width_allocations}"),
        heads: str = typer.Option("groups", help="groups (KV groups; heads without GQA) | "
                                  "query (query heads inside every group)"),
        compensate: bool = typer.Option(False, "--compensate", help="least-squares refit of "
                                        "o_proj / down_proj, block by block"),
        no_bias_compensation: bool = typer.Option(False, "--no-bias-compensation",
                                                  help="no FLAP bias compensation"),
        round_to: int = typer.Option(8, help="FFN widths kept are multiples of this"),
        gguf_type: Optional[str] = typer.Option(
            None, help="the llama.cpp type the result will be quantized to (q8_0, q4_k_m, "
            "...): FFN widths rounded to its block (32 / 256) so no weight falls back"),
        damp: float = typer.Option(1.0, help="refit ridge (times mean diag of X^T X), "
                                   "shrinking towards plain slicing"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt, stream: bool = StreamOpt,
        stack: Optional[str] = StackOpt, calib_dtype: str = CalibDtypeOpt):
    """Structured width pruning: KV groups / heads / query heads and FFN channels removed
    physically (0-based blocks; each --score's and --allocation's options are listed under
    their own headings)."""
    from prunelab.pruning import Width, width_from_cli

    cfg = width_from_cli(**budget_fields(Width, budget, "prune width"), unit=unit, score=score,
                         allocation=allocation, heads=heads, compensate=compensate,
                         bias_compensation=not no_bias_compensation, round_to=round_to,
                         gguf_type=gguf_type, damp=damp, **values(ctx).flat())
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload, stream, stack=stack,
                    calib_dtype=calib_dtype)
    prune_and_save(load, cfg, out_dir, overwrite, calib=calib, metrics=("removed_params",),
                   show=lambda lm, rep: show_width(lm, rep, model, out_dir, unit, score,
                                                    allocation))


def ray_load_args(args: LoadArgs) -> dict:
    """How a Ray worker reloads the model (``api.load`` keyword arguments)."""
    from dataclasses import asdict

    d = asdict(args)
    return {"spec": d.pop("model"), **d}


@sweep_app.command("depth", cls=generated_command())
@calibration_options(seqlen=(256, "calibration window length"),
                     seed=(0, "window sampling / random baseline seed"))
def sweep_depth_cmd(
        model: str = ModelOpt,
        calib: Calibration = None,
        test: str = typer.Option("wiki-vital:test", help="test data spec"),
        probes: str = typer.Option("block-influence", help="comma-separated probes; "
                                   "last-n and random are baselines"),
        budget: str = BudgetOpt("remove-blocks:N..M or remove-blocks:N,M,... (the points of "
                                "the curve)", default="remove-blocks:1..4"),
        recovery: str = typer.Option("none,foldable", help="comma-separated: {recovery_names}"),
        out_dir: Path = typer.Option(..., "--out", help="output directory (resumable)"),
        strategy: Optional[str] = typer.Option(None, help="override the per-probe default"),
        window: int = typer.Option(1, help="pair probes: |i - j| <= W"),
        test_samples: int = typer.Option(16, help="test windows"),
        test_seqlen: int = typer.Option(512, help="test window length"),
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

    data, samples, seqlen, seed, batch_size = (calib.data, calib.samples, calib.seqlen,
                                               calib.seed, calib.batch_size)
    removes = parse_range(budget)
    if ray is None and (cpus_per_point != 1.0 or gpus_per_point != 0.0):
        raise ConfigError("--cpus-per-point and --gpus-per-point need --ray")
    from prunelab.workflow.ray_backend import check_resources

    check_resources(cpus_per_point, gpus_per_point)
    for name, value in (("--batch-size", batch_size), ("--samples", samples),
                        ("--test-samples", test_samples)):
        check_positive(name, value)
    with writing(out_dir, None, overwrite, on_interrupt=f"finished points are in "
                 f"{out_dir}/points.json; rerun the same command to resume",
                 inputs={"--model": model, "--data": data_paths(data, test)}):
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


