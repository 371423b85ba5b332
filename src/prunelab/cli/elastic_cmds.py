"""Elastic models and inference presses: ``prunelab prune elastic`` (one ranking for every
budget), ``prunelab export`` (cut any size from an elastic checkpoint) and ``prunelab
generate`` (text generation, optionally under an inference-time press)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab import log
from prunelab.cli.apps import app, prune_app
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
    fmt_bytes,
    out,
    writing,
)
from prunelab.cli.generated import generated_command, values
from prunelab.cli.prune_cmds import build_config, prune_and_save


@prune_app.command("elastic", cls=generated_command("elastic"))
@calibration_options(seed=(0, "window sampling and budget draws seed"))
def prune_elastic_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        calib: Calibration = None,
        out_dir: Path = typer.Option(..., "--out", help="elastic checkpoint to write (dense "
                                     "weights + elastic.json)"),
        budget: str = BudgetOpt("remove-units:LOW..HIGH (the removal budgets trained, "
                                "fractions of the units' parameters)",
                                default="remove-units:0.1..0.6"),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="KEY=VALUE: any option of the elastic config (repeatable)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt,
        offload: bool = OffloadOpt):
    """Learn one ranking of every KV group and FFN channel across a range of budgets (the
    weights frozen); the checkpoint stays dense and `prunelab export --budget keep-units:F`
    cuts any
    size from it without calibration (the elastic config's options are listed under their
    own heading)."""
    from prunelab.pruning import METHODS

    cls = METHODS.get("elastic")
    # --seed and --budget have defaults of their own: only given ones clash with --set
    given = {k: ctx.get_parameter_source(k).name != "DEFAULT" for k in ("seed", "budget")}
    span = budget_fields(cls, budget, "prune elastic")
    if not given["budget"]:
        keys = {item.partition("=")[0].strip().replace("-", "_") for item in settings or ()}
        span = {k: v for k, v in span.items() if k not in keys}
    cfg = build_config(cls, "prune elastic",
                       {"seed": ("--seed", calib.seed if given["seed"] else None)}, settings,
                       **span, **values(ctx).piece("elastic", "elastic", "prune elastic"))
    load = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                    allow_missing_weights, offload)
    prune_and_save(load, cfg, out_dir, overwrite, calib=calib, metrics=("units",),
                   show=lambda lm, rep: _show_elastic(rep, model, out_dir))


def _show_elastic(rep, model: str, out_dir: Path) -> None:
    t = Table(title=f"elastic ranking of {model}", show_header=False)
    fit = rep["fit"] or {}
    rows = [("units ranked (KV groups + FFN channels)", f"{rep['units']:,}"),
            ("fit", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in fit.items() if not isinstance(v, (list, dict)))),
            ("seconds", f"{rep['seconds']:.1f}"),
            ("elastic checkpoint", f"{out_dir} (dense weights + elastic.json)"),
            ("cut a size", f"prunelab export --model {out_dir} --budget keep-units:0.7 "
                           "--out SMALL")]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


@app.command("export", cls=generated_command())
def export_cmd(
        model: str = ModelOpt,
        out_path: Path = typer.Option(..., "--out", help="checkpoint directory (--format "
                                      "checkpoint) or .gguf file (--format gguf) to write"),
        fmt: str = typer.Option("checkpoint", "--format", help="checkpoint (cut a size from "
                                "an elastic checkpoint) | gguf (one file llama.cpp runs)"),
        budget: Optional[str] = BudgetOpt("checkpoint: keep-units:F (of the units' "
                                          "parameters, attention KV groups and FFN channels, "
                                          "kept; remove-units:F the other way)"),
        allocation: Optional[str] = typer.Option(
            None, help="checkpoint: global (one threshold over every unit: per-block widths, "
            "remote code; the default) or uniform (the same share in every block: a plain "
            "checkpoint)"),
        round_to: Optional[int] = typer.Option(None, help="checkpoint: FFN widths kept are "
                                               "multiples of this (default 8)"),
        outtype: Optional[str] = typer.Option(None, help="gguf: f32 | f16 (the default) | "
                                              "bf16 | q8_0 | q6_k | q5_k_m | q4_k_m | "
                                              "q3_k_m | q2_k | iq4_xs | ...: the type of "
                                              "the 2-D weights (quantized by llama.cpp's own "
                                              "quantizer: needs llama-cpp-python)"),
        imatrix: Optional[Path] = typer.Option(
            None, help="gguf, quantized types: an importance matrix file (llama.cpp's GGUF "
            "or .dat form; prunelab imatrix writes one) weighing the quantizer's rounding"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt):
    """Cut a size from an elastic checkpoint (`prunelab prune elastic`), in seconds, with
    no calibration; or write a model (dense or pruned) as one GGUF file for llama.cpp."""
    from prunelab.errors import ConfigError

    if fmt not in ("checkpoint", "gguf"):
        raise ConfigError(f"--format must be checkpoint or gguf, got {fmt!r}")
    if fmt == "gguf":
        given = [flag for flag, v in (("--budget", budget), ("--allocation", allocation),
                                      ("--round-to", round_to)) if v is not None]
        if given:
            raise ConfigError(f"{given[0]} cuts an elastic checkpoint (--format checkpoint); "
                              "export that cut with --format gguf")
        _export_gguf(model, out_path, outtype or "f16", overwrite, dtype, device,
                     trust_remote_code, imatrix)
        return
    if outtype is not None or imatrix is not None:
        raise ConfigError(f"{'--outtype' if outtype is not None else '--imatrix'} is a GGUF "
                          "option: add --format gguf")
    if budget is None:
        raise ConfigError("export of an elastic checkpoint takes --budget keep-units:F "
                          "(or --format gguf to write a GGUF file)")
    _export_cut(model, budget, out_path, allocation or "global",
                8 if round_to is None else round_to, overwrite, dtype, device)


def _export_gguf(model: str, out_path: Path, outtype: str, overwrite: bool, dtype: str,
                 device: str, trust_remote_code: bool, imatrix: Path | None = None) -> None:
    from prunelab.workflow.export import export_gguf

    if out_path.suffix != ".gguf":
        from prunelab.errors import ConfigError

        raise ConfigError(f"--format gguf writes one file: --out must end in .gguf, got "
                          f"{out_path}")
    inputs = {"--model": model, "--imatrix": str(imatrix) if imatrix else None}
    with writing(out_path, "file", overwrite, inputs=inputs):
        rep = export_gguf(model, out_path, outtype, overwrite=overwrite, device=device,
                          dtype=dtype, trust_remote_code=trust_remote_code, imatrix=imatrix)
    types = rep.get("tensor_types")
    kinds = f" ({', '.join(f'{n} {t}' for t, n in sorted(types.items()))})" if types else ""
    out.print(f"wrote {out_path}: {rep['arch']}, {rep['blocks']} blocks, {rep['out_type']}"
              f"{kinds}, {fmt_bytes(rep['bytes'])}; tokenizer {rep['tokenizer']}")
    for note in rep["notes"]:
        log.warn(note)


def _export_cut(model: str, budget: str, out_dir: Path, allocation: str, round_to: int,
                overwrite: bool, dtype: str, device: str) -> None:
    from prunelab.budget import parse_budget
    from prunelab.errors import ConfigError
    from prunelab.workflow.export import export

    size = parse_budget(budget)
    if size.quantity != "units":
        raise ConfigError(f"export takes --budget keep-units:F or remove-units:F, got {size}")
    keep = size.to("keep").value
    if allocation not in ("global", "uniform"):
        raise ConfigError(f"--allocation must be global or uniform, got {allocation!r}")
    with writing(out_dir, "checkpoint", overwrite, inputs={"--model": model}):
        path = export(model, keep, out_dir, allocation=allocation, round_to=round_to,
                      overwrite=overwrite, device=device, dtype=dtype)
    import json

    man = json.loads((Path(path) / "manifest.json").read_text())
    b, a = man["size_before"], man["size_after"]
    out.print(f"exported {model} at keep {keep} ({allocation}): {b['params']:,} -> "
              f"{a['params']:,} parameters, {fmt_bytes(a['bytes'])}; {man['loads_with']}")


@app.command("generate", cls=generated_command("presses", skip=("ratio", "weights", "blend"),
                                                prefix="press-"))
def generate_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        prompt: str = typer.Option(..., help="the prompt text (@FILE reads a file)"),
        max_new_tokens: int = typer.Option(64, help="tokens to generate (greedy)"),
        press_name: Optional[str] = typer.Option(
            None, "--press", help="an inference-time press: {presses}"),
        budget: Optional[str] = BudgetOpt("remove-cache:F (with --press: fraction of the "
                                          "prompt removed; entroprefill: the cap)"),
        press_options: Optional[list[str]] = typer.Option(
            None, "--press-option", help="KEY=VALUE: any option of the press "
            "(repeatable); decay: fit=ls|kl (kl: fitted by the continuation KL), "
            "needles=N (with fit=kl: N key-retrieval windows join the fit)"),
        question: Optional[str] = typer.Option(
            None, help="a question asked after the prompt (the context; @FILE reads a "
            "file), placed as --question-mode says"),
        question_mode: Optional[str] = typer.Option(
            None, help="with --question and --press: prompt (context and question pressed "
            "as one prompt), after (the context compressed alone, the question appended: "
            "kvpress' pipeline) or aware (the question scores the context and is kept); "
            "default prompt"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt):
    """Greedy generation, optionally under an inference-time press (KV-cache eviction or
    prefill token pruning); prints the text, the kept prompt tokens and the cache bytes.
    With --question, the prompt is the context and --question-mode where the question goes
    (prunelab.inference.query)."""
    import time

    import torch

    from prunelab.cli.common import check_positive, runtime_budgets
    from prunelab.cli.inspect_cmds import _press_context, _press_report
    from prunelab.errors import ConfigError
    from prunelab.models.vocab import check_token_ids  # torch: not at the CLI's import

    check_positive("--max-new-tokens", max_new_tokens)
    press_ratio, _ = runtime_budgets([budget] if budget else None, "generate", mass=False)
    text = prompt_text(prompt)
    lm = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                  allow_missing_weights).load()
    if lm.is_encoder or lm.tokenizer is None:
        raise ConfigError(f"{model} cannot generate (an encoder, or no tokenizer)")
    ids = lm.tokenizer(text, return_tensors="pt")["input_ids"].to(lm.device)
    check_token_ids(lm, ids, "--prompt")
    asked = _question_ids(lm, question, question_mode, press_name)
    check_positions(lm, ids.shape[1] + (0 if asked is None else asked.shape[1]),
                    max_new_tokens)
    with _press_context(lm, press_name, press_ratio, press_options, 1.0,
                        values(ctx)) as session:
        start = time.perf_counter()
        if asked is not None:
            from prunelab.inference.query import answer

            gen, _ = answer(lm, ids, asked, max_new_tokens, question_mode or "prompt",
                            eos=lm.tokenizer.eos_token_id)
            gen = torch.cat([ids, asked, gen], 1)
            ids = torch.cat([ids, asked], 1)
        else:
            with torch.no_grad():
                gen = lm.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                        pad_token_id=lm.tokenizer.eos_token_id)
        seconds = time.perf_counter() - start
    new = gen[0, ids.shape[1]:]
    out.print(lm.tokenizer.decode(new, skip_special_tokens=True))
    t = Table(show_header=False)
    t.add_row("prompt tokens", str(ids.shape[1]))
    if asked is not None:
        t.add_row("question tokens", f"{asked.shape[1]} (the last of the prompt; mode "
                  f"{question_mode or 'prompt'})")
    t.add_row("generated tokens", f"{len(new)} in {seconds:.2f} s")
    if session is not None:
        for k, v in _press_report(session)["last_prefill"].items():
            t.add_row(k.replace("_", " "), f"{v:,}" if isinstance(v, int) else str(v))
    out.print(t)


def _question_ids(lm, question, mode, press_name):
    """``--question`` as ``[1, Q]`` token ids (no special tokens), or ``None``; a mode
    without a question, or without a press to place it for, is an error."""
    from prunelab.errors import ConfigError
    from prunelab.inference.query import MODES
    from prunelab.models.vocab import check_token_ids

    if mode is not None and mode not in MODES:
        raise ConfigError(f"--question-mode must be one of {', '.join(MODES)}, got {mode!r}")
    if question is None:
        if mode is not None:
            raise ConfigError("--question-mode applies with --question TEXT only")
        return None
    if mode is not None and press_name is None:
        raise ConfigError("--question-mode needs --press NAME (without a press the question "
                          "simply follows the prompt)")
    ids = lm.tokenizer(prompt_text(question), add_special_tokens=False,
                       return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ConfigError("--question has no tokens")
    check_token_ids(lm, ids, "--question")
    return ids.to(lm.device)


def prompt_text(prompt: str) -> str:
    """The text of ``--prompt`` (``@FILE`` reads a file): UTF-8, not empty, else one line."""
    from prunelab.errors import ConfigError

    where = "--prompt"
    if prompt.startswith("@"):
        where = f"--prompt file {prompt[1:]}"
        try:
            raw = Path(prompt[1:]).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {prompt[1:]}: {exc.strerror or exc}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where} is not UTF-8 text ({exc.reason} at byte "
                              f"{exc.start})") from None
    else:
        text = prompt
        try:  # bytes that are not UTF-8 reach argv as lone surrogates
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"{where} is not UTF-8 text (character {exc.start} cannot be "
                              "encoded)") from None
    if not text:
        raise ConfigError(f"{where} is empty: give the text to continue")
    return text


def check_positions(lm, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt that tokenizes to nothing, or a prompt plus ``--max-new-tokens`` beyond
    the positions the model was trained on (``max_position_embeddings``, ``n_positions``):
    a learned-position model (GPT-2) has no embedding there, a RoPE model runs past its
    trained length and gives text of no meaning."""
    from prunelab.errors import ConfigError
    from prunelab.models.loading import model_positions

    if prompt_tokens < 1:
        raise ConfigError("--prompt gives no tokens: give the text to continue")
    limit = model_positions(lm.model.config)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        fix = (f"give --max-new-tokens {room} or less" if room > 0
               else "shorten the prompt")
        raise ConfigError(
            f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {max_new_tokens} is "
            f"beyond the {limit} positions of {lm.spec}: {fix}")
