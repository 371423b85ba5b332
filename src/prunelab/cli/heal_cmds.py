"""``prunelab heal``: a short structure-preserving fine-tune of a pruned checkpoint (LoRA or
full; ce / kd / hidden / mix), optionally pruning while tuning (REP-LIE, CascadeFlow); on a
vision or speech encoder, feature distillation from the dense model
(:mod:`prunelab.train.encoders`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from prunelab.cli.apps import app
from prunelab.cli.common import (
    BudgetOpt,
    DeviceOpt,
    DtypeOpt,
    MissingOpt,
    ModelOpt,
    PickleOpt,
    RemoteOpt,
    budget_fields,
    data_paths,
    out,
    settings_over,
    writing,
)
from prunelab.cli.generated import generated_command, values
from prunelab.errors import ConfigError


def _opt(help_text: str, *names: str):
    return typer.Option(None, *names, help=help_text)


@app.command("heal", cls=generated_command("heal", skip=("quiet",)))
def heal_cmd(
        ctx: typer.Context,
        model: str = ModelOpt,
        out_dir: Path = typer.Option(..., "--out", help="healed checkpoint directory"),
        teacher: Optional[str] = _opt("dense model spec (needed by --loss kd / hidden / mix)"),
        data: str = typer.Option("wiki-vital:calib", help="training data spec"),
        eval_data: Optional[str] = typer.Option(
            "wiki-vital:test", help="held-out data spec for early stopping ('none': no "
            "held-out evaluation and no early stopping)"),
        eval_samples: int = typer.Option(32, help="held-out windows"),
        train_samples: Optional[int] = _opt("training windows (default: all of --data)"),
        seqlen: Optional[int] = _opt("window length in tokens (default 256)"),
        batch_size: Optional[int] = _opt("windows per step (default 4)"),
        seed: Optional[int] = _opt("LoRA init and data order seed (default 0)"),
        budget: Optional[str] = BudgetOpt("with --prune: remove-units:F (rep-lie: of the "
                                          "unit's parameters; default 0.2) | remove-blocks:N "
                                          "(cascadeflow: one per event; default 1)"),
        settings: Optional[list[str]] = typer.Option(
            None, "--set", help="KEY=VALUE: any option of the heal config (repeatable)"),
        state_dir: Optional[Path] = typer.Option(
            None, "--state", help="resumable state folder (default OUT.heal-state; removed "
            "after the checkpoint is written)"),
        image_size: Optional[int] = _opt("vision encoders: image size in px (default 224)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        allow_pickle: bool = PickleOpt, allow_missing_weights: bool = MissingOpt):
    """Heal a pruned model: a short fine-tune that keeps its sparsity, shapes and bridges,
    merged and saved (no peft needed to load it); held-out early stopping; resumable (the
    heal config's options, loss, LoRA, schedule and prune-while-tuning, are listed under
    their own heading)."""
    import prunelab.heal
    from prunelab import api, log
    from prunelab.api.heal_encoders import peek_modality
    from prunelab.log import is_quiet

    load = {"dtype": dtype, "device": device, "trust_remote_code": trust_remote_code,
            "allow_pickle": allow_pickle, "allow_missing_weights": allow_missing_weights}
    given = {k: v for k, v in {"seqlen": seqlen, "batch_size": batch_size,
                               "seed": seed}.items() if v is not None}
    given.update(budget_fields(prunelab.heal.HealConfig, budget, "heal"))
    given.update(values(ctx).piece("heal", "heal", "prunelab heal"))
    from prunelab.cli.common import check_positive

    check_positive("--train-samples", train_samples)
    check_positive("--eval-samples", eval_samples)
    held_out = None if (eval_data or "").lower() in ("", "none") else eval_data
    # no held-out data: no early stopping unless asked for (by a flag or --set)
    quiet = {"quiet": is_quiet(), **({"patience": 0} if held_out is None and
                                     given.get("patience") is None else {})}
    if peek_modality(model) is not None:
        _heal_encoder(model, teacher, data, held_out, out_dir, overwrite, load, given,
                      {"train_samples": train_samples, "eval_samples": eval_samples,
                       "image_size": image_size, "state": state_dir}, settings, quiet)
        return
    if image_size is not None:
        raise ConfigError("--image-size applies to vision encoders only")
    cls = prunelab.heal.HealConfig
    cfg = cls(**{**quiet, **settings_over(given, settings, cls)})
    state = state_dir if state_dir is not None else out_dir.with_name(out_dir.name +
                                                                      ".heal-state")
    from prunelab.train.state import check_state_dir, release_state_dir

    inputs = {"--model": model, "--teacher": teacher,
              "--data": data_paths(data, held_out)}
    check_state_dir(state, {**inputs, "--out": out_dir}, outputs={"--out": out_dir})
    with writing(out_dir, "checkpoint", overwrite, on_interrupt=(
            f"the run's state is in {state}/; rerun the same command to resume"),
            inputs=inputs):
        lm, rec = api.heal(model, teacher, data, held_out, config=cfg, out_dir=state,
                           train_samples=train_samples, eval_samples=eval_samples,
                           load_options=load)
        api.save(lm, out_dir, overwrite=overwrite, data=rec.get("data", {}).get("train"),
                 metrics=_metrics(rec), extra={"healing": rec})
    release_state_dir(state)  # only heal's own, marked state folder
    _show(rec, model, out_dir)
    log.info(f"wrote {out_dir}/")


def _metrics(rec: dict) -> dict:
    held = rec.get("held_out") or {}
    return {f"held_out_{k}_perplexity": (held.get(k) or {}).get("perplexity")
            for k in ("before", "after")}


def _show(rec: dict, model: str, out_dir: Path) -> None:
    held = rec.get("held_out") or {}

    def ppl(key: str) -> str:
        v = (held.get(key) or {}).get("perplexity")
        return "-" if v is None else f"{v:.3f}"
    t = Table(title=f"healing of {model}", show_header=False)
    rows = [("loss", str(rec.get("loss"))), ("steps", str(rec.get("steps"))),
            ("tokens", f"{rec.get('tokens', 0):,}"),
            ("held-out perplexity before -> after", f"{ppl('before')} -> {ppl('after')}"),
            ("best step", str(rec.get("best_step"))),
            ("wall seconds", f"{rec.get('wall_seconds') or 0.0:.1f}"),
            ("checkpoint", str(out_dir))]
    if rec.get("zeros_before") is not None:
        rows.insert(4, ("zero weights before -> after",
                        f"{rec['zeros_before']:,} -> {rec['zeros_after']:,}"))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


#: text-only options and what an encoder heal says about them
_TEXT_ONLY = {"ce_weight": "--ce-weight", "kd_weight": "--kd-weight",
              "temperature": "--temperature", "tokens": "--tokens (use --steps)",
              "seqlen": "--seqlen", "prune": "--prune", "unit": "--unit", "ratio": "--budget",
              "prune_every": "--prune-every", "prune_fraction": "--prune-fraction",
              "stability": "--stability", "round_to": "--round-to", "remove": "--budget",
              "flow_measure": "--flow-measure", "state": "--state (encoder heals do not "
              "resume)"}


def _heal_encoder(model: str, teacher, data: str, held_out, out_dir: Path, overwrite: bool,
                  load: dict, given: dict, extra: dict, settings=None,
                  defaults: dict | None = None) -> None:
    """``prunelab heal`` on a vision or speech encoder: feature distillation from
    ``--teacher`` (see :mod:`prunelab.train.encoders`)."""
    from prunelab import api, log
    from prunelab.api.heal_encoders import heal_encoder_specs
    from prunelab.log import is_quiet
    from prunelab.train.encoders import EncoderHealConfig

    bad = [flag for k, flag in _TEXT_ONLY.items()
           if (given.get(k) if k in given else extra.get(k)) is not None]
    if bad:
        raise ConfigError(f"{model} is an encoder: {', '.join(bad)} apply to text models "
                          "only")
    if teacher is None:
        raise ConfigError("healing an encoder distils it from the dense model: give "
                          "--teacher")
    keep = ("loss", "hidden_weight", "lora_rank", "lora_alpha", "full", "train_bridges",
            "steps", "lr", "warmup", "final_lr_ratio", "weight_decay", "max_grad_norm",
            "batch_size", "eval_every", "patience", "min_delta", "seed")
    cfg = EncoderHealConfig(**{"quiet": is_quiet(), **(defaults or {}), **settings_over(
        {k: given[k] for k in keep if given.get(k) is not None}, settings, EncoderHealConfig)})
    size = extra["image_size"] if extra["image_size"] is not None else 224
    from prunelab.registry import check_range

    check_range("--image-size", size, 14, 4096, integer=True)  # at least one 14-px patch
    with writing(out_dir, "checkpoint", overwrite,
                 inputs={"--model": model, "--teacher": teacher,
                         "--data": data_paths(data, held_out)}):
        lm = api.load(model, **load)
        lm, rec = heal_encoder_specs(lm, teacher, data, held_out, config=cfg,
                                     train_samples=extra["train_samples"],
                                     eval_samples=extra["eval_samples"], image_size=size,
                                     load_options=load)
        api.save(lm, out_dir, overwrite=overwrite, data=rec["data"]["train"],
                 metrics=_encoder_metrics(rec), extra={"healing": rec})
    _show_encoder(rec, model, out_dir)
    log.info(f"wrote {out_dir}/")


def _encoder_metrics(rec: dict) -> dict:
    held = rec.get("held_out") or {}
    out = {}
    for when in ("before", "after"):
        for k, v in (held.get(when) or {}).items():
            if k != "step":
                out[f"held_out_{when}_{k}"] = v
    return out


def _show_encoder(rec: dict, model: str, out_dir: Path) -> None:
    held = rec.get("held_out") or {}

    def pair(key: str) -> str:
        b, a = ((held.get(w) or {}).get(key) for w in ("before", "after"))
        return "-" if b is None or a is None else f"{b:.5f} -> {a:.5f}"
    t = Table(title=f"encoder healing of {model}", show_header=False)
    rows = [("modality", rec["modality"]), ("loss", rec["loss"]),
            ("mode", rec["mode"]), ("steps", str(rec["steps"])),
            ("held-out loss before -> after", pair("loss")),
            ("held-out token cosine before -> after", pair("token_cosine"))]
    if rec["modality"] == "vision":
        rows.append(("held-out CLS cosine before -> after", pair("cls_cosine")))
    rows += [("best step", str(rec["best_step"])), ("blocks", str(rec["num_blocks"])),
             ("wall seconds", f"{rec['wall_seconds']:.1f}"), ("checkpoint", str(out_dir))]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
