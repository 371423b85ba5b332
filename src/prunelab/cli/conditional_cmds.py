"""Conditional computation: ``prunelab prune gates`` (CausalGate static sublayer gates) and
``prunelab prune moe`` (PrunePath experts). Their method options are generated from the
configs registered as ``gates`` and ``prunepath`` (:mod:`prunelab.cli.generated`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab.cli.apps import prune_app
from prunelab.cli.common import (
    BudgetOpt,
    Calibration,
    DeviceOpt,
    DtypeOpt,
    LoadArgs,
    MissingOpt,
    ModelOpt,
    OffloadOpt,
    PickleOpt,
    RemoteOpt,
    budget_fields,
    calibration_options,
    out,
)
from prunelab.cli.generated import generated_command, values
from prunelab.cli.prune_cmds import build_config, prune_and_save


@prune_app.command("gates", cls=generated_command("gates"))
@calibration_options()
def prune_gates_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        calib: Calibration = None,
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        budget: Optional[str] = BudgetOpt(
            "remove-compute:F (of the sublayer compute, FLOPs per token of the attention "
            "projections and MLPs, skipped; default 0.2)"),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="KEY=VALUE: any option of the gates config (repeatable; "
            "e.g. seed, the bootstrap seed)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt):
    """CausalGate: gates fitted to the KL of zeroing each attention / MLP branch; the
    lowest are removed for real until the --budget of sublayer compute is skipped (the
    gates config's options are listed under their own heading)."""
    from prunelab.pruning import METHODS

    cls = METHODS.get("gates")
    cfg = build_config(cls, "prune gates", {}, settings,
                       **budget_fields(cls, budget, "prune gates"),
                       **values(ctx).piece("gates", "gates", "prune gates"))
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload)
    prune_and_save(load, cfg, out_dir, overwrite, calib=calib,
                   metrics=("achieved", "params_after", "flops_per_token_after"),
                   show=lambda lm, rep: _show_gates(lm, rep, model, out_dir))


def _show_gates(lm, rep, model: str, out_dir: Path) -> None:
    from prunelab.checkpoint.remote import load_hint

    t = Table(title=f"CausalGate sublayer removal of {model} (0-based blocks)",
              show_header=False)
    f0, f1 = rep["flops_per_token_before"], rep["flops_per_token_after"]
    subs = ", ".join(f"{i}:{'attn' if p == 'attention' else 'mlp'}"
                     for i, p in rep["removed_sublayers"]) or "-"
    rows = [("sublayer compute skipped", f"{rep['achieved']:.1%} (asked {rep['budget']:.1%})"),
            ("removed sublayers", subs),
            ("deleted blocks (both branches gone)", str(rep["deleted_blocks"])),
            ("parameters", f"{rep['params_before']:,} -> {rep['params_after']:,}"),
            ("FLOPs per token (linear maps)", f"{f0:,} -> {f1:,} ({f1 / max(f0, 1):.1%})"),
            ("seconds", f"{rep['seconds']:.1f}"),
            ("checkpoint", str(out_dir))]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    out.print("loads with: " + (load_hint(lm.model) if rep["needs_remote_code"]
                                else "plain transformers (no remote code)"))


@prune_app.command("moe", cls=generated_command("moe"))
@calibration_options(samples=64, seqlen=512)
def prune_moe_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        calib: Calibration = None,
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        budget: Optional[str] = BudgetOpt(
            "keep-mass:F (routing mass each token's experts must reach; default 0.9; a "
            "runtime knob of the checkpoint, 1 = dense)"),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="KEY=VALUE: any option of the prunepath config (repeatable; "
            "e.g. seed, of the clustering and the router fit)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt):
    """PrunePath: split every gated FFN into experts with a cumulative-mass router; each
    token computes only the fewest experts whose routing mass reaches the --budget
    keep-mass:F (the prunepath
    config's options are listed under their own heading)."""
    from prunelab.pruning import METHODS

    cls = METHODS.get("prunepath")
    cfg = build_config(cls, "prune moe", {}, settings,
                       **budget_fields(cls, budget, "prune moe"),
                       **values(ctx).piece("moe", "prunepath", "prune moe"))
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload)
    prune_and_save(load, cfg, out_dir, overwrite, calib=calib,
                   metrics=("calib_experts_per_token", "calib_ffn_flops_ratio",
                            "params_after"),
                   show=lambda lm, rep: _show_moe(lm, rep, model, out_dir, cfg))


def _show_moe(lm, rep, model: str, out_dir: Path, cfg) -> None:
    from prunelab.checkpoint.remote import load_hint

    t = Table(title=f"PrunePath experts of {model}", show_header=False)
    rows = [("experts per FFN", str(cfg.experts)),
            ("clustering / router", f"{cfg.clustering} / {cfg.router}"),
            ("routing mass", f"{cfg.mass}"),
            ("experts per token (calibration)", f"{rep['calib_experts_per_token']:.2f}"),
            ("FFN FLOPs vs dense (calibration)", f"{rep['calib_ffn_flops_ratio']:.1%}"),
            ("seconds", f"{rep['seconds']:.1f}"),
            ("checkpoint", str(out_dir))]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    out.print("loads with: " + load_hint(lm.model) + "; set the mass at load with "
              "prunelab_moe_mass=P or `prunelab eval --budget keep-mass:P`")
