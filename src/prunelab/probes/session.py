"""Run several probes on one model and data set, side by side, with resumable outputs.

All probes share one :class:`~prunelab.probes.context.ProbeContext` (one dense pass caches
every block boundary). With ``out_dir`` each probe writes ``NAME.json``, ``NAME.csv`` and
``NAME.png``; replacement and interchange together also give ``swap_heatmaps.png``; and
``summary.md`` compares the protocols. Long probes save ``NAME.partial.json`` after every
measured unit and resume from it when run again with the same config and data.
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

from prunelab.errors import ConfigError, OutputExistsError
from prunelab.io.save import write_json
from prunelab.log import info
from prunelab.probes.base import REGISTRY, ProbeResult, config_dict, make_config
from prunelab.probes.context import ProbeContext

FORWARD_FREE = {"weight-redundancy"}


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


def run_probes(lm, names: list[str], input_ids, *, data_info: dict | None = None,
               batch_size: int = 8, out_dir: str | Path | None = None,
               overwrite: bool = False, states: str = "memory", max_remove: int = 5,
               **options) -> dict[str, ProbeResult]:
    """Run probes ``names`` on ``input_ids`` ``[N, T]``; options go to the matching configs
    (``window``, ``pairs``, ``span``, ``max_length``, ``scale``, ``seed``, ``angular``...)."""
    if not names:
        raise ConfigError("no probe given")
    configs = {name: make_config(name, **options) for name in names}
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


def _run_one(name, cfg, ctx, out, data_info) -> ProbeResult:
    handler = REGISTRY[name][1]
    cfgd = config_dict(cfg)
    sha = data_info.get("sha256", "")
    kwargs = {}
    params = inspect.signature(handler).parameters
    if "resume" in params:
        kwargs["resume"] = _load_resume(out, name, cfgd, sha)
    if "on_progress" in params and out is not None:
        def save_partial(scores, _name=name):
            write_json(_partial_path(out, _name),
                       {"config": cfgd, "data_sha256": sha, "scores": scores}, overwrite=True)
        kwargs["on_progress"] = save_partial
    if name not in FORWARD_FREE:
        ctx.ensure_cached()
    evals0, start = ctx.block_evaluations, time.perf_counter()
    result = handler(cfg, ctx, **kwargs)
    result.meta.update({
        "model": ctx.lm.spec, "data": data_info,
        "seconds": time.perf_counter() - start,
        "block_evaluations": ctx.block_evaluations - evals0,
        "cache_block_evaluations": ctx.cache_block_evaluations if name not in FORWARD_FREE
        else 0.0,
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
        if path.stem not in everything and path.stem in REGISTRY:
            try:
                everything[path.stem] = ProbeResult.load(path)
            except (KeyError, json.JSONDecodeError):
                continue
    text = write_summary(everything, max_remove=max_remove, model=lm.spec,
                         data=data_info.get("spec", ""))
    tmp = out / ".summary.md.tmp"
    tmp.write_text(text)
    tmp.replace(out / "summary.md")
