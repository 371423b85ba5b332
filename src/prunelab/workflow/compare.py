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

import importlib.util
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

from prunelab._version import __version__
from prunelab.errors import ConfigError, OutputExistsError
from prunelab.io.files import write_json
from prunelab.registry import to_dict
from prunelab.workflow import evaluate as evaluation
from prunelab.workflow.budget import (
    Budget,
    achieved,
    apply_budget,
    parse_budget,
    parse_budgets,
    sizes,
)
from prunelab.workflow.evaluate import tasks_supported
from prunelab.workflow.executor import Point, run_points
from prunelab.workflow.leaderboard import write_study
from prunelab.workflow.recipe import load_recipe, parse_recipe
from prunelab.workflow.run import heal_eval_data
from prunelab.workflow.stages import EvaluateStage, parse_stage

_REFS: dict[tuple, Any] = {}  # per process: (model, dtype, device) -> (dense lm, cache)


def method_stages(item: str, budget: Budget, dense: dict) -> tuple[str, list[dict]]:
    """``(label, stages)`` of one ``--methods`` item: the stages as recipe stage dicts
    with the budget applied to the first prune stage."""
    from prunelab.pruning import METHODS
    if item.endswith((".yaml", ".yml")) or Path(item).is_file():
        recipe = load_recipe(item)
        label = Path(item).stem
        stages = [s for s in recipe.stages if s.kind in ("prune", "heal")]
        if not any(s.kind == "prune" for s in stages):
            raise ConfigError(f"--methods {item}: the recipe has no prune stage")
    else:
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
    return key if key.strip(".") else "method"


def _budgets(budget) -> list[Budget]:
    if isinstance(budget, Budget):
        return [parse_budget(budget)]
    if isinstance(budget, (list, tuple)):
        out = [b if isinstance(b, Budget) else parse_budget(b) for b in budget]
        if not out or len(set(out)) != len(out) or len({b.kind for b in out}) != 1:
            raise ConfigError("--budget: give one or more distinct budgets of one kind")
        return out
    return parse_budgets(budget)


def budget_text(budgets: list[Budget]) -> str:
    """``remove-blocks:2,4,6`` (the CLI spelling of a list; one budget as :class:`Budget`)."""
    return budgets[0].kind + ":" + ",".join(str(b).partition(":")[2] for b in budgets)


def compare(model: str, methods: list[str], budget: str | Budget | list, out: str | Path, *,
            calib: str = "wiki-vital:calib", test: str = "wiki-vital:test",
            samples: int = 32, seqlen: int = 256, batch_size: int = 8,
            test_samples: int = 16, test_seqlen: int = 256, seed: int = 0,
            speed: bool = True, tasks: tuple = (), limit: int | None = None,
            dtype: str = "float32", device: str = "cpu", ray: str | None = None,
            cpus_per_point: float = 1.0, gpus_per_point: float = 0.0,
            overwrite: bool = False) -> dict:
    """Run ``methods`` at ``budget`` on ``model``; returns ``{"rows": [...], "dense":
    {...}, **paths}`` (rows in the order of ``methods``, dense first).

    ``budget``: one budget, or several of one kind (``remove-blocks:2,4,6`` or a list of
    :class:`Budget`): every method runs at every budget (points ``METHOD.KIND=VALUE``),
    the rows are ``(method, budget)`` in the order of ``methods`` then budgets (each
    with a ``budget`` entry), and ``budget_curves.png`` draws test perplexity against
    the budget, one line per method."""
    from prunelab import api
    budgets = _budgets(budget)
    many = len(budgets) > 1
    if ray is not None:
        if importlib.util.find_spec("prunelab.workflow.ray_backend") is None:
            raise ConfigError("--ray needs prunelab.workflow.ray_backend, not in this "
                              "install; run without --ray")
    if not methods:
        raise ConfigError("--methods names at least one method")
    if tasks and not tasks_supported():
        raise ConfigError("--tasks needs downstream-task evaluation (api.evaluate(tasks=...)),"
                          " not in this install")
    dense_lm = api.load(model, dtype=dtype, device="cpu")
    dense = sizes(dense_lm)
    base = _base(model, dense, dtype=dtype, device=device, test=test, seed=seed, calib=calib,
                 samples=samples, seqlen=seqlen, batch_size=batch_size,
                 test_samples=test_samples, test_seqlen=test_seqlen, speed=speed,
                 tasks=tasks, limit=limit)
    open_comparison(Path(out), dense_lm, base, overwrite)
    del dense_lm
    points = [Point("dense", {**base, "label": "dense", "stages": [],
                              "budget": str(budgets[0])})]
    for item in methods:
        for b in budgets:
            label, stages = method_stages(item, b, dense)
            key = f"{_key(label)}.{b.kind}={str(b).partition(':')[2]}" if many else _key(label)
            points.append(Point(key, {**base, "label": label, "stages": stages,
                                      "budget": str(b)}))
    out = Path(out)
    results = run_points(points, compare_point, out, ray=ray, cpus_per_point=cpus_per_point,
                         gpus_per_point=gpus_per_point)
    if many:
        results = [results[0]] + [{**r, "budget": p.payload["budget"]}
                                  for p, r in zip(points[1:], results[1:], strict=True)]
    shown = budget_text(budgets) if many else str(budgets[0])
    cmd = (f"prunelab compare --model {model} --methods {','.join(methods)} --budget "
           f"{shown} --calib {calib} --test {test} --out {out}")
    paths = write_study(out, results, dense=results[0], title=f"compare {model} at {shown}",
                        commands=[cmd], summary={"model": model, "budget": shown,
                                                 "calibration": calib, "test": test},
                        curves=budgets[0].kind if many else None)
    return {"rows": results, "dense": results[0], **paths}


def open_comparison(out: Path, lm, base: dict, overwrite: bool) -> None:
    """Check ``OUT/compare.json`` (the comparison's fingerprint: the dense model's config
    and weights, the dtype and every setting a point shares) before any point is reused.
    Another model or other settings: one-line :class:`~prunelab.errors.ResumeMismatchError`,
    or with ``overwrite`` the comparison's points are discarded. ``points/`` without
    ``compare.json`` (not a comparison of this prunelab) is refused unless ``overwrite``."""
    from prunelab.io.fingerprint import FORMAT, check_match, model_part

    marker = out / MARKER
    options = {k: v for k, v in base.items() if k not in ("model", "dense_sizes")}
    fp = {"format": FORMAT, "prunelab": __version__, "model": model_part(lm),
          "dtype": str(lm.dtype).replace("torch.", ""),
          "options": json.loads(json.dumps(options, default=list))}
    if marker.is_file():
        try:
            stored = json.loads(marker.read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            stored = None
        if check_match(marker, stored, fp, overwrite):
            return
    elif (out / "points").exists() and not overwrite:
        raise OutputExistsError(f"{out / 'points'} exists and {out} holds no comparison of "
                                f"prunelab ({MARKER}); pass --overwrite to start afresh")
    if (out / "points").is_dir():  # a stale comparison of prunelab's, overwrite given
        shutil.rmtree(out / "points")
    write_json(marker, {"format": "prunelab-compare/1", "fingerprint": fp}, overwrite=True)


MARKER = "compare.json"


def _base(model: str, dense: dict, *, dtype, device, test, seed, calib, samples, seqlen,
          batch_size, test_samples, test_seqlen, speed, tasks, limit) -> dict:
    """What every point of a comparison shares (its payload without label and stages)."""
    ev = EvaluateStage(samples=test_samples, seqlen=test_seqlen, batch_size=min(batch_size, 8),
                       speed=speed, tasks=tuple(tasks), limit=limit)
    return {"model": model, "dtype": dtype, "device": device, "test": test, "seed": seed,
            "calib": {"data": calib, "samples": samples, "seqlen": seqlen,
                      "batch_size": batch_size},
            "eval": {k: getattr(ev, k) for k in ("samples", "seqlen", "batch_size", "speed",
                                                 "tasks", "limit")},
            "dense_sizes": dense}


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
    metrics = evaluation.evaluate_model(lm, ev, data=p["test"], reference=None if not p["stages"]
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
                if st.options.teacher == "dense" and st.options.config.needs_teacher else None
            lm, _ = api.heal(lm, teacher=teacher, data=st.options.data or recipe.data,
                             eval_data=heal_eval_data(st.options, recipe.test),
                             config=st.options.config, out_dir=folder / "heal-state",
                             train_samples=st.options.train_samples,
                             eval_samples=st.options.eval_samples)
    return lm
