"""``prunelab run | recipe | compare``: recipes, recipes back from checkpoints, and
comparisons at a matched budget (:mod:`prunelab.workflow`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab import log
from prunelab.cli.apps import app
from prunelab.cli.common import (
    CpusOpt,
    DeviceOpt,
    GpusOpt,
    RayOpt,
    check_positive,
    data_paths,
    given_budget,
    out,
    parse_list,
    writing,
)
from prunelab.cli.generated import generated_command
from prunelab.errors import ConfigError


@app.command("run", cls=generated_command())
def run_cmd(
        recipe: Path = typer.Argument(..., help="recipe YAML (see docs/workflow.md)"),
        out_dir: Path = typer.Option(..., "--out", help="run folder (a rerun resumes it)"),
        overwrite: bool = typer.Option(False, help="discard a previous run in --out"),
        check: bool = typer.Option(False, "--check", help="only parse and check the recipe"),
        ray: Optional[str] = RayOpt, cpus_per_point: float = CpusOpt,
        gpus_per_point: float = GpusOpt):
    """Run a recipe: probes, pruning, healing, evaluation, checkpoints and the report. A
    finished stage whose inputs and options are unchanged is not redone. With --ray each
    stage is a Ray task that starts when the stages it reads are done."""
    from prunelab.workflow.recipe import load_recipe
    from prunelab.workflow.run import check_runnable, prepare_out, run_recipe

    _check_ray_flags(ray, cpus_per_point, gpus_per_point)
    rec = load_recipe(recipe)
    check_runnable(rec, out_dir)
    if check:
        out.print(f"{recipe}: {len(rec.stages)} stages, valid")
        return
    with writing(out_dir, None, overwrite,
                 on_interrupt=f"finished stages are kept in {out_dir}; rerun to resume",
                 inputs={"the recipe": recipe, "the recipe's model": getattr(rec, "model", None)}):
        prepare_out(out_dir, overwrite)
        man = run_recipe(rec, out_dir, overwrite=False, ray=ray, checked=True,
                         cpus_per_point=cpus_per_point, gpus_per_point=gpus_per_point)
    t = Table(title=f"run {recipe}")
    for col in ("stage", "kind", "from", "status", "seconds"):
        t.add_column(col)
    for s in man["stages"]:
        t.add_row(s["id"], s["kind"], s["from"], s["status"], f"{s['seconds']:.1f}")
    out.print(t)
    report = next((r.get("report") or r.get("leaderboard") for r in man["results"].values()
                   if r.get("kind") == "report"), None)
    out.print(f"run folder: {out_dir}" + (f"; report: {report}" if report else ""))


def _check_ray_flags(ray: str | None, cpus: float, gpus: float) -> None:
    if ray is None and (cpus != 1.0 or gpus != 0.0):
        raise ConfigError("--cpus-per-point and --gpus-per-point need --ray")
    from prunelab.workflow.ray_backend import check_resources

    check_resources(cpus, gpus)


@app.command("recipe", cls=generated_command())
def recipe_cmd(
        source: Path = typer.Option(..., "--from", help="a checkpoint folder with "
                                    "manifest.json"),
        out_file: Optional[Path] = typer.Option(None, "--out", help="write the YAML here "
                                                "(default: print it)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out file")):
    """The recipe that produced a checkpoint; `prunelab run` on it reproduces the
    checkpoint (identical tensors on CPU)."""
    from prunelab.workflow.from_checkpoint import recipe_from_checkpoint

    text = recipe_from_checkpoint(source).to_yaml()
    if out_file is None:
        typer.echo(text, nl=False)
        return
    with writing(out_file, "file", overwrite, inputs={"--from": source}):
        from prunelab.io.files import write_text

        write_text(out_file, text, overwrite=overwrite)
    log.info(f"wrote {out_file}")


@app.command("compare", cls=generated_command())
def compare_cmd(
        model: str = typer.Option("smollm2-135m", "--model", "-m", help="model spec"),
        methods: str = typer.Option(..., help="comma-separated method names (wanda, depth, "
                                    "width, svd-llm, ...) or recipe files"),
        budget: str = typer.Option(
            ..., "--budget", metavar="KIND:VALUE", callback=given_budget,
            help="keep-params:F (parameters kept) | remove-weights:F (of the blocks' linear "
            "weights) | remove-blocks:N, or several of one kind (remove-blocks:2,4,6; "
            "keep-params:0.9,0.8): every method at every budget, plus budget_curves.png"),
        out_dir: Path = typer.Option(..., "--out", help="comparison folder (resumable)"),
        calib: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        test: str = typer.Option("wiki-vital:test", help="held-out data spec"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="calibration window length"),
        test_samples: int = typer.Option(16, help="held-out windows"),
        test_seqlen: int = typer.Option(256, help="held-out window length"),
        batch_size: int = typer.Option(8, help="windows per block call"),
        seed: int = typer.Option(0, help="window sampling / method seed"),
        speed: bool = typer.Option(True, "--speed/--no-speed", help="prefill / decode "
                                   "tokens per second"),
        tasks: Optional[str] = typer.Option(None, help="downstream tasks, comma-separated"),
        limit: Optional[int] = typer.Option(None, help="items per downstream task"),
        dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
        device: str = DeviceOpt,
        ray: Optional[str] = RayOpt, cpus_per_point: float = CpusOpt,
        gpus_per_point: float = GpusOpt,
        overwrite: bool = typer.Option(False, help="discard a previous comparison in --out")):
    """Run several methods at one budget (or at each of several budgets of one kind),
    evaluate each once, write a leaderboard (markdown + CSV) and plots (with several
    budgets: perplexity against the budget per method). A rerun skips finished points."""
    from prunelab.workflow.compare import compare
    from prunelab.workflow.run import prepare_out

    for name, v in (("--samples", samples), ("--seqlen", seqlen),
                    ("--test-samples", test_samples), ("--test-seqlen", test_seqlen),
                    ("--batch-size", batch_size)):
        check_positive(name, v)
    _check_ray_flags(ray, cpus_per_point, gpus_per_point)
    with writing(out_dir, None, overwrite,
                 on_interrupt=f"finished methods are kept in {out_dir}; rerun to resume",
                 inputs={"--model": model, "--methods": list(parse_list(methods)),
                         "--calib": data_paths(calib), "--test": data_paths(test)}):
        prepare_out(out_dir, overwrite)
        res = compare(model, list(parse_list(methods)), budget, out_dir, calib=calib,
                      test=test, samples=samples, seqlen=seqlen, batch_size=batch_size,
                      test_samples=test_samples, test_seqlen=test_seqlen, seed=seed,
                      speed=speed, tasks=parse_list(tasks), limit=limit, dtype=dtype,
                      device=device, ray=ray, cpus_per_point=cpus_per_point,
                      gpus_per_point=gpus_per_point, overwrite=overwrite)
    out.print((out_dir / "leaderboard.md").read_text())
    out.print(f"leaderboard: {res['leaderboard']}" +
              (f"; report: {res['report']}" if res.get("report") else ""))

