"""Compare pruning methods at a matched budget (``prunelab compare``).

Every method -- a registered method name (``wanda``, ``depth``, ``width``, ``svd-llm``...)
or a recipe file whose ``prune`` / ``heal`` stages are the method (the budget goes to its
first prune stage) -- is one point of :func:`prunelab.workflow.executor.run_points`,
beside a ``dense`` point: it loads the model, prunes at the budget
(:mod:`prunelab.workflow.budget`), and is evaluated once the same way as every other
(:func:`prunelab.workflow.evaluate.evaluate_model`; the dense model is the KL reference,
loaded once per process and its outputs on the test windows cached). A method that
cannot meet the budget exactly reports the figure it reaches. Results land in
``OUT/points/<method>/result.json`` (a rerun skips finished points, serially or on Ray),
then ``leaderboard.md`` / ``.csv`` / ``.json``, ``quality_vs_params.png``,
``speed_vs_params.png`` and ``report.html`` when the HTML report is installed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError
from prunelab.workflow.budget import Budget, achieved, apply_budget, parse_budget, sizes
from prunelab.workflow.executor import Point, run_points

_REFS: dict[tuple, Any] = {}  # per process: (model, dtype, device) -> (dense lm, cache)


def method_stages(item: str, budget: Budget, dense: dict) -> tuple[str, list[dict]]:
    """``(label, stages)`` of one ``--methods`` item: the stages as recipe stage dicts
    with the budget applied to the first prune stage."""
    from prunelab.pruning import METHODS
    from prunelab.registry import to_dict
    from prunelab.workflow.recipe import load_recipe

    if item.endswith((".yaml", ".yml")) or Path(item).is_file():
        recipe = load_recipe(item)
        label = Path(item).stem
        stages = [s for s in recipe.stages if s.kind in ("prune", "heal")]
        if not any(s.kind == "prune" for s in stages):
            raise ConfigError(f"--methods {item}: the recipe has no prune stage")
    else:
        from prunelab.workflow.stages import parse_stage

        METHODS.get(item)
        label = item
        stages = [parse_stage(0, {"prune": {"method": item, **_defaults(item)}})]
    out, done = [], False
    for st in stages:
        d = st.to_dict(with_source=False)
        if st.kind == "prune" and not done:
            cfg = apply_budget(st.options.method, budget, dense)
            body = to_dict(cfg)
            body["method"] = body.pop("name")
            calib = d["prune"].get("calib")
            d = {"prune": {"id": st.id, **body, **({"calib": calib} if calib else {})}}
            done = True
        out.append(d)
    return label, out


def _defaults(name: str) -> dict:
    """Options a method needs before the budget is applied (a placeholder budget)."""
    from prunelab.pruning import METHODS

    fields = METHODS.get(name).__dataclass_fields__
    if "remove" in fields and "target_params" in fields:
        return {"remove": 1, "bootstrap": 0}
    if "target_params" in fields and "ratio" in fields:
        return {"ratio": 0.1}
    if "target_params" in fields:
        return {"target_params": 0.9}
    if "sparsity" in fields:
        return {"sparsity": 0.5}
    return {}


def _key(label: str) -> str:
    key = re.sub(r"[^A-Za-z0-9._=+-]", "-", label)[:120]
    return key or "method"


def compare(model: str, methods: list[str], budget: str | Budget, out: str | Path, *,
            calib: str = "wiki-vital:calib", test: str = "wiki-vital:test",
            samples: int = 32, seqlen: int = 256, batch_size: int = 8,
            test_samples: int = 16, test_seqlen: int = 256, seed: int = 0,
            speed: bool = True, tasks: tuple = (), limit: int | None = None,
            dtype: str = "float32", device: str = "cpu", ray: str | None = None,
            cpus_per_point: float = 1.0, gpus_per_point: float = 0.0) -> dict:
    """Run ``methods`` at ``budget`` on ``model``; returns ``{"rows": [...], "dense":
    {...}, **paths}`` (rows in the order of ``methods``, dense first)."""
    from prunelab import api
    from prunelab.workflow.evaluate import tasks_supported
    from prunelab.workflow.leaderboard import write_study
    from prunelab.workflow.stages import EvaluateStage

    budget = budget if isinstance(budget, Budget) else parse_budget(budget)
    if ray is not None:
        import importlib.util

        if importlib.util.find_spec("prunelab.workflow.ray_backend") is None:
            raise ConfigError("--ray needs prunelab.workflow.ray_backend, not in this "
                              "install; run without --ray")
    if not methods:
        raise ConfigError("--methods names at least one method")
    if tasks and not tasks_supported():
        raise ConfigError("--tasks needs downstream-task evaluation (api.evaluate(tasks=...)),"
                          " not in this install")
    ev = EvaluateStage(samples=test_samples, seqlen=test_seqlen, batch_size=min(batch_size, 8),
                       speed=speed, tasks=tuple(tasks), limit=limit)
    dense = sizes(api.load(model, dtype=dtype, device="cpu"))
    base = {"model": model, "dtype": dtype, "device": device, "test": test, "seed": seed,
            "calib": {"data": calib, "samples": samples, "seqlen": seqlen,
                      "batch_size": batch_size},
            "eval": {k: getattr(ev, k) for k in ("samples", "seqlen", "batch_size", "speed",
                                                 "tasks", "limit")},
            "budget": str(budget), "dense_sizes": dense}
    points = [Point("dense", {**base, "label": "dense", "stages": []})]
    for item in methods:
        label, stages = method_stages(item, budget, dense)
        points.append(Point(_key(label), {**base, "label": label, "stages": stages}))
    out = Path(out)
    results = run_points(points, compare_point, out, ray=ray, cpus_per_point=cpus_per_point,
                         gpus_per_point=gpus_per_point)
    cmd = (f"prunelab compare --model {model} --methods {','.join(methods)} --budget "
           f"{budget} --calib {calib} --test {test} --out {out}")
    paths = write_study(out, results, dense=results[0], title=f"compare {model} at {budget}",
                        commands=[cmd], summary={"model": model, "budget": str(budget),
                                                 "calibration": calib, "test": test})
    return {"rows": results, "dense": results[0], **paths}


def _reference(p: dict):
    """The dense model of point payload ``p`` and its reference cache, once per process."""
    from prunelab import api

    key = (p["model"], p["dtype"], p["device"])
    if key not in _REFS:
        _REFS.clear()
        _REFS[key] = (api.load(p["model"], dtype=p["dtype"], device=p["device"]), {})
    return _REFS[key]


def compare_point(point: Point, folder: Path) -> dict:
    """One method of a comparison (module level: Ray pickles it): load, prune at the
    budget (timed, peak memory sampled), evaluate against the dense model."""
    from prunelab import api
    from prunelab.eval.speed import PeakRSS
    from prunelab.workflow.evaluate import evaluate_model
    from prunelab.workflow.recipe import parse_recipe
    from prunelab.workflow.stages import EvaluateStage

    p = point.payload
    lm = api.load(p["model"], dtype=p["dtype"], device=p["device"])
    c = p["calib"]
    seconds, peak = 0.0, None
    if p["stages"]:
        recipe = parse_recipe({"model": p["model"], "data": c["data"], "test": p["test"],
                               "seed": p["seed"], "samples": c["samples"],
                               "seqlen": c["seqlen"], "batch_size": c["batch_size"],
                               "dtype": p["dtype"], "device": p["device"],
                               "stages": p["stages"]})
        start = time.perf_counter()
        with PeakRSS() as rss:
            lm = _apply(lm, recipe, folder)
        seconds, peak = time.perf_counter() - start, rss.peak
    ref_lm, cache = _reference(p)
    ev = EvaluateStage(**{**p["eval"], "tasks": tuple(p["eval"]["tasks"])})
    metrics = evaluate_model(lm, ev, data=p["test"], reference=None if not p["stages"]
                             else ref_lm, reference_cache=cache, seed=p["seed"])
    budget = parse_budget(p["budget"])
    after = sizes(lm)
    row = {"method": p["label"], **metrics, **achieved(after, p["dense_sizes"], budget),
           "prune_seconds": seconds if p["stages"] else None,
           "prune_peak_memory_bytes": peak, "operations": lm.history}
    if not p["stages"]:
        row["achieved"] = "dense"
    return row


def _apply(lm, recipe, folder: Path):
    """The prune / heal stages of ``recipe`` on ``lm`` in place."""
    from prunelab import api

    for st in recipe.stages:
        if st.kind == "prune":
            o = st.options.calib
            api.prune(lm, st.options.method, data=o.data or recipe.data,
                      seqlen=o.seqlen or recipe.seqlen, samples=o.samples or recipe.samples,
                      seed=recipe.seed, batch_size=o.batch_size or recipe.batch_size)
        elif st.kind == "heal":
            teacher = _reference({"model": recipe.model, "dtype": recipe.dtype,
                                  "device": recipe.device})[0] \
                if st.options.teacher == "dense" else None
            lm, _ = api.heal(lm, teacher=teacher, data=recipe.data, eval_data=recipe.test,
                             config=st.options.config, out_dir=folder / "heal-state",
                             train_samples=st.options.train_samples,
                             eval_samples=st.options.eval_samples)
    return lm
