"""Depth-pruning curves: test perplexity and KL against blocks removed.

One line per probe x recovery (the central figure of the "No Free Swap" study). The dense
model is probed once on the calibration windows (one shared cache of block boundaries);
every point prunes a fresh copy of the dense model, repairs it, and is scored on the test
windows against the dense model (whose test outputs are computed once). ``last-n`` and
``random`` can be listed among the probes as baselines.

Resumable: ``DIR/points.json`` gains one entry per finished point (written atomically) and
finished points are never redone; probe results are kept in ``DIR/probes/``.

``DIR/sweep.json`` holds the sweep's fingerprint (:mod:`prunelab.io.fingerprint`): model
config and weights, dtype, calibration and test token windows (with their spec, samples,
seqlen, seed), the options that change a point (strategy, window, seed) and the prunelab
version. A rerun reuses the points only when its fingerprint matches; otherwise it refuses
in one line, or with ``overwrite=True`` deletes prunelab's sweep files and starts afresh.
The grid (probes, removes, recoveries) is not part of it: a point depends only on its own
(probe, recovery, n), so a matching rerun may add points to the curve. ``batch_size``
does not change results and is left out.

The folder rule: a folder is a sweep of prunelab's when it holds ``sweep.json``; prunelab
then updates its own files there (``points.json``, ``dense.json``, ``curve.*``,
``probes/``). A folder without ``sweep.json`` that holds any of those files (someone's
curve, or a sweep of an older prunelab) is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from prunelab.budget import parse_budget_list
from prunelab.errors import ConfigError, OutputExistsError, PrunelabError
from prunelab.eval.perplexity import score_windows
from prunelab.io.files import write_json
from prunelab.io.fingerprint import check_match, data_part, make_fingerprint
from prunelab.log import info
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext, ProbeResult
from prunelab.probes.base import PROBES
from prunelab.pruning.depth.config import Depth, run_probe, select
from prunelab.pruning.depth.surgery import prune_depth
from prunelab.workflow.sweep_ray import run_sweep_points

BASELINES = ("last-n", "random")
N_DEPENDENT = ("span-angular", "interval")  # re-probed for every n
MARKER = "sweep.json"
SWEEP_FORMAT = "prunelab-sweep/1"
OWN_FILES = ("points.json", "dense.json", "curve.csv", "curve.md", "curve.png")


def parse_range(text: str) -> list[int]:
    """``"remove-blocks:1..6"`` or ``"remove-blocks:1,2,4"`` (``--budget``) -> sorted
    distinct block counts, each >= 1."""
    budgets = parse_budget_list(text)
    if budgets[0].kind != "remove-blocks":
        raise ConfigError(f"sweep depth takes --budget remove-blocks:N..M or "
                          f"remove-blocks:N,M,...; got {text!r}")
    values = [int(b.value) for b in budgets]
    if min(values) < 1:
        raise ConfigError(f"--budget {text!r}: remove at least 1 block")
    return sorted(set(values))


def _point_key(p: dict) -> tuple:
    return (p["probe"], p["recovery"], p["removed_count"])


def _probe_result(name, ctx, out: Path, window, seed) -> ProbeResult:
    path = out / "probes" / f"{name}.json"
    if path.is_file():
        res = ProbeResult.load(path)
        if res.num_blocks == ctx.num_blocks:
            return res
    res = run_probe(name, ctx, Depth(remove=1, probe=name, window=window, seed=seed), 1)
    write_json(path, res.to_dict(), overwrite=True)
    return res


def _own_paths(out: Path) -> list[Path]:
    """prunelab's sweep files present in ``out`` (``sweep.json`` aside)."""
    paths = [out / f for f in OWN_FILES if (out / f).exists()]
    probes = out / "probes"
    if probes.is_dir():
        paths += sorted(p for p in probes.glob("*.json") if p.stem in PROBES)
    return paths


def open_sweep(out: Path, fingerprint: dict, overwrite: bool) -> list[dict]:
    """The points to reuse in ``out`` (``[]`` for a fresh sweep, after writing its
    ``sweep.json``). Refuses a sweep of another fingerprint
    (:class:`~prunelab.errors.ResumeMismatchError`) and a folder holding sweep files but
    no ``sweep.json`` (:class:`~prunelab.errors.OutputExistsError`) unless ``overwrite``,
    which deletes prunelab's sweep files and starts afresh."""
    marker = out / MARKER
    if marker.is_file():
        try:
            stored = json.loads(marker.read_text()).get("fingerprint")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            stored = None
        if check_match(marker, stored, fingerprint, overwrite):
            path = out / "points.json"
            return json.loads(path.read_text()) if path.is_file() else []
    elif not overwrite and _own_paths(out):
        raise OutputExistsError(f"{_own_paths(out)[0]} exists and {out} holds no sweep of "
                                f"prunelab ({MARKER}); pass --overwrite to replace it")
    for path in _own_paths(out):
        path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_json(marker, {"format": SWEEP_FORMAT, "fingerprint": fingerprint}, overwrite=True)
    return []


def sweep_depth(lm, probes: list[str], removes: list[int], recoveries: list[str],
                calib_ids, test_ids, out_dir, *, batch_size: int = 8, window: int | None = 1,
                seed: int = 0, strategy: str | None = None, data_info: dict | None = None,
                test_info: dict | None = None, overwrite: bool = False,
                ray: str | None = None, load: dict | None = None, cpus_per_point: float = 1.0,
                gpus_per_point: float = 0.0) -> list[dict]:
    """Run every (probe, recovery, n) point not yet in ``out_dir``; returns all points.

    ``data_info`` / ``test_info``: the batches' ``to_dict()`` (recorded to explain a
    fingerprint mismatch). ``overwrite``: replace a sweep of another fingerprint, or
    files of a folder that holds no sweep of prunelab, instead of refusing. ``ray``
    (``"auto"`` or an address): the blocks of every point are chosen here, and each
    point is pruned and scored as a Ray task (:mod:`prunelab.workflow.sweep_ray`; ``load``:
    the :func:`prunelab.api.load` arguments a worker reloads the model with)."""
    if lm.adapter.is_encoder:
        raise ConfigError("sweep depth scores test perplexity, which an encoder does not "
                          "have; use prune depth and eval --reference per point")
    for name in probes:
        if name not in PROBES and name not in BASELINES:
            raise ConfigError(f"unknown probe {name!r}; available: "
                              f"{', '.join([*PROBES.names(), *BASELINES])}")
    for rec in recoveries:
        Depth(remove=1, recovery=rec)  # validates the name
    nb = lm.adapter.num_blocks
    if max(removes) >= nb:
        raise ConfigError(f"cannot remove {max(removes)} of {nb} blocks")
    out = Path(out_dir)
    fingerprint = make_fingerprint(
        lm, calib_ids, data_info, options={"strategy": strategy, "window": window,
                                           "seed": seed},
        test_data=data_part(test_ids, test_info))
    points = open_sweep(out, fingerprint, overwrite)
    points_path = out / "points.json"
    done = {_point_key(p) for p in points}
    ctx = ProbeContext(lm, calib_ids, batch_size=batch_size, lazy=True)
    ref_cache: dict = {}
    pending: list = []
    try:
        dense = score_windows(lm, test_ids, batch_size=4, reference=lm,
                              reference_cache=ref_cache, desc="dense test")
        write_json(out / "dense.json", dense, overwrite=True)
        for name in probes:
            result = None
            if name not in BASELINES and name not in N_DEPENDENT:
                result = _probe_result(name, ctx, out, window, seed)
            for n in removes:
                for rec in recoveries:
                    key = (name, rec, n)
                    if key in done:
                        continue
                    if ray is not None:
                        _, removed, how = point_selection(lm, ctx, name, rec, n, result,
                                                          strategy, window, seed)
                        pending.append({"name": name, "recovery": rec, "n": n,
                                        "strategy": strategy, "window": window, "seed": seed,
                                        "removed": removed, "how": how})
                        continue
                    info(f"prunelab: sweep point {name} / {rec} / n={n}")
                    point = _run_point(lm, ctx, name, rec, n, result, strategy, window, seed,
                                       test_ids, ref_cache, batch_size)
                    points.append(point)
                    done.add(key)
                    write_json(points_path, points, overwrite=True)
        if pending:
            points += run_sweep_points(lm, pending, calib_ids, test_ids, out, fingerprint,
                                       load=load, ray=ray, cpus_per_point=cpus_per_point,
                                       gpus_per_point=gpus_per_point, batch_size=batch_size,
                                       configure=point_config, score=prune_and_score)
            write_json(points_path, points, overwrite=True)
        write_sweep_reports(points, dense, out)
    finally:
        ctx.close()
    return points


def _run_point(lm, ctx, name, rec, n, result, strategy, window, seed, test_ids, ref_cache,
               batch_size) -> dict:
    cfg, removed, how = point_selection(lm, ctx, name, rec, n, result, strategy, window, seed)
    return prune_and_score(lm, ctx, cfg, removed, how, test_ids, ref_cache, batch_size,
                           name=name, rec=rec)


def point_config(name: str, rec: str, n: int, strategy, window, seed) -> Depth:
    """The Depth config of the point (probe or baseline ``name``, recovery, n)."""
    is_base = name in BASELINES
    return Depth(remove=n, probe="block-influence" if is_base else name, recovery=rec,
                 strategy=name if is_base else strategy, window=window, seed=seed)


def point_selection(lm, ctx, name, rec, n, result, strategy, window, seed):
    """The point's Depth config and the blocks it removes (chosen on the dense model)."""
    cfg = point_config(name, rec, n, strategy, window, seed)
    removed, how = select(lm, cfg, ctx, n, result=result)
    return cfg, removed, how


def prune_and_score(lm, ctx, cfg: Depth, removed: list[int], how: dict, test_ids, ref_cache,
                    batch_size: int, name: str, rec: str) -> dict:
    """Prune a copy of ``lm`` (``removed``, then ``cfg``'s recovery) and score it on the
    test windows against ``lm``: one point of the curve (``name``: the probe or baseline,
    ``rec``: the recovery's name)."""
    n = cfg.remove
    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    work.offload_to = getattr(lm, "offload_to", None)  # the copy calibrates alike
    work.calib_dtype = getattr(lm, "calib_dtype", None)
    try:
        report = prune_depth(work, cfg, ctx.input_ids, batch_size=batch_size, ctx=ctx,
                             removed=removed)
        test = score_windows(work, test_ids, batch_size=4, reference=lm,
                             reference_cache=ref_cache, desc=f"test n={n}")
        error = None
    except Exception as exc:  # a recovery that does not apply (e.g. cut at block 0)
        if not isinstance(exc, PrunelabError):
            raise
        report, test, error = {}, {}, str(exc)
    return {"probe": name, "strategy": how.get("strategy"), "recovery": rec,
            "removed_count": n, "removed_blocks": removed,
            "test_perplexity": test.get("perplexity"), "test_kl": test.get("kl_to_reference"),
            "test_top1": test.get("top1_agreement"),
            "calib_kl_before_recovery": report.get("calib_kl_before_recovery"),
            "calib_kl_after_recovery": report.get("calib_kl_after_recovery"),
            "params": (report.get("size_after") or {}).get("params"), "error": error}


def write_sweep_reports(points: list[dict], dense: dict, out: Path) -> None:
    """``curve.csv``, ``curve.md`` and ``curve.png`` from the finished points."""
    from prunelab.probes.plots import plot_sweep  # noqa: PLC0415 - matplotlib

    cols = ["probe", "strategy", "recovery", "removed_count", "removed_blocks",
            "test_perplexity", "test_kl", "test_top1", "calib_kl_before_recovery",
            "calib_kl_after_recovery", "params", "error"]
    lines = [",".join(cols)]
    for p in sorted(points, key=_point_key):
        row = [" ".join(map(str, p[c])) if isinstance(p.get(c), list) else
               ("" if p.get(c) is None else str(p[c])) for c in cols]
        lines.append(",".join(f'"{v}"' if "," in v else v for v in row))
    _atomic_text(out / "curve.csv", "\n".join(lines) + "\n")
    _atomic_text(out / "curve.md", sweep_markdown(points, dense))
    plot_sweep(points, dense, out / "curve.png")


def sweep_markdown(points: list[dict], dense: dict) -> str:
    lines_ = sorted({(p["probe"], p["recovery"]) for p in points})
    ns = sorted({p["removed_count"] for p in points})
    by = {_point_key(p): p for p in points}
    head = "| removed | " + " | ".join(f"{a} / {b}" for a, b in lines_) + " |"
    out = ["# Depth pruning curve", "",
           f"Dense test perplexity: {dense['perplexity']:.4f} ({dense['samples']} windows x "
           f"{dense['seqlen']} tokens). Cells: test perplexity (KL to dense); blocks are "
           "0-based.", "", head, "|" + "---|" * (len(lines_) + 1)]
    for n in ns:
        cells = []
        for a, b in lines_:
            p = by.get((a, b, n))
            if p is None:
                cells.append("")
            elif p.get("error"):
                cells.append("n/a")
            else:
                cells.append(f"{p['test_perplexity']:.3f} ({p['test_kl']:.4f})")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out += ["", "Removed blocks per point:", ""]
    for p in sorted(points, key=_point_key):
        out.append(f"- {p['probe']} / {p['recovery']} / n={p['removed_count']}: "
                   f"{p['removed_blocks']}" + (f" ({p['error']})" if p.get("error") else ""))
    return "\n".join(out) + "\n"


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
