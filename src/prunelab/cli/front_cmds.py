"""``prunelab front``: the served front of a model in llama.cpp (dense quantization ladder
and pruned, healed, quantized files), and the best file for a size or speed
(:mod:`prunelab.workflow.front`); ``prunelab imatrix``: an importance matrix for llama.cpp's
quantizer from the model's own calibration (:mod:`prunelab.calib.imatrix`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab.cli.apps import app
from prunelab.cli.common import (
    DtypeOpt,
    ModelOpt,
    RemoteOpt,
    check_positive,
    data_paths,
    out,
    parse_settings,
    writing,
)
from prunelab.cli.generated import generated_command
from prunelab.errors import ConfigError


@app.command("front", cls=generated_command())
def front_cmd(
        model: Optional[str] = typer.Option(
            None, "--model", "-m", help="embedded name, DIR, FILE.gguf or hub id (omit to "
            "answer --target from the front already in --out)"),
        out_dir: Path = typer.Option(..., "--out", help="front folder (a rerun resumes it)"),
        grid: Optional[str] = typer.Option(
            None, help="pruned models, comma-separated KIND:VALUE[+heal]: depth:N, ffn:F, "
            "heads:F, sublayers:N, slice:F; none for the dense ladder alone (default "
            "depth:4+heal,depth:6+heal,depth:8+heal,ffn:0.25+heal)"),
        types: Optional[str] = typer.Option(
            None, help="dense ladder types (default f16,q8_0,q6_k,q5_k_m,q4_k_m,q3_k_m,q2_k "
            "and, with the importance matrix, iq4_xs,iq3_m,iq3_xxs,iq2_m,iq2_xxs,iq1_m)"),
        grid_types: Optional[str] = typer.Option(
            None, help="types of the pruned models (default q8_0,q4_k_m,q3_k_m,q2_k and, "
            "with the importance matrix, iq4_xs,iq3_xxs,iq2_m)"),
        imatrix: bool = typer.Option(
            True, "--imatrix/--no-imatrix", help="quantize with an importance matrix from "
            "each model's own calibration (dense and pruned alike)"),
        heal_set: Optional[list[str]] = typer.Option(
            None, "--heal-set", help="KEY=VALUE of the heal of +heal points (HealConfig "
            "fields; default loss=kd temperature=1 steps=32 lr=0.003: distillation from "
            "the dense model)"),
        data: str = typer.Option("wiki-vital:calib", help="calibration data (pruning, "
                                 "healing, importance matrix)"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="calibration window length"),
        test: str = typer.Option("wiki-vital:test", help="held-out data scored in llama.cpp"),
        windows: int = typer.Option(8, help="held-out windows scored in llama.cpp"),
        test_seqlen: int = typer.Option(256, help="held-out window length"),
        rounds: int = typer.Option(3, help="speed rounds (every file once per round, the "
                                   "dense file of each type first; 0: no speed)"),
        threads: int = typer.Option(0, help="llama.cpp threads (0: every core)"),
        prompt: int = typer.Option(512, help="speed: prompt tokens"),
        gen: int = typer.Option(128, help="speed: generated tokens"),
        seed: int = typer.Option(0, help="calibration seed"),
        dtype: str = typer.Option("float32", help="float32 | bfloat16: the dtype the models "
                                  "are pruned and healed in"),
        trust_remote_code: bool = RemoteOpt,
        target: Optional[str] = typer.Option(
            None, help="size:MIB (at most), speed:TOK_S (generation, at least) or ppl:X (at "
            "most): print the best file and how it was made"),
        overwrite: bool = typer.Option(False, help="discard the front already in --out "
                                       "(only the files it wrote)")):
    """Draw the served front: the dense quantization ladder and a grid of pruned (healed)
    models in every type, each file measured inside llama.cpp (size, perplexity, prompt and
    generation speed); mark the Pareto-optimal files and answer --target. Resumable."""
    from prunelab.train.config import HealConfig
    from prunelab.workflow.front import answer, build_front, load_front, make_settings

    if model is None:
        _refuse_build_options(locals())
        if target is None:
            raise ConfigError("give --model to build a front, or --target to ask the front "
                              f"in {out_dir}")
        _show_answer(answer(load_front(out_dir), target), target)
        return
    if target is not None:  # a bad target is said before hours of work
        from prunelab.workflow.front_select import parse_target

        parse_target(target)
    settings = make_settings(
        model, grid=grid, types=types, grid_types=grid_types, imatrix=imatrix,
        heal=parse_settings(heal_set, HealConfig) if heal_set else None, data=data,
        samples=samples, seqlen=seqlen, test=test, windows=windows, test_seqlen=test_seqlen,
        rounds=rounds, threads=threads, prompt=prompt, gen=gen, seed=seed, dtype=dtype,
        trust_remote_code=trust_remote_code)
    with writing(out_dir, None, overwrite,
                 on_interrupt=f"finished steps are kept in {out_dir}; rerun to resume",
                 inputs={"--model": model, "--data": data_paths(data, test)}):
        front = build_front(settings, out_dir, overwrite=overwrite)
    _show_front(front, out_dir)
    if target is not None:
        _show_answer(answer(front, target), target)


_BUILD_ONLY = ("grid", "types", "grid_types", "heal_set")


def _refuse_build_options(given: dict) -> None:
    """Without --model only --out and --target apply: a build option given anyway is an
    error (it would be silently ignored)."""
    for name in _BUILD_ONLY:
        if given.get(name):
            raise ConfigError(f"--{name.replace('_', '-')} builds a front: give --model too")
    if given.get("overwrite"):
        raise ConfigError("--overwrite builds a front again: give --model too")


def _show_front(front: dict, out_dir: Path) -> None:
    rows = [r for r in front.get("rows", []) if r["front_size"] or r["front_speed"]]
    t = Table(title=f"served front ({len(front.get('rows', []))} files, "
              f"{len(rows)} on a Pareto front)")
    for col in ("file", "MiB", "perplexity", "gen tok/s", "x dense", "front"):
        t.add_column(col)
    for r in sorted(rows, key=lambda r: r["mib"]):
        mark = "/".join(m for m, k in (("size", "front_size"), ("speed", "front_speed"))
                        if r[k])
        t.add_row(Path(r["file"]).name, f"{r['mib']:.1f}", f"{r['ppl']:.3f}",
                  "-" if r["gen"] is None else f"{r['gen']:.1f}",
                  "-" if r["gen_x"] is None else f"{r['gen_x']:.2f}", mark)
    out.print(t)
    out.print(f"front folder: {out_dir} (front.md, front.csv, front_size.png, "
              "front_speed.png; prunelab report for the page)")


def _show_answer(row: dict, target: str) -> None:
    speed = "" if row.get("gen") is None else f", generation {row['gen']:.1f} tok/s" + (
        "" if row.get("gen_x") is None else f" ({row['gen_x']:.2f}x the dense {row['type']})")
    out.print(f"best for {target}: {row['file']}: {row['mib']:.1f} MiB, perplexity "
              f"{row['ppl']:.3f}{speed}; made from {row['made']}")


@app.command("imatrix", cls=generated_command())
def imatrix_cmd(
        model: str = ModelOpt,
        out_path: Path = typer.Option(..., "--out", help="the importance matrix file to write "
                                      "(llama.cpp's GGUF imatrix form)"),
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="window length in tokens"),
        seed: int = typer.Option(0, help="window sampling seed"),
        batch_size: int = typer.Option(4, help="windows per block call"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, trust_remote_code: bool = RemoteOpt):
    """Write an importance matrix for llama.cpp's quantizer: per block weight, the sum of
    its inputs' squares and the token count over the calibration windows (what
    llama-imatrix gathers), in one pass. Use it with prunelab export --format gguf
    --outtype TYPE --imatrix FILE, or llama-quantize --imatrix FILE."""
    from prunelab import api
    from prunelab.calib.imatrix import collect_imatrix
    from prunelab.checkpoint.imatrix import write_imatrix

    check_positive("--samples", samples)
    check_positive("--seqlen", seqlen, 2)
    check_positive("--batch-size", batch_size)
    with writing(out_path, "file", overwrite,
                 inputs={"--model": model, "--data": data_paths(data)}):
        lm = api.load(model, dtype=dtype, trust_remote_code=trust_remote_code)
        ids = api.tokens_for(lm, data, seqlen=seqlen, samples=samples, seed=seed,
                             mode="calib").input_ids
        im = collect_imatrix(lm, ids, batch_size=batch_size, dataset=data)
        write_imatrix(out_path, im, overwrite=overwrite)
    out.print(f"wrote {out_path}: {len(im.sums)} weights, {ids.numel()} tokens of {data}")
