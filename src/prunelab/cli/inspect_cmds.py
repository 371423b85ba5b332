"""The commands that read a model: ``info``, ``eval`` and ``probe``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab import log
from prunelab.cli.apps import app
from prunelab.cli.common import (
    BatchOpt,
    CalibDtypeOpt,
    DeviceOpt,
    DtypeOpt,
    LoadArgs,
    MissingOpt,
    ModelOpt,
    OffloadOpt,
    PickleOpt,
    RemoteOpt,
    StackOpt,
    StreamOpt,
    check_positive,
    data_paths,
    fmt_bytes,
    given_budget,
    out,
    parse_list,
    parse_pairs,
    parse_settings,
    runtime_budgets,
    writing,
)
from prunelab.cli.generated import generated_command, values
from prunelab.errors import ConfigError


@app.command(cls=generated_command())
def info(model: str = ModelOpt, dtype: str = DtypeOpt, device: str = DeviceOpt,
         trust_remote_code: bool = RemoteOpt, allow_pickle: bool = PickleOpt,
         allow_missing_weights: bool = MissingOpt, stack: Optional[str] = StackOpt,
         json_path: Optional[Path] = typer.Option(None, "--json", help="also write JSON here"),
         overwrite: bool = typer.Option(False, help="replace an existing --json file")):
    """Print the architecture: blocks, heads, KV groups, FFN width, sizes, projections."""
    from prunelab import api
    from prunelab.io.files import write_json

    with writing(json_path, "file", overwrite, inputs={"--model": model}):
        lm = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                      allow_missing_weights, stack=stack).load()
        d = api.info(lm)
        _print_info(d)
        if json_path is not None:
            write_json(json_path, d, overwrite=overwrite)


def _print_info(d: dict) -> None:
    t = Table(title=f"{d['model']} ({d['model_type']}, family {d['family']})", show_header=False)
    rows = [("blocks", d["blocks"]), ("hidden size", d["hidden_size"]),
            ("query heads", d["heads"]), ("KV heads (GQA groups)", d["kv_heads"]),
            ("query heads per group", d["gqa_group_size"]), ("head dim", d["head_dim"]),
            ("FFN width", f"{d['ffn']} ({'gated' if d['gated_mlp'] else 'plain'})"),
            ("vocabulary", d["vocab_size"]), ("tied embeddings", d["tied_embeddings"]),
            ("encoder", d["encoder"]), ("parameters", f"{d['params']:,}"),
            ("FLOPs per token (linear maps)", f"{d['flops_per_token']:,}"),
            ("bytes", f"{d['bytes']:,} ({fmt_bytes(d['bytes'])}, {d['dtype']})")]
    for k, v in rows:
        t.add_row(k, str(v))
    out.print(t)
    bt = Table(title="blocks (0-based): attention and MLP projections [d_out, d_in]")
    for col in ("blocks", "type", "heads/kv", "attention", "mlp"):
        bt.add_column(col, overflow="fold")
    for first, last, b in _group_blocks(d["block_details"]):
        att, mlp = (" ".join(f"{k}{v}" for k, v in b[part].items()).replace(", ", "x")
                    if isinstance(b[part], dict) else str(b[part])
                    for part in ("attention", "mlp"))
        span = str(first) if first == last else f"{first}-{last}"
        bt.add_row(span, b["attention_type"], f"{b['heads']}/{b['kv_heads']}", att, mlp)
    out.print(bt)
    if d.get("factorized"):
        ft = Table(title="factorized modules (prunelab custom modules; remote code)")
        for col in ("module", "kind", "shapes"):
            ft.add_column(col, overflow="fold")
        for m in d["factorized"]:
            shapes = ", ".join(f"{k}={v}" for k, v in m.items() if k not in ("module", "kind"))
            ft.add_row(m["module"], m["kind"], shapes)
        out.print(ft)


def _group_blocks(blocks: list[dict]):
    """Consecutive blocks with identical shapes and type as ``(first, last, block)``."""
    groups: list[tuple[int, int, dict]] = []
    for b in blocks:
        key = {k: v for k, v in b.items() if k != "index"}
        if groups and {k: v for k, v in groups[-1][2].items() if k != "index"} == key:
            groups[-1] = (groups[-1][0], b["index"], groups[-1][2])
        else:
            groups.append((b["index"], b["index"], b))
    return groups


TASKS_PPL_WINDOWS = 16  # eval --tasks without --samples: perplexity windows


#: the presses' options generated on ``eval`` / ``generate`` (--budget remove-cache:F and
#: --press-option are hand-written; the decay press' fitted arrays go through --press-option)
PRESS_OPTIONS = generated_command("presses", skip=("ratio", "weights", "blend"),
                                  prefix="press-")


@app.command("eval", cls=PRESS_OPTIONS)
def eval_cmd(ctx: typer.Context,
             model: str = ModelOpt,
             data: str = typer.Option("wiki-vital:test", help="wiki-vital:test | wikitext2 | "
                                      "c4 | text:PATH | jsonl:PATH[:field]"),
             seqlen: int = typer.Option(512, help="window length in tokens"),
             samples: Optional[int] = typer.Option(None, help="windows to score (default all; "
                                                   "16 with --tasks); encoders: sentences "
                                                   "(default 512)"),
             batch_size: int = typer.Option(4, help="windows per forward pass"),
             kl_reference: Optional[str] = typer.Option(
                 None, "--kl-reference", "--reference",
                 help="reference (dense) model spec: KL and top-1 agreement for causal LMs, "
                 "embedding cosine and nearest-neighbour agreement for encoders"),
             speed: bool = typer.Option(False, "--speed", help="also measure prefill/decode "
                                        "tokens/s and peak memory"),
             gradient_alignment: Optional[str] = typer.Option(
                 None, "--gradient-alignment", help="reference model spec: mean cosine of the "
                 "per-window loss gradients w.r.t. each block's --gradient-params linear"),
             gradient_params: str = typer.Option(
                 "down_proj", help="linear (role, path or glob) whose gradients "
                 "--gradient-alignment compares"),
             press_name: Optional[str] = typer.Option(
                 None, "--press", help="score under an inference-time press: {presses} (KV "
                 "eviction; lazyllm and entroprefill: prefill token pruning); each window's "
                 "first --press-context is the pressed prompt, the rest (the continuation) is "
                 "scored on the pressed cache and reported on its own beside the whole window "
                 "(each press' options are listed under their own heading)"),
             budget: Optional[list[str]] = typer.Option(
                 None, "--budget", metavar="KIND:VALUE", help="how much to remove, "
                 "repeatable: remove-cache:F (with --press: fraction of the prompt removed; "
                 "entroprefill: the cap) | keep-mass:F (PrunePath checkpoints: routing mass "
                 "in (0, 1] to evaluate at; reports the experts per token and FFN FLOPs "
                 "used)", callback=given_budget),
             press_options: Optional[list[str]] = typer.Option(
                 None, "--press-option", help="KEY=VALUE: any option of the press "
                 "(repeatable); decay: fit=ls|kl (kl: fitted by the continuation KL), "
                 "needles=N (with fit=kl: N key-retrieval windows join the fit)"),
             press_context: Optional[float] = typer.Option(
                 None, help="--press: share of each window that is the pressed prompt, in "
                 "(0, 1) (default 0.5); the rest (the continuation) is scored on the pressed "
                 "cache"),
             press_continuation: Optional[int] = typer.Option(
                 None, help="--press: the last N tokens of each window are the continuation "
                 "scored on the pressed cache, the others the pressed prompt (instead of "
                 "--press-context; e.g. --seqlen 1088 --press-continuation 64)"),
             tasks: Optional[str] = typer.Option(
                 None, "--tasks", help="zero-shot tasks, comma-separated: arc_easy, "
                 "arc_challenge, hellaswag, piqa, winogrande, boolq, openbookqa, sciq, mmlu, "
                 "lambada, a .jsonl file or folder (docs/tasks.md), or lm-eval:NAME"),
             limit: Optional[int] = typer.Option(None, help="--tasks: items per task (MMLU: "
                                                 "per subject)"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write results"),
             overwrite: bool = typer.Option(False, help="replace an existing --json file"),
             dtype: str = DtypeOpt, device: str = DeviceOpt,
             trust_remote_code: bool = RemoteOpt, allow_pickle: bool = PickleOpt,
             allow_missing_weights: bool = MissingOpt, stream: bool = StreamOpt):
    """Perplexity on held-out windows (plus KL to a reference and speed on request).

    Encoders: mean-pooled embeddings of held-out sentences (--samples sentences, default
    512, of at most --seqlen tokens): same-document nearest neighbour, and with --reference
    mean cosine and nearest-neighbour agreement to the reference."""
    from prunelab import api
    from prunelab.io.files import write_json

    check_positive("--batch-size", batch_size)
    press_ratio, moe_mass = runtime_budgets(budget, "eval")
    if tasks and press_name is not None:
        raise ConfigError("--tasks and --press do not combine (a press prunes the prompt of "
                          "each perplexity window; task items are scored whole): run them "
                          "as two commands")
    continuation = _check_press_split(press_name, press_context, press_continuation, seqlen)
    if tasks and samples is None:  # tasks are the point: a quick perplexity, not the whole set
        samples = TASKS_PPL_WINDOWS  # (--help says so; the table shows the window count)
    if stream:
        from prunelab.calib.streamed import check_streamed_eval
        check_streamed_eval(speed=speed, press=press_name, moe_mass=moe_mass,
                            gradient_alignment=gradient_alignment)
    with writing(json_path, "file", overwrite,
                 inputs={"--model": model, "--reference": kl_reference,
                         "--gradient-alignment": gradient_alignment,
                         "--data": data_paths(data), "--tasks": list(parse_list(tasks))}):
        lm = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                      allow_missing_weights, stream=stream).load()
        moe = _moe_setup(lm, moe_mass)
        pressing = _press_context(lm, press_name, press_ratio, press_options, None,
                                  values(ctx), data=data, seqlen=seqlen,
                                  continuation=continuation)
        with pressing as session:
            res = api.evaluate(lm, data=data, seqlen=seqlen, samples=samples,
                               batch_size=batch_size, reference=kl_reference, speed=speed,
                               gradient_reference=gradient_alignment,
                               gradient_params=gradient_params, tasks=tasks, limit=limit,
                               trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                               allow_missing_weights=allow_missing_weights)
        if session is not None:
            res["press"] = {"name": press_name, "context": (seqlen - continuation) / seqlen,
                            "prompt": seqlen - continuation, "continuation": continuation,
                            "config": _press_dict(session.config), **_press_report(session)}
        t = Table(title=f"eval {model} on {res['data']['spec']}", show_header=False)
        if lm.adapter.is_vision:  # photos, LFW probe, images/s (prunelab.eval.vision)
            from prunelab.eval.vision import display_rows

            shown = display_rows(res)
        elif "wer" in res:  # speech model
            from prunelab.eval.speech import speech_rows

            shown = speech_rows(res)
        else:
            shown = _encoder_rows(res) if lm.is_encoder else _decoder_rows(res, speed)
        if session is not None:
            shown = [*_continuation_rows(res), *shown,
                     ("press", _press_row(press_name, session, seqlen - continuation,
                                          seqlen))]
        if moe:
            from prunelab.pruning.moe import routing_stats

            stats = routing_stats(lm.model)
            res["moe"] = {"mass": moe_mass, **{k: stats[k] for k in (
                "experts_per_token", "ffn_flops_ratio") if k in stats}}
            shown = [*shown, ("PrunePath experts per token",
                              f"{stats['experts_per_token']:.2f} (FFN FLOPs "
                              f"{stats['ffn_flops_ratio']:.1%} of dense)")]
        if tasks is not None:
            from prunelab.eval.tasks import task_rows

            shown = [*shown, *task_rows(res["tasks"])]
        for k, v in shown:
            t.add_row(k, v)
        out.print(t)
        if json_path is not None:
            write_json(json_path, res, overwrite=overwrite)
            log.info(f"wrote {json_path}")


def _continuation_rows(res: dict) -> list[tuple[str, str]]:
    """The press' figures: the continuation (scored on the pressed cache) first."""
    n, k = res["continuation"], res["seqlen"] - res["continuation"]
    shown = [("continuation perplexity",
              f"{res['continuation_perplexity']:.4f} (the {n} tokens after each pressed "
              f"prompt of {k}: {res['continuation_tokens']:,} predicted)")]
    if "continuation_kl_to_reference" in res:
        shown += [("continuation KL to reference", f"{res['continuation_kl_to_reference']:.5f}"),
                  ("continuation top-1 agreement", f"{res['continuation_top1_agreement']:.4f}")]
    return shown


def _decoder_rows(res: dict, speed: bool) -> list[tuple[str, str]]:
    whole = " (whole window)" if "continuation" in res else ""
    shown = [("perplexity" + whole, f"{res['perplexity']:.4f}"),
             ("windows x seqlen", f"{res['samples']} x {res['seqlen']}"),
             ("scored tokens", f"{res['tokens']:,}"),
             ("parameters", f"{res['params']:,}"),
             ("bytes", f"{res['bytes']:,} ({fmt_bytes(res['bytes'])})"),
             ("eval tokens/s", f"{res['eval_tokens_per_s']:.0f}")]
    if "kl_to_reference" in res:
        shown += [("KL to reference" + whole, f"{res['kl_to_reference']:.5f}"),
                  ("top-1 agreement" + whole, f"{res['top1_agreement']:.4f}")]
    if "gradient_alignment" in res:
        shown.append(("gradient alignment (mean cosine)",
                      f"{res['gradient_alignment']:.4f}"))
    if speed:
        shown += [("prefill tokens/s", f"{res['prefill_tokens_per_s']:.0f}"),
                  ("decode tokens/s", f"{res['decode_tokens_per_s']:.1f}"),
                  ("peak memory", fmt_bytes(res["peak_memory_bytes"]))]
    return shown


def _encoder_rows(res: dict) -> list[tuple[str, str]]:
    shown = [("sentences (max tokens)", f"{res['sentences']} ({res['max_length']})"),
             ("documents", str(res["data"]["documents"])),
             ("same-document nearest neighbour", f"{res['same_document_nn']:.4f}"),
             ("parameters", f"{res['params']:,}"),
             ("bytes", f"{res['bytes']:,} ({fmt_bytes(res['bytes'])})"),
             ("sentences/s", f"{res['sentences_per_s']:.0f}")]
    if "mean_cosine_to_reference" in res:
        shown += [("mean cosine to reference", f"{res['mean_cosine_to_reference']:.5f}"),
                  ("nearest-neighbour agreement", f"{res['nn_agreement']:.4f}")]
    return shown


def _check_press_split(press_name, context, continuation, seqlen: int) -> int | None:
    """The continuation (tokens of a ``seqlen`` window scored on the pressed cache) of
    ``--press-context`` (default 0.5: ``seqlen - int(seqlen * context)``) or
    ``--press-continuation N``: only with ``--press``, one of the two, leaving at least 2
    prompt tokens (else the press has nothing to remove) and 2 continuation tokens (the
    continuation's perplexity needs one predicted token). ``None`` without a press."""
    if press_name is None:
        for flag, v in (("--press-context", context), ("--press-continuation", continuation)):
            if v is not None:
                raise ConfigError(f"{flag} applies with --press NAME only")
        return None
    if context is not None and continuation is not None:
        raise ConfigError("give --press-context or --press-continuation, not both (both "
                          "set where each window is split)")
    from prunelab.registry import check_range

    if continuation is not None:
        check_range("--press-continuation", continuation, 1, None, integer=True)
        if not 2 <= continuation <= seqlen - 2:
            raise ConfigError(f"--press-continuation {continuation} leaves {seqlen - continuation}"
                              f" of the {seqlen} tokens of a window as the pressed prompt: it "
                              f"takes 2 to {seqlen - 2} tokens (at least 2 prompt tokens and 2 "
                              "continuation tokens)")
        return continuation
    if context is None:
        context = 0.5
    check_range("--press-context", context, 0.0, 1.0)
    prompt = int(seqlen * context)
    if not 0 < context < 1 or prompt < 2 or prompt > seqlen - 2:
        raise ConfigError(f"--press-context {context:g} leaves {prompt} of the {seqlen} tokens "
                          "of a window as the pressed prompt: it needs at least 2, and 2 left "
                          "to score on the pressed cache (give 0 < --press-context < 1)")
    return seqlen - prompt


def _press_row(name: str, session, prompt: int, seqlen: int) -> str:
    """What the press did, as measured on the last window (not only what was asked)."""
    rep = getattr(session, "report", {}) or {}
    text = f"{name} {_press_dict(session.config)} on the first {prompt} tokens " \
        f"({prompt / seqlen:.0%}) of each window"
    if "prompt" in rep and "kept" in rep:
        n, kept = int(rep["prompt"]), int(rep["kept"])
        text += (f"; last window kept {kept} of {n}" if kept < n else
                 f"; removed nothing (last window kept all {n} prompt tokens)")
    return text


@contextlib.contextmanager
def _press_context(lm, name, ratio, options, context, gen=None, data=None, seqlen=None,
                   continuation=None):
    """The press session of ``eval --press`` (``None`` without a press); ``gen``: the
    generated press options (:func:`prunelab.cli.generated.values`); ``data`` / ``seqlen``:
    the command's, for the decay press' calibration windows (:func:`_decay_windows`);
    ``context`` or ``continuation``: the evaluator's split of each window."""
    if name is None:
        if ratio is not None or options:
            raise ConfigError("--budget remove-cache:F / --press-option need --press NAME")
        if gen is not None and gen.given_flags():
            raise ConfigError(f"{gen.given_flags()[0]} needs --press NAME")
        yield None
        return
    from prunelab.inference import PRESSES, press

    PRESSES.get(name)  # unknown names: one line naming the valid ones
    own = {} if gen is None else gen.piece("presses", name, f"--press {name}")
    cfg = _press_config(lm, name, ratio, options, own, data=data, seqlen=seqlen)
    with press(lm, cfg, context=context, continuation=continuation) as session:
        yield session


def _press_config(lm, name: str, ratio, options, own=None, data=None, seqlen=None):
    """``--press NAME --budget remove-cache:R --press-option K=V``; the decay press is fitted
    first: by least squares on 8 calibration windows (``fit=ls``, the default; with
    ``observe > 0`` to the attention of the next 64 tokens), or end-to-end by the
    continuation KL (``fit=kl``: the blended press of
    :mod:`prunelab.inference.decay_kl`, on 6 windows of 1024 + 32 tokens). ``own``: the
    press' options given as flags (``--press-window 16``); ``data`` / ``seqlen``: the
    command's, for the least-squares fit (:func:`_decay_windows`)."""
    from prunelab.inference import PRESSES, press_for

    PRESSES.get(name)  # unknown names: one line naming the valid ones
    fit, needles, options = _press_fit(name, options)
    settings = parse_settings(options, PRESSES.get(name))
    for key in ("ratio", "max_ratio"):
        if key in settings:
            raise ConfigError(f"--press-option {key}: the press' budget is --budget "
                              "remove-cache:F (fraction of the prompt removed)")
    both = sorted(set(own or {}) & set(settings))
    if both:
        raise ConfigError(f"--press-option {both[0]} repeats --press-{both[0].replace('_', '-')}"
                          "; give it once")
    opts = {**(own or {}), **settings}
    cfg = press_for(name, ratio, **opts)
    if fit == "kl":
        if opts:
            raise ConfigError("--press-option fit=kl chooses the decay press' options "
                              f"itself; drop {', '.join(sorted(opts))}")
        return _fit_decay_kl(lm, cfg, needles)
    if needles:
        raise ConfigError("--press-option needles=N applies to fit=kl only")
    if name == "decay" and getattr(cfg, "weights", None) is None:
        import dataclasses

        from prunelab import api
        from prunelab.inference import fit_decay

        spec, length = _decay_windows(lm, data, seqlen)
        calib = api.tokens_for(lm, spec, seqlen=length, samples=8, mode="calib")
        fitted = fit_decay(lm, calib.input_ids, ratio=cfg.ratio, window=cfg.window,
                           observe=cfg.observe, horizon=64 if cfg.observe else 0)
        cfg = dataclasses.replace(cfg, weights=fitted.weights)
    return cfg


def _decay_windows(lm, data, seqlen) -> tuple[str, int]:
    """The decay press' least-squares calibration windows: the calibration part of the
    command's data (``wiki-vital:test`` -> ``wiki-vital:calib``, ``wikitext2`` / ``c4`` ->
    their ``calib`` split, a local ``text:`` / ``jsonl:`` source as it is; without data,
    ``wiki-vital:calib``), ``seqlen`` tokens long (512 without one), capped by the model's
    positions."""
    spec = (data or "wiki-vital:calib").strip()
    head, at, local = spec.partition("@")
    kind = head.partition(":")[0]
    if kind in ("wiki-vital", "wikitext2", "c4"):
        spec = f"{kind}:calib" + (f"@{local}" if at else "")
    length = seqlen if isinstance(seqlen, int) and seqlen > 0 else 512
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < length:
        length = limit
    return spec, length


def _press_fit(name: str, options) -> tuple[str, int, list]:
    """``fit=ls|kl`` and ``needles=N`` taken out of the ``--press-option`` items (decay
    only)."""
    fit, needles, rest, seen, seen_needles = "ls", 0, [], False, False
    for item in options or ():
        key, _, value = item.partition("=")
        if key.strip() == "needles":
            if seen_needles:
                raise ConfigError("--press-option needles given twice")
            seen_needles = True
            if name != "decay":
                raise ConfigError(f"--press-option needles applies to --press decay, not "
                                  f"{name}")
            try:
                needles = int(value.strip())
            except ValueError:
                needles = -1
            if needles < 0:
                raise ConfigError(f"--press-option needles must be an integer >= 0, got "
                                  f"{value.strip()!r}")
            continue
        if key.strip() != "fit":
            rest.append(item)
            continue
        if seen:
            raise ConfigError("--press-option fit given twice")
        seen = True
        if name != "decay":
            raise ConfigError(f"--press-option fit applies to --press decay, not {name}")
        if value.strip() not in ("ls", "kl"):
            raise ConfigError(f"--press-option fit must be ls or kl, got {value.strip()!r}")
        fit = value.strip()
    return fit, needles, rest


def _fit_decay_kl(lm, cfg, needles: int = 0):
    """The blended decay press at ``cfg.ratio``, fitted by the continuation KL on 6
    ``wiki-vital:calib`` windows of 1024 + 32 tokens (fewer where the model's positions
    end; a few minutes per ratio on a CPU for SmolLM2-135M), plus ``needles`` needle
    windows (:mod:`prunelab.inference.needles`: a key sentence in the prompt, its answer
    in the continuation) so the fit weighs retrieval as well as text; with needles the
    fit also chooses the share of the budget reserved for SnapKV's top tokens."""
    from prunelab import api
    from prunelab.inference.decay_kl import SHARES, KLCalibration
    from prunelab.inference.needles import with_needles

    limit = getattr(lm.model.config, "max_position_embeddings", None)
    seqlen = min(1024 + 32, limit) if isinstance(limit, int) and limit > 0 else 1024 + 32
    calib = api.tokens_for(lm, "wiki-vital:calib", seqlen=seqlen, samples=6, mode="calib")
    ids = with_needles(lm.tokenizer, calib.input_ids, needles, horizon=32)
    log.info(f"fitting the decay press at ratio {cfg.ratio} by the continuation KL on "
             f"{ids.shape[0]} windows of {ids.shape[1]} tokens"
             + (f" ({needles} with a key to retrieve)" if needles else "")
             + ": 5-15 minutes on a CPU")
    kl = KLCalibration(lm, ids, horizon=32, observe=32)
    # with needles the share of the budget kept for SnapKV's own top tokens is fitted too
    fitted = kl.fit(cfg.ratio, blocks=2, shares=SHARES if needles else None)
    h = kl.history[cfg.ratio]
    log.info(f"fitted: share {fitted.share}, mix {fitted.mix}, recent {fitted.recent}; "
             f"calibration KL {h['kl_fitted']:.4g} (SnapKV {h['kl_snapkv']:.4g})")
    return fitted


def _press_dict(cfg) -> dict:
    from prunelab.registry import to_dict

    d = to_dict(cfg)
    d.pop("weights", None)  # the decay press' fitted weights: many floats
    return d


def _press_report(session) -> dict:
    rep = dict(getattr(session, "report", {}) or {})
    keep = {k: v for k, v in rep.items() if isinstance(v, (int, float, str, bool))}
    return {"last_prefill": keep}


def _moe_setup(lm, mass: float | None) -> bool:
    """Set a PrunePath checkpoint's routing mass (``--budget keep-mass:P``) and zero its counters;
    True when the model has PrunePath experts to report on."""
    from prunelab.pruning.moe import prunepath_modules, reset_stats, set_mass

    if mass is not None:
        set_mass(lm.model, mass)
    if not prunepath_modules(lm.model):
        return False
    reset_stats(lm.model)
    return True


@app.command(cls=generated_command("probes"))
def probe(ctx: typer.Context,
          model: str = ModelOpt,
          data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
          probe_names: str = typer.Option(..., "--probe", help="comma-separated: {probes}"),
          out_dir: Path = typer.Option(..., "--out", help="output directory (resumable)"),
          pairs: Optional[str] = typer.Option(None, help="swap probes: explicit pairs i-j,..."),
          max_remove: int = typer.Option(5, help="summary: removal sets for n = 1..N"),
          bootstrap: int = typer.Option(200, help="bootstrap resamples of the windows for "
                                        "the 95 % intervals of every score (0: none)"),
          samples: int = typer.Option(16, help="calibration windows"),
          seqlen: int = typer.Option(256, help="window length in tokens"),
          seed: int = typer.Option(0, help="window sampling and noise seed"),
          batch_size: int = BatchOpt,
          states: str = typer.Option("memory", help="boundary cache: memory or disk"),
          overwrite: bool = typer.Option(False, help="replace finished results, a resume made "
                                         "with other settings, or files prunelab did not "
                                         "write"),
          dtype: str = DtypeOpt, device: str = DeviceOpt,
          trust_remote_code: bool = RemoteOpt, allow_pickle: bool = PickleOpt,
          allow_missing_weights: bool = MissingOpt, offload: bool = OffloadOpt,
          stream: bool = StreamOpt,
          stack: Optional[str] = StackOpt, calib_dtype: str = CalibDtypeOpt):
    """Measure layer redundancy under several protocols, side by side (0-based layers; each
    --probe's options are listed under their own heading, given to the probes that take
    them)."""
    from prunelab import api
    from prunelab.errors import ConfigError
    from prunelab.probes import PROBES

    names = [n.strip() for n in probe_names.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--probe names no probe; available: {', '.join(PROBES.names())}")
    for name in names:
        PROBES.get(name)
    if states not in ("memory", "disk"):
        raise ConfigError(f"--states must be memory or disk, got {states!r}")
    check_positive("--batch-size", batch_size)
    check_positive("--max-remove", max_remove)
    with writing(out_dir, None, overwrite, on_interrupt=f"finished probes and partial "
                 f"results (NAME.partial.json) are in {out_dir}/; rerun the same command to "
                 "resume", inputs={"--model": model, "--data": data_paths(data)}):
        if stream:
            from prunelab.probes.base import check_streamable_probes
            check_streamable_probes(names)
        lm = LoadArgs(model, dtype, device, trust_remote_code, allow_pickle,
                      allow_missing_weights, offload, stream, stack=stack,
                      calib_dtype=calib_dtype).load()
        results = api.probe(lm, names, data=data, seqlen=seqlen, samples=samples, seed=seed,
                            batch_size=batch_size, out_dir=out_dir, overwrite=overwrite,
                            states=states, pairs=parse_pairs(pairs) or None,
                            max_remove=max_remove, bootstrap=bootstrap,
                            **values(ctx).routed("probes", names))
    t = Table(title=f"probes on {model} (0-based blocks; most removable first)")
    for col in ("probe", "most removable", "ranking stability", "block evals", "seconds"):
        t.add_column(col, overflow="fold")
    for name, res in results.items():
        rank = res.ranking()[:8]
        rel = res.meta.get("reliability") or {}
        stab = rel.get("stability")
        need = rel.get("windows_for_0.9")
        stab_txt = "-" if stab is None else (
            f"{stab:.2f} at {rel.get('windows')} windows"
            + (f"; ~{need} for 0.9" if isinstance(need, int) and need > (rel.get("windows")
                                                                         or 0) else ""))
        t.add_row(name, ", ".join(map(str, rank)) if rank else "-", stab_txt,
                  f"{res.meta.get('block_evaluations', 0):.0f}",
                  f"{res.meta.get('seconds', 0):.1f}")
    out.print(t)
    log.info(f"wrote {out_dir}/ (NAME.json, NAME.csv, NAME.png, summary.md)")
