"""Run several probes on one model and data set, side by side, with resumable outputs.

All probes share one :class:`~prunelab.probes.context.ProbeContext` (one dense pass caches
every block boundary). With ``out_dir`` each probe writes ``NAME.json``, ``NAME.csv`` and
``NAME.png``; replacement and interchange together also give ``swap_heatmaps.png``; and
``summary.md`` compares the protocols. Long probes save ``NAME.partial.json`` after every
measured unit and resume from it when run again with the same config and data.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from prunelab.errors import ConfigError, OutputExistsError
from prunelab.io.save import write_json
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


def _partial_path(out: Path, name: str) -> Path:
    return out / f"{name}.partial.json"


def _load_resume(out: Path | None, name: str, cfg: dict, data_sha: str) -> dict | None:
    if out is None:
        return None
    path = _partial_path(out, name)
    if not path.is_file():
        return None
    try:
        partial = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if partial.get("config") != cfg or partial.get("data_sha256") != data_sha:
        info(f"prunelab: ignoring {path.name} (different config or data)")
        return None
    info(f"prunelab: resuming {name} from {path.name} ({len(partial['scores'])} done)")
    return partial


def check_outputs(out: Path | None, names: list[str], overwrite: bool) -> None:
    """Refuse to start when a finished result would be overwritten."""
    if out is None or overwrite:
        return
    for name in names:
        if (out / f"{name}.json").exists():
            raise OutputExistsError(f"{out / (name + '.json')} exists; pass --overwrite")


def run_probes(lm, names: list, input_ids, *, data_info: dict | None = None,
               batch_size: int = 8, out_dir: str | Path | None = None,
               overwrite: bool = False, states: str = "memory", max_remove: int = 5,
               seed: int | None = None, **options) -> dict[str, ProbeResult]:
    """Run probes ``names`` (registered names or typed configs such as
    ``Interchange(window=1)``, mixed freely) on ``input_ids`` ``[N, T]``; returns
    ``{name: ProbeResult}`` in the order given.

    ``options`` (``window``, ``pairs``, ``span``, ``max_length``, ``scale``, ``angular``...)
    are routed by :func:`~prunelab.probes.base.route_options`: each goes to the probes given
    by name that take it, and one that none of them takes is a :class:`ConfigError`.
    ``seed`` is the session's seed: it goes to the probes that take one (contraction's
    noise) unless ``options`` set it, and is never an error."""
    configs = _build_configs(names, options, seed)
    names = list(configs)
    out = Path(out_dir) if out_dir is not None else None
    check_outputs(out, names, overwrite)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    data_info = data_info or {}
    ctx = ProbeContext(lm, input_ids, batch_size=batch_size, states=states,
                       data_info=data_info, lazy=True)
    results: dict[str, ProbeResult] = {}
    try:
        for name in names:
            results[name] = _run_one(name, configs[name], ctx, out, data_info)
        if out is not None:
            _write_reports(results, out, lm, data_info, max_remove)
    finally:
        ctx.close()
    return results


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


def _run_one(name, cfg, ctx, out, data_info) -> ProbeResult:
    spec = probe_spec(name)
    handler = spec.handler
    cfgd = config_dict(cfg)
    sha = data_info.get("sha256", "")
    kwargs = {}
    if spec.resumable:  # the handler takes resume and on_progress (declared at registration)
        kwargs["resume"] = _load_resume(out, name, cfgd, sha)
    if spec.resumable and out is not None:
        def save_partial(scores, _name=name):
            write_json(_partial_path(out, _name),
                       {"config": cfgd, "data_sha256": sha, "scores": scores}, overwrite=True)
        kwargs["on_progress"] = save_partial
    if spec.forward:
        ctx.ensure_cached()
    evals0, start = ctx.block_evaluations, time.perf_counter()
    result = handler(cfg, ctx, **kwargs)
    result.meta.update({
        "model": ctx.lm.spec, "data": data_info,
        "seconds": time.perf_counter() - start,
        "block_evaluations": ctx.block_evaluations - evals0,
        "cache_block_evaluations": ctx.cache_block_evaluations if spec.forward else 0.0,
        "value_protocol": _protocol(name, ctx),
    })
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
    from prunelab.report.plots import plot_result

    write_json(out / f"{result.probe}.json", result.to_dict(), overwrite=True)
    tmp = out / f".{result.probe}.csv.tmp"
    tmp.write_text(result.to_csv())
    tmp.replace(out / f"{result.probe}.csv")
    plot_result(result, out / f"{result.probe}.png")


def _write_reports(results, out: Path, lm, data_info: dict, max_remove: int) -> None:
    from prunelab.probes.summary import write_summary
    from prunelab.report.plots import plot_swap_pair

    if "replacement" in results and "interchange" in results:
        plot_swap_pair(results["replacement"], results["interchange"],
                       out / "swap_heatmaps.png")
    # the summary compares every finished probe in the directory, not only this run's
    everything = dict(results)
    for path in sorted(out.glob("*.json")):
        if path.stem not in everything and path.stem in PROBES:
            try:
                everything[path.stem] = ProbeResult.load(path)
            except (KeyError, json.JSONDecodeError):
                continue
    text = write_summary(everything, max_remove=max_remove, model=lm.spec,
                         data=data_info.get("spec", ""))
    tmp = out / ".summary.md.tmp"
    tmp.write_text(text)
    tmp.replace(out / "summary.md")
