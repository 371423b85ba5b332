"""``prunelab prune tokens``: TAP-Path patch-token pruning of a vision encoder, scored
against its dense forward; the JSON records the setting and its measured effect. Token
pruning changes no weight: with ``--out`` the checkpoint carries a weightless
``TokenPruner`` module per pruning block (generated modeling file; reload with
``AutoModel.from_pretrained(DIR, trust_remote_code=True)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab.cli.apps import prune_app
from prunelab.cli.common import (
    BudgetOpt,
    DeviceOpt,
    DtypeOpt,
    LoadArgs,
    ModelOpt,
    budget_fields,
    out,
    writing,
)
from prunelab.cli.generated import generated_command


def _ints(text: Optional[str]) -> tuple[int, ...]:
    from prunelab.errors import ConfigError

    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"expected comma-separated 0-based blocks, got {text!r}") from exc


@prune_app.command("tokens", cls=generated_command())
def prune_tokens_cmd(
        model: str = ModelOpt,
        budget: Optional[str] = BudgetOpt("keep-tokens:F (share of the patch tokens kept at "
                                          "each layer; default 0.7)"),
        layers: str = typer.Option("3", help="0-based blocks before which tokens are pruned"),
        fuse: bool = typer.Option(True, "--fuse/--drop", help="fuse the dropped tokens "
                                  "into one (EViT) or drop them"),
        depths: Optional[str] = typer.Option(None, help="0-based blocks whose features the "
                                             "gated LFW head combines, e.g. 7,9,11"),
        samples: int = typer.Option(32, help="test photos"),
        size: int = typer.Option(224, help="photo size in pixels"),
        lfw_size: int = typer.Option(112, help="LFW crop size in pixels"),
        batch_size: int = typer.Option(8, help="images per forward"),
        json_path: Optional[Path] = typer.Option(None, "--json", help="write results"),
        out_dir: Optional[Path] = typer.Option(None, "--out", help="also write a checkpoint "
                                               "that prunes tokens itself (remote code)"),
        overwrite: bool = typer.Option(False, help="replace an existing --json / --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt):
    """Prune patch tokens by CLS attention (vision encoders) and report embedding fidelity,
    LFW accuracy, tokens per block and images/s against the dense forward."""
    from prunelab.io.files import check_output_path, write_json
    from prunelab.pruning.tokens import TokenPruning, evaluate_token_pruning

    cfg = TokenPruning(**budget_fields(TokenPruning, budget, "prune tokens"),
                       layers=_ints(layers), fuse=fuse)
    inputs = {"--model": model}
    if out_dir is not None and json_path is not None:
        check_output_path(json_path, kind="file", overwrite=overwrite, inputs=inputs)
        check_output_path(json_path, inputs={"--out": out_dir})
    guard = writing(out_dir, "checkpoint", overwrite, inputs=inputs) if out_dir is not None \
        else writing(json_path, "file", overwrite, inputs=inputs)
    with guard:
        lm = LoadArgs(model, dtype, device, False, False, False).load()
        res = evaluate_token_pruning(lm, cfg, _ints(depths), samples=samples, size=size,
                                     lfw_size=lfw_size, batch_size=batch_size)
        t = Table(title=f"token pruning of {model}: keep {cfg.keep:.0%} at "
                  f"{list(cfg.layers)}",
                  show_header=False)
        for k in ("cls_cosine", "mean_cosine", "knn_agreement", "lfw_accuracy",
                  "lfw_gated_accuracy", "token_share", "images_per_s", "dense_images_per_s",
                  "speedup"):
            if k in res:
                t.add_row(k.replace("_", " "), f"{res[k]:.4f}")
        t.add_row("tokens per block", str(res["tokens_per_block"]))
        out.print(t)
        if json_path is not None:
            write_json(json_path, res, overwrite=overwrite)
        if out_dir is not None:
            _save_token_pruned(lm, cfg, res, out_dir, overwrite)


def _save_token_pruned(lm, cfg, res: dict, out_dir: Path, overwrite: bool) -> None:
    """Install the token pruners through the one pruning verb and save the checkpoint."""
    from prunelab import api

    api.prune(lm, cfg)  # no calibration data: installs the modules, records the operation
    metrics = {k: res[k] for k in ("cls_cosine", "mean_cosine", "knn_agreement",
                                   "lfw_accuracy", "speedup") if k in res}
    api.save(lm, out_dir, overwrite=overwrite, data=res.get("data"), metrics=metrics)
    out.print(f"wrote {out_dir} (load with AutoModel.from_pretrained(path, "
              "trust_remote_code=True))")
