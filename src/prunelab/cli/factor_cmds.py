"""``prunelab prune factor``: residual-stream slicing, whitened low-rank factorization and
cross-layer shared dictionaries (one command; ``--method`` picks the registered method)."""

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
from prunelab.errors import ConfigError


@prune_app.command("factor", cls=generated_command("factor_methods"))
@calibration_options(samples=64, seqlen=512)
def prune_factor_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        calib: Calibration = None,
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        method: str = typer.Option("slicegpt", help="{factor_methods}"),
        budget: Optional[str] = BudgetOpt(
            "keep-params:F (of everything the checkpoint stores) | remove-hidden:F "
            "(slicegpt: of the hidden size) | remove-weights:F (svd-llm, basis-sharing, "
            "shared-dict: of the targeted linears' parameters)"),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="KEY=VALUE: any option of the method's config (repeatable)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt):
    """Factorization: slice the residual stream (SliceGPT, global rotation,
    sensitivity-aware), whitened low-rank (SVD-LLM) or shared dictionaries across layers
    (Basis Sharing, optimized pairing); each --method's options are listed under their own
    heading."""
    from prunelab.pruning.factor import factor_methods

    methods = factor_methods()
    if method not in methods:
        raise ConfigError(f"--method must be one of {', '.join(methods)}, got {method!r}")
    label = f"--method {method}"
    own = values(ctx).piece("factor_methods", method, label)
    own.update(budget_fields(methods[method], budget, f"prune factor {label}"))
    cfg = build_config(methods[method], label, {}, settings, **own)
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload)
    prune_and_save(load, cfg, out_dir, overwrite, calib=calib,
                   metrics=("kept_params", "params_after", "flops_per_token_after"),
                   show=lambda lm, rep: _show_factor(lm, rep, model, out_dir, method))


def _show_factor(lm, rep, model: str, out_dir: Path, method: str) -> None:
    """Print what the factorization did."""
    from prunelab.checkpoint.remote import load_hint

    t = Table(title=f"{method} factorization of {model}", show_header=False)
    f0, f1 = rep["flops_per_token_before"], rep["flops_per_token_after"]
    rows = [("parameters (as stored)", f"{rep['params_before']:,} -> {rep['params_after']:,} "
                                       f"({rep['kept_params']:.1%} kept)"),
            ("FLOPs per token (linear maps)", f"{f0:,} -> {f1:,} ({f1 / max(f0, 1):.1%})"),
            ("factorized modules", str(rep["factorized_modules"]))]
    if "d_kept" in rep:
        ws = rep.get("block_widths") or [rep["d_kept"]]
        kept = (f"{rep['d_kept']}" if len(set(ws)) == 1
                else f"per block {min(ws)}..{max(ws)} ({', '.join(map(str, ws))})")
        rows.append(("hidden size", f"{rep['d']} -> {kept}"))
    labels = {"rotation": "rotation", "basis": "basis", "path": "checkpoint path",
              "path_note": "note", "min_kept_energy": "least energy kept at a boundary",
              "removed_fraction": "share of the targeted linears' parameters removed",
              "truncation_loss": "whitened truncation loss"}
    for key, label in labels.items():
        if rep.get(key) not in (None, ""):
            value = rep[key]
            rows.append((label, f"{value:.4g}" if isinstance(value, float) else str(value)))
    rows.append(("seconds", f"{rep['seconds']:.1f}"))
    rows.append(("checkpoint", str(out_dir)))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    out.print("loads with: " + (load_hint(lm.model) if rep["needs_remote_code"]
                                else "plain transformers (no remote code)"))
