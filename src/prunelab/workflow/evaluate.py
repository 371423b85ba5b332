"""One evaluation of a model the way recipes and comparisons do it: perplexity on held-out
windows, KL and top-1 agreement to the dense reference (its final hidden states cached
between models), prefill / decode speed, downstream tasks when the installed
:func:`prunelab.api.evaluate` takes ``tasks``, under an inference-time press on request."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from prunelab.errors import ConfigError
from prunelab.registry import to_dict


def tasks_supported() -> bool:
    from prunelab import api

    return "tasks" in inspect.signature(api.evaluate).parameters


def speed_of(lm, reference=None, rounds: int = 3) -> dict:
    """Prefill and decode tokens/s (:func:`prunelab.eval.speed.measure_speed`) with a
    prompt of 256 tokens, or half the model's positions when it has fewer; with a
    ``reference`` (the dense model), measured in ``rounds`` interleaved with it, with the
    ratios to it and their range (:func:`prunelab.eval.speed.speed_against`)."""
    from prunelab.eval.speed import measure_speed, speed_against

    limit = getattr(lm.model.config, "max_position_embeddings", None) or 512
    kw = dict(prompt_len=min(256, int(limit) // 2), decode_tokens=min(32, int(limit) // 4))
    if reference is None or reference is lm:
        return measure_speed(lm, **kw)
    return speed_against(lm, reference, rounds=rounds, **kw)


def evaluate_model(lm, opts, data: str, reference=None, reference_cache: dict | None = None,
                   seed: int = 0) -> dict[str, Any]:
    """Metrics of ``lm`` under ``opts`` (an :class:`~prunelab.workflow.stages
    .EvaluateStage`); ``reference``: the dense model (``None``: no KL)."""
    from prunelab import api

    kwargs: dict[str, Any] = dict(data=data, seqlen=opts.seqlen, samples=opts.samples,
                                  batch_size=opts.batch_size, reference=reference,
                                  reference_cache=reference_cache, seed=seed)
    if opts.tasks:
        if not tasks_supported():
            raise ConfigError("tasks needs api.evaluate(tasks=...), not in this install")
        kwargs["tasks"] = list(opts.tasks)
        if opts.limit is not None and "limit" in inspect.signature(api.evaluate).parameters:
            kwargs["limit"] = opts.limit
    with _pressed(lm, opts) as session:
        res = api.evaluate(lm, **kwargs)
    if session is not None:
        cont = opts.continuation()
        res["press"] = {**to_dict(opts.press), "context": (opts.seqlen - cont) / opts.seqlen,
                        "prompt": opts.seqlen - cont, "continuation": cont}
    if opts.speed:
        res.update(speed_of(lm, reference, getattr(opts, "speed_rounds", 3)))
    res.pop("data", None)
    res["nonzero_params"] = nonzero_params(lm.model)
    return res


def nonzero_params(model) -> int:
    """Parameters that are not exactly zero (tied tensors once): what unstructured
    sparsity keeps."""
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += int((p.detach() != 0).sum())
    return n


@contextlib.contextmanager
def _pressed(lm, opts):
    if opts.press is None:
        yield None
        return
    from prunelab.inference import press

    with press(lm, opts.press, continuation=opts.continuation()) as session:
        yield session


#: tasks whose lm-eval YAML reports ``acc_norm`` beside ``acc``: their headline score is
#: ``acc_norm`` (as on the Open LLM Leaderboard); every other task's (WinoGrande, BoolQ,
#: MMLU, LAMBADA, local JSONL tasks) is ``acc``.
NORM_HEADLINE = frozenset({"arc_easy", "arc_challenge", "hellaswag", "piqa", "openbookqa",
                           "sciq"})


def headline(task: str, scores: Any) -> float | None:
    """The headline accuracy of one task's scores (``acc_norm`` for
    :data:`NORM_HEADLINE` tasks, else ``acc``; a bare number is itself)."""
    if isinstance(scores, dict):
        first, second = ("acc_norm", "acc") if task in NORM_HEADLINE else ("acc", "acc_norm")
        v = scores.get(first)
        scores = v if v is not None else scores.get(second)
    if isinstance(scores, (int, float)) and not isinstance(scores, bool):
        return float(scores)
    return None


def task_scores(metrics: dict) -> dict[str, float]:
    """``{task: accuracy}`` from an evaluation's ``tasks`` entry (:func:`headline`)."""
    out: dict[str, float] = {}
    for name, v in (metrics.get("tasks") or {}).items():
        score = headline(name, v)
        if score is not None:
            out[name] = score
    return out


def zero_shot_average(metrics: dict) -> float | None:
    """The mean of the row's headline task accuracies (:func:`task_scores`; unweighted,
    one vote per task), ``None`` without tasks."""
    scores = list(task_scores(metrics).values())
    return sum(scores) / len(scores) if scores else None
