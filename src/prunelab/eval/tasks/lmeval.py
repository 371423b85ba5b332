"""lm-evaluation-harness backend: ``--tasks lm-eval:NAME`` runs lm-eval's own task NAME on
the loaded model (``HFLM`` wrapping the in-memory model and tokenizer), when ``lm-eval``
is installed (``pip install 'prunelab[tasks]'``) and the task's data is reachable (hub or
local cache). The offline paths (embedded tasks, JSONL) need neither."""

from __future__ import annotations

from prunelab.errors import ConfigError

_KEYS = ("acc", "acc_norm", "perplexity", "word_perplexity", "exact_match")


def hflm(lm, batch_size: int = 1):
    """lm-eval's ``HFLM`` over a prunelab LoadedModel (no copy, no download)."""
    try:
        from lm_eval.models.huggingface import HFLM
    except ModuleNotFoundError:
        raise ConfigError("lm-eval:TASK needs lm-eval: pip install 'prunelab[tasks]'") from None
    return HFLM(pretrained=lm.model, tokenizer=lm.tokenizer, batch_size=batch_size,
                device=str(lm.device))


def _flatten(metrics: dict) -> dict:
    out = {}
    for key, value in metrics.items():
        name, _, _filter = key.partition(",")
        base = name.removesuffix("_stderr")
        if base in _KEYS and isinstance(value, (int, float)):
            out[name] = float(value)
    return out


def run_lm_eval(lm, task: str, limit: int | None) -> dict:
    """lm-eval's metrics for ``task`` (``acc``, ``acc_norm``, their ``_stderr``...)."""
    model = hflm(lm)
    from lm_eval import simple_evaluate

    try:
        res = simple_evaluate(model=model, tasks=[task], limit=limit, num_fewshot=0,
                              log_samples=False, bootstrap_iters=0)
    except Exception as exc:  # lm-eval raises many kinds (hub offline, unknown task)
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"lm-eval task {task!r} failed: {msg[:200]}") from None
    per_task = res["results"]
    metrics = per_task.get(task) or next(iter(per_task.values()))
    out = _flatten(metrics)
    out.update(source="lm-eval", n=int(res.get("n-samples", {}).get(task, {}).get(
        "effective", 0)) or None)
    return out
