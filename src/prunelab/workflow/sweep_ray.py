"""The points of a depth sweep as Ray tasks (``prunelab sweep depth --ray``).

The driver (:func:`prunelab.workflow.sweep.sweep_depth`) probes the dense model once and
chooses every point's blocks; each point -- prune a copy, recover, score on the test
windows against the dense model -- is then one task of
:func:`prunelab.workflow.executor.run_points`, stored under ``OUT/points/<key>/`` and
merged into the sweep's ``points.json``. A worker reloads the model with the driver's
:func:`prunelab.api.load` arguments and reads the token windows from ``OUT/inputs/``
(the shared-filesystem assumption of :mod:`prunelab.workflow.ray_backend`); it keeps the
dense model, its calibration context and its test outputs for the next point of the same
sweep, so the results equal the serial run's.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from prunelab import api
from prunelab.probes import ProbeContext
from prunelab.workflow.executor import Point, run_points

_CACHE: dict = {}  # per worker process: the dense model of the sweep being run


def _save_ids(path: Path, ids: torch.Tensor) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(ids.cpu().clone(), tmp)
    os.replace(tmp, path)


def point_key(p: dict) -> str:
    return f"{p['name']}.{p['recovery']}.n{p['n']}"


def run_sweep_points(lm, pending: list[dict], calib_ids, test_ids, out: Path,
                     fingerprint: dict, *, load: dict | None, ray: str,
                     cpus_per_point: float = 1.0, gpus_per_point: float = 0.0,
                     batch_size: int = 8, configure: Callable, score: Callable
                     ) -> list[dict]:
    """The sweep points of ``pending`` (name, recovery, n, strategy, window, seed and the
    chosen ``removed`` blocks), each pruned and scored as a Ray task; in ``pending``'s
    order. ``configure`` / ``score``: the sweep's ``point_config`` and ``prune_and_score``,
    passed in by the sweep (module-level functions: Ray pickles them by reference), so this
    module does not import the one that imports it."""
    inputs = (Path(out) / "inputs").resolve()
    _save_ids(inputs / "calib.pt", torch.as_tensor(calib_ids))
    _save_ids(inputs / "test.pt", torch.as_tensor(test_ids))
    digest = hashlib.blake2b(json.dumps(fingerprint, sort_keys=True, default=str).encode(),
                             digest_size=16).hexdigest()
    load = dict(load) if load else {"spec": lm.spec}
    points = [Point(point_key(p), json.loads(json.dumps(
        {**p, "fingerprint": digest, "load": load, "inputs": str(inputs),
         "batch_size": batch_size}, default=str))) for p in pending]
    task = partial(run_point, configure=configure, score=score)
    return run_points(points, task, Path(out), ray=ray, cpus_per_point=cpus_per_point,
                      gpus_per_point=gpus_per_point)


def _dense(payload: dict):
    """(lm, ctx, test_ids, reference cache) of the payload's sweep, built once per worker."""
    key = json.dumps([payload["load"], payload["inputs"], payload["fingerprint"],
                      payload["batch_size"]], sort_keys=True)
    if _CACHE.get("key") != key:
        if "ctx" in _CACHE:
            _CACHE["ctx"].close()
        _CACHE.clear()
        load = dict(payload["load"])
        lm = api.load(load.pop("spec"), **load)
        inputs = Path(payload["inputs"])
        calib = torch.load(inputs / "calib.pt", weights_only=True)
        test = torch.load(inputs / "test.pt", weights_only=True)
        ctx = ProbeContext(lm, calib, batch_size=payload["batch_size"], lazy=True)
        _CACHE.update(key=key, lm=lm, ctx=ctx, test=test, ref={})
    return _CACHE["lm"], _CACHE["ctx"], _CACHE["test"], _CACHE["ref"]


def run_point(point: Point, folder: Path, *, configure: Callable, score: Callable) -> dict:
    """One sweep point in a worker (module level: Ray pickles it by reference)."""
    p = point.payload
    lm, ctx, test_ids, ref_cache = _dense(p)
    cfg = configure(p["name"], p["recovery"], p["n"], p["strategy"], p["window"],
                       p["seed"])
    return score(lm, ctx, cfg, list(p["removed"]), p["how"], test_ids, ref_cache,
                           p["batch_size"], name=p["name"], rec=p["recovery"])
