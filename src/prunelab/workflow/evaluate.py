"""One evaluation of a model the way recipes and comparisons do it: perplexity on held-out
windows, KL and top-1 agreement to the dense reference (its final hidden states cached
between models), prefill / decode speed, downstream tasks when the installed
:func:`prunelab.api.evaluate` takes ``tasks``, under an inference-time press on request."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from prunelab.errors import ConfigError


def tasks_supported() -> bool:
    from prunelab import api

    return "tasks" in inspect.signature(api.evaluate).parameters


def speed_of(lm) -> dict:
    """Prefill and decode tokens/s (:func:`prunelab.eval.speed.measure_speed`) with a
    prompt of 256 tokens, or half the model's positions when it has fewer."""
    from prunelab.eval.speed import measure_speed

    limit = getattr(lm.model.config, "max_position_embeddings", None) or 512
    return measure_speed(lm, prompt_len=min(256, int(limit) // 2),
                         decode_tokens=min(32, int(limit) // 4))


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
        from prunelab.registry import to_dict

        res["press"] = {**to_dict(opts.press), "context": opts.press_context}
    if opts.speed:
        res.update(speed_of(lm))
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

    with press(lm, opts.press, context=opts.press_context) as session:
        yield session


def task_scores(metrics: dict) -> dict[str, float]:
    """``{task: accuracy}`` from an evaluation's ``tasks`` entry (per task ``acc_norm``
    when there, else ``acc``, else the number itself)."""
    out: dict[str, float] = {}
    for name, v in (metrics.get("tasks") or {}).items():
        if isinstance(v, dict):
            v = v.get("acc_norm", v.get("acc"))
        if isinstance(v, (int, float)):
            out[name] = float(v)
    return out
