"""The stages of a recipe as Ray tasks (``prunelab run RECIPE --out DIR --ray auto|ADDR``).

Every stage still to run (its hash not finished in ``OUT``, as in the serial run) is one
task of :func:`prunelab.workflow.ray_backend.run_on_ray`; a stage's task is handed the
object references of the tasks of the stages it reads (:func:`stage_deps`), so Ray starts
it only when they are done, and independent stages (two prunes from the dense model, the
evaluations of different models) run in parallel. Each task runs the serial runner's code
for its one stage (:func:`run_stage`): the models it starts from are the checkpoints the
earlier stages left in ``OUT/points/<id>/model``, and it records its own
``result.json`` before it ends. The layout, the hashes and the results are those of the
serial run, so a run can be resumed either way. The workers must see ``OUT`` (one
machine, or a shared filesystem).
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

from prunelab import log
from prunelab.errors import ConfigError
from prunelab.workflow.executor import Point, finished, record
from prunelab.workflow.ray_backend import run_on_ray
from prunelab.workflow.recipe import Recipe, load_recipe


def stage_deps(recipe: Recipe) -> dict[str, list[str]]:
    """Stage id -> the ids of the stages it reads: the stage whose model it starts from;
    a report stage reads every earlier stage, a prune stage with ``from_probe`` every
    earlier probe stage."""
    inputs = recipe.inputs()
    deps: dict[str, list[str]] = {}
    earlier: list = []
    for st in recipe.stages:
        if st.kind == "report":
            need = [s.id for s in earlier]
        else:
            need = [] if inputs[st.id] == "dense" else [inputs[st.id]]
            if st.kind == "prune" and getattr(st.options.method, "from_probe", None):
                need += [s.id for s in earlier if s.kind == "probe" and s.id not in need]
        deps[st.id] = need
        earlier.append(st)
    return deps


def run_stages_on_ray(runner, address: str, cpus: float, gpus: float) -> dict:
    """Run the unfinished stages of ``runner`` (a :class:`prunelab.workflow.run._Runner`)
    on Ray; returns the run's manifest, stages in recipe order."""
    stages = list(runner.recipe.stages)
    rows: dict[str, dict] = {}
    todo = []
    for st in stages:
        point = runner._point(st)
        done = finished(runner.out, point)
        if done is not None and runner._outputs_exist(st, done):
            runner.results[st.id] = done
            rows[st.id] = runner._row(st, "reused", 0.0)
        else:
            todo.append(point)
    log.info(f"{len(rows)} of {len(stages)} stages unchanged, reused; {len(todo)} to run "
             "on Ray")
    by_id = {s.id: s for s in stages}
    fn = partial(run_stage, recipe=runner.recipe.to_dict(), out=str(runner.out.resolve()),
                 runner_cls=type(runner))
    replies = run_on_ray(todo, fn, runner.out, address=address, cpus_per_point=cpus,
                         gpus_per_point=gpus, deps=stage_deps(runner.recipe)) if todo else ()
    for point, reply in replies:
        record(runner.out, point, reply["result"])
        runner.results[point.key] = reply["result"]
        rows[point.key] = runner._row(by_id[point.key], "ran", reply["seconds"])
        runner.rows = [rows[s.id] for s in stages if s.id in rows]
        runner._write_run()
    runner.rows = [rows[s.id] for s in stages]
    runner.results = {s.id: runner.results[s.id] for s in stages}
    runner._write_run()
    return runner._manifest()


def run_stage(point: Point, folder: Path, *, recipe: dict, out: str, runner_cls: type) -> dict:
    """One stage of a recipe in its own process (a Ray task): ``{"result", "seconds"}``.
    ``runner_cls``: the serial run's runner class, passed in by the caller (Ray pickles it
    by reference), so this module does not import the one that imports it. The result is
    recorded here, before the task ends, so the stages that read it (which Ray starts as
    soon as this task is done) find it on disk."""
    runner = runner_cls(load_recipe(recipe), Path(out))
    reply = one_stage(runner, point.key)
    record(Path(out), point, reply["result"])
    return reply


def one_stage(runner, stage_id: str) -> dict:
    """Run the stage ``stage_id`` alone (its inputs are on disk): the earlier stages'
    results are read back and their resolved ``from_probe`` paths recomputed (the
    checkpoint's recipe records them as in the serial run)."""
    stages = list(runner.recipe.stages)
    st = next(s for s in stages if s.id == stage_id)
    for s in stages[:stages.index(st)]:
        done = finished(runner.out, runner._point(s))
        if done is not None:
            runner.results[s.id] = done
        if s.kind == "prune" and getattr(s.options.method, "from_probe", None):
            try:
                runner._resolved(s)
            except ConfigError:
                pass  # not an ancestor that ran: its path is not needed
    folder = runner._attempt(runner._point(st))
    start = time.perf_counter()
    res = runner.run_stage(stages.index(st), st, folder)
    return {"result": res, "seconds": time.perf_counter() - start}


def warm_up() -> int:
    """Import the heavy part of what a stage task needs (torch, transformers, prunelab's
    API), so a Ray worker that runs this first does not pay it in its first stage; returns
    its pid. (The runner's own module comes with the task, which names its class.)"""
    import prunelab.api  # noqa: F401, PLC0415 - warm-up: the import is the point

    return os.getpid()
