"""Run several probes on one model and data set, side by side, with resumable outputs.

All probes share one :class:`~prunelab.probes.context.ProbeContext` (one dense pass caches
every block boundary). With ``out_dir`` each probe writes ``NAME.json``, ``NAME.csv`` and
``NAME.png``; replacement and interchange together also give ``swap_heatmaps.png`` and
``swap_diagonals.png``; and
``summary.md`` compares the protocols. Long probes save ``NAME.partial.json`` after every
measured unit and resume from it when run again with the same fingerprint
(:mod:`prunelab.io.fingerprint`: model config and weights, dtype, token windows, probe
config, prunelab version); a partial of another fingerprint is refused in one line, or
deleted with ``overwrite=True``. Every finished ``NAME.json`` records its fingerprint.

The folder rule: prunelab never replaces a file it did not write without ``overwrite``.
``NAME.json``, ``NAME.csv`` and ``NAME.png`` of a probe being run are refused when any
exists (a finished result, or files of someone else). ``summary.md`` and
``swap_heatmaps.png`` are updated only in a folder that is prunelab's, i.e. holds a probe
result (``NAME.json`` with its probe name) or a ``NAME.partial.json`` that prunelab wrote;
in any other folder an existing one is refused. The summary compares only the finished
results of the same model, dtype and data as this run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prunelab.errors import ConfigError, OutputExistsError
from prunelab.io.files import write_json
from prunelab.io.fingerprint import check_match, make_fingerprint, model_part, same_source
from prunelab.log import info
from prunelab.probes.base import (
    PROBES,
    ProbeResult,
    config_dict,
    options_for,
    probe_spec,
    route_options,
)
from prunelab.probes.context import ProbeContext
from prunelab.probes.reliability import add_reliability
from prunelab.probes.summary import write_summary
from prunelab.registry import check_range


def _partial_path(out: Path, name: str) -> Path:
    return out / f"{name}.partial.json"


def _load_resume(out: Path | None, name: str, fingerprint: dict,
                 overwrite: bool) -> dict | None:
    """The partial result of ``name`` when its fingerprint matches; a mismatch raises
    :class:`~prunelab.errors.ResumeMismatchError`, or with ``overwrite`` deletes it."""
    if out is None:
        return None
    path = _partial_path(out, name)
    if not path.is_file():
        return None
    try:
        partial = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        partial = None
    stored = partial.get("fingerprint") if isinstance(partial, dict) else None
    if not check_match(path, stored, fingerprint, overwrite) or \
            not isinstance(partial.get("scores"), list):
        info(f"prunelab: deleting {path.name} (made with other settings; --overwrite)")
        path.unlink(missing_ok=True)
        return None
    info(f"prunelab: resuming {name} from {path.name} ({len(partial['scores'])} done)")
    return partial


def _is_prunelab_folder(out: Path) -> bool:
    """Whether ``out`` holds a probe result or partial that prunelab wrote."""
    for path in out.glob("*.json"):
        name = path.name[:-len(".partial.json")] if path.name.endswith(".partial.json") \
            else path.stem
        if name not in PROBES:
            continue
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(d, dict) and (d.get("probe") == name or "fingerprint" in d):
            return True
    return False


def check_outputs(out: Path | None, names: list[str], overwrite: bool) -> None:
    """Refuse to start when a file would be replaced that must not be (the folder rule in
    the module docstring): a probe's ``NAME.json`` / ``.csv`` / ``.png``, or
    ``summary.md`` / ``swap_heatmaps.png`` in a folder that is not prunelab's."""
    if out is None or overwrite or not out.exists():
        return
    for name in names:
        for suffix in (".json", ".csv", ".png"):
            if (out / f"{name}{suffix}").exists():
                raise OutputExistsError(f"{out / (name + suffix)} exists; pass --overwrite")
    shared = ["summary.md"]
    if "replacement" in names and "interchange" in names:
        shared += ["swap_heatmaps.png", "swap_diagonals.png"]
    present = [f for f in shared if (out / f).exists()]
    if present and not _is_prunelab_folder(out):
        raise OutputExistsError(f"{out / present[0]} exists and {out} holds no probe result "
                                "of prunelab; pass --overwrite to replace it")


def run_probes(lm, names: list, input_ids, *, data_info: dict | None = None,
               batch_size: int = 8, out_dir: str | Path | None = None,
               overwrite: bool = False, states: str = "memory", max_remove: int = 5,
               seed: int | None = None, bootstrap: int = 200,
               **options) -> dict[str, ProbeResult]:
    """Run probes ``names`` (registered names or typed configs such as
    ``Interchange(window=1)``, mixed freely) on ``input_ids`` ``[N, T]``; returns
    ``{name: ProbeResult}`` in the order given.

    ``options`` (``window``, ``pairs``, ``span``, ``max_length``, ``scale``, ``angular``...)
    are routed by :func:`~prunelab.probes.base.route_options`: each goes to the probes given
    by name that take it, and one that none of them takes is a :class:`ConfigError`.
    ``seed`` is the session's seed: it goes to the probes that take one (contraction's
    noise) unless ``options`` set it, and is never an error.

    ``bootstrap``: resamples of the windows for each score's interval (``ci_low``,
    ``ci_high``), seeded by ``seed``; 0 adds no intervals (the split-half stability in
    ``meta["reliability"]`` is still computed; :mod:`prunelab.probes.reliability`)."""
    check_range("bootstrap", bootstrap, 0, None, integer=True)
    configs = _build_configs(names, options, seed)
    names = list(configs)
    out = Path(out_dir) if out_dir is not None else None
    check_outputs(out, names, overwrite)
    data_info = data_info or {}
    fingerprints, resumes = _fingerprints(lm, input_ids, data_info, configs, out, overwrite)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    ctx = ProbeContext(lm, input_ids, batch_size=batch_size, states=states,
                       data_info=data_info, lazy=True)
    results: dict[str, ProbeResult] = {}
    try:
        for name in names:
            results[name] = _run_one(name, configs[name], ctx, out, data_info,
                                     fingerprints.get(name), resumes.get(name),
                                     reliability=(bootstrap, seed or 0))
        if out is not None:
            _write_reports(results, out, lm, data_info, max_remove,
                           fingerprints.get(names[0]))
    finally:
        ctx.close()
    return results


def _fingerprints(lm, input_ids, data_info: dict, configs: dict, out: Path | None,
                  overwrite: bool) -> tuple[dict, dict]:
    """Each probe's fingerprint and its matching partial (checked before any work)."""
    if out is None:
        return {}, {}
    model = model_part(lm)  # hashes the weights once (~1 s per GB)
    fps = {name: make_fingerprint(lm, input_ids, data_info, options=config_dict(cfg),
                                  model=model) for name, cfg in configs.items()}
    resumes = {name: _load_resume(out, name, fp, overwrite) for name, fp in fps.items()}
    return fps, resumes


def _build_configs(probes: list, options: dict, seed: int | None) -> dict:
    """``{name: config}`` for ``probes`` (names or configs), options routed (see
    :func:`run_probes`); a probe asked for twice is an error."""
    if not probes:
        raise ConfigError("no probe given")
    shared = dict(options)
    if seed is not None and shared.get("seed") is None and any(
            isinstance(p, str) and options_for(p, seed=seed) for p in probes):
        shared["seed"] = seed
    configs: dict = {}
    for cfg in route_options(probes, shared):
        name = PROBES.name_of(cfg)
        if name in configs:
            raise ConfigError(f"probe {name!r} requested twice")
        configs[name] = cfg
    return configs


def _run_one(name, cfg, ctx, out, data_info, fingerprint=None, resume=None,
             reliability: tuple[int, int] = (200, 0)) -> ProbeResult:
    spec = probe_spec(name)
    cfgd = config_dict(cfg)
    kwargs = {}
    if spec.resumable:  # run takes resume and on_progress (declared at registration)
        kwargs["resume"] = resume
    if spec.resumable and out is not None:
        def save_partial(scores, _name=name):
            write_json(_partial_path(out, _name), {"probe": _name, "config": cfgd,
                       "fingerprint": fingerprint, "scores": scores}, overwrite=True)
        kwargs["on_progress"] = save_partial
    if spec.forward and not getattr(cfg, "metric", None):  # a task metric runs the model
        ctx.ensure_cached()
    evals0, start = ctx.block_evaluations, time.perf_counter()
    result = cfg.run(ctx, **kwargs)
    result.meta.update({
        "model": ctx.lm.spec, "data": data_info,
        "seconds": time.perf_counter() - start,
        "block_evaluations": ctx.block_evaluations - evals0,
        "cache_block_evaluations": ctx.cache_block_evaluations if spec.forward else 0.0,
        "value_protocol": _protocol(name, ctx),
    })
    add_reliability(result, *reliability)
    if fingerprint is not None:
        result.meta["fingerprint"] = fingerprint
    if out is not None:
        _write_result(result, out)
        _partial_path(out, name).unlink(missing_ok=True)
    return result


def _protocol(name: str, ctx) -> str:
    if name in ("interchange", "replacement", "leave-one-out", "sublayer-ablation", "interval"):
        if ctx.encoder:
            return ("value: 1 - cos of mean-pooled final hidden states per window; "
                    "value_all_positions: 1 - cos per token")
        return ("value: KL(p_dense || p_modified) at the last position of each window "
                "(float64); value_all_positions: mean KL over all positions")
    return "see the probe's documentation"


def _write_result(result: ProbeResult, out: Path) -> None:
    from prunelab.probes.plots import plot_result  # noqa: PLC0415 - matplotlib

    write_json(out / f"{result.probe}.json", result.to_dict(), overwrite=True)
    tmp = out / f".{result.probe}.csv.tmp"
    tmp.write_text(result.to_csv())
    tmp.replace(out / f"{result.probe}.csv")
    plot_result(result, out / f"{result.probe}.png")


def _write_reports(results, out: Path, lm, data_info: dict, max_remove: int,
                   fingerprint: dict | None = None) -> None:
    from prunelab.probes.plots import plot_swap_pair  # noqa: PLC0415 - matplotlib
    from prunelab.probes.swap_plots import plot_swap_diagonals  # noqa: PLC0415 - matplotlib

    if "replacement" in results and "interchange" in results:
        plot_swap_pair(results["replacement"], results["interchange"],
                       out / "swap_heatmaps.png")
        plot_swap_diagonals({k: results[k] for k in ("replacement", "interchange")},
                            out / "swap_diagonals.png")
    # the summary compares every finished probe in the directory of the same model,
    # dtype and data as this run's, not only this run's
    everything = dict(results)
    for path in sorted(out.glob("*.json")):
        if path.stem not in everything and path.stem in PROBES:
            try:
                res = ProbeResult.load(path)
            except (KeyError, TypeError, json.JSONDecodeError):
                continue
            if fingerprint is None or same_source(res.meta.get("fingerprint"), fingerprint):
                everything[path.stem] = res
            else:
                info(f"prunelab: summary.md leaves out {path.name} (another model, dtype "
                     "or data)")
    text = write_summary(everything, max_remove=max_remove, model=lm.spec,
                         data=data_info.get("spec", ""))
    tmp = out / ".summary.md.tmp"
    tmp.write_text(text)
    tmp.replace(out / "summary.md")
