"""Spec-level healing (what :func:`prunelab.api.heal` and the CLI call): models and data
given as specs or loaded objects, windows made here, the student's manifest read from its
checkpoint folder when there is one."""

from __future__ import annotations

from pathlib import Path

from prunelab.errors import ConfigError
from prunelab.heal import heal
from prunelab.train.config import HealConfig


def read_manifest(lm) -> dict | None:
    """``manifest.json`` of the folder ``lm`` was loaded from, if any."""
    from prunelab.io.manifest import read_manifest as read_checked

    source = str(getattr(lm, "source", "") or "")
    return read_checked(Path(source)) if source and Path(source).is_dir() else None


def heal_specs(model, teacher=None, data="wiki-vital:calib", eval_data="wiki-vital:test",
               config: HealConfig | None = None, out_dir=None, manifest: dict | None = None,
               train_samples: int | None = None, eval_samples: int | None = 32,
               load_options: dict | None = None, **options):
    """Load what is given as a spec, make the windows (``config.seqlen``; training: all
    windows of ``data`` or ``train_samples`` of them, shuffled by the run; evaluation: the
    first ``eval_samples`` windows of ``eval_data``, ``None`` for no evaluation) and
    :func:`~prunelab.heal.heal`. ``options`` build the config when ``config`` is None."""
    from prunelab import api

    if config is not None and options:
        raise ConfigError("give config or options, not both")
    cfg = config or HealConfig(**options)
    if teacher is not None and not cfg.needs_teacher:
        raise ConfigError(f"--teacher is used by --loss kd, hidden and mix only (this run's "
                          f"loss is {cfg.loss})")
    load_options = load_options or {}
    lm = api.load(model, **load_options) if isinstance(model, str) else api._as_loaded(model)
    ref = None
    if teacher is not None:
        ref = api.load(teacher, dtype=lm.dtype, device=str(lm.device), **{
            k: v for k, v in load_options.items() if k not in ("dtype", "device")}) \
            if isinstance(teacher, str) else api._as_loaded(teacher)
    if manifest is None:
        manifest = read_manifest(lm)
    train = api.tokens_for(lm, data, seqlen=cfg.seqlen, samples=train_samples, mode="test")
    evals = None if eval_data is None else api.tokens_for(
        lm, eval_data, seqlen=cfg.seqlen, samples=eval_samples, mode="test")
    lm, record = heal(lm, ref, train.input_ids, None if evals is None else evals.input_ids,
                      cfg, out_dir=out_dir, manifest=manifest)
    record["data"] = {"train": train.to_dict(), "eval": None if evals is None else
                      evals.to_dict()}
    return lm, record
