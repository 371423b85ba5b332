"""Run the points of a study (a comparison, a sweep, a recipe's stages), resumably.

Every point has a unique ``key`` and a JSON ``payload``; its result is written atomically
to ``OUT/points/<key>/result.json`` and a rerun skips points whose result exists and whose
payload is unchanged (``payload.json`` beside it). The same layout is used whether the
points run here one after another or as Ray tasks (``ray="auto"`` or an address; see
:mod:`prunelab.workflow.ray_backend`), so a study can move between a laptop and a cluster.

``run_point(point, folder) -> dict`` must be a module-level function (Ray pickles it); it
may write files (a checkpoint, plots) into ``folder``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from prunelab import log
from prunelab.errors import ConfigError
from prunelab.io.files import write_json
from prunelab.workflow.points import Point, point_dir
from prunelab.workflow.ray_backend import run_on_ray


def finished(out: Path, point: Point) -> dict | None:
    """The stored result of ``point`` when it ran with the same payload, else None."""
    folder = point_dir(out, point.key)
    res, pay = folder / "result.json", folder / "payload.json"
    if not (res.is_file() and pay.is_file()):
        return None
    try:
        if json.loads(pay.read_text()) != json.loads(json.dumps(point.payload)):
            return None
        return json.loads(res.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def record(out: Path, point: Point, result: dict) -> None:
    """Write a point's payload and result (atomically; the result last, it marks done)."""
    folder = point_dir(out, point.key)
    write_json(folder / "payload.json", point.payload, overwrite=True)
    write_json(folder / "result.json", result, overwrite=True)


def run_points(points: list[Point], run_point: Callable[[Point, Path], dict], out: Path, *,
               ray: str | None = None, cpus_per_point: float = 1.0,
               gpus_per_point: float = 0.0, retries: int = 2) -> list[dict]:
    """Results of ``points`` in order; finished points are read back, not rerun."""
    keys = [p.key for p in points]
    if len(set(keys)) != len(keys):
        raise ConfigError("two points of the study have the same key")
    out = Path(out)
    results: dict[str, dict] = {}
    todo = []
    for p in points:
        done = finished(out, p)
        if done is not None:
            results[p.key] = done
        else:
            todo.append(p)
    if len(todo) < len(points):
        log.info(f"{len(points) - len(todo)} of {len(points)} points already done; skipped")
    if ray is not None and todo:
        for p, res in run_on_ray(todo, run_point, out, address=ray,
                                 cpus_per_point=cpus_per_point,
                                 gpus_per_point=gpus_per_point, retries=retries):
            record(out, p, res)
            results[p.key] = res
    else:
        for i, p in enumerate(todo):
            log.info(f"point {i + 1}/{len(todo)}: {p.key}")
            folder = point_dir(out, p.key)
            folder.mkdir(parents=True, exist_ok=True)
            res = run_point(p, folder)
            record(out, p, res)
            results[p.key] = res
    return [results[k] for k in keys]
