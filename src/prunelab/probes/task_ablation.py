"""Leave-one-out by a task metric: rank blocks by how much removing each one costs on a
task (``probe --probe leave-one-out --metric wer``).

The Whisper-encoder study this follows prunes the encoder by the leave-one-layer-out
change in word error rate (6 layers, 18.5 % of the encoder, then distils the pruned
encoder on unlabelled speech). Here each block of the adapter's stack is removed in turn
(the model itself, restored afterwards), the registered task metric
(:mod:`prunelab.eval.task_metric`) is measured on the whole model, and the score is the
metric's loss increase: ``value = loss(without i) - loss(dense)`` (WER: the WER change;
a higher-is-better metric is negated), so ascending = removable, as for the KL version.
"""

from __future__ import annotations

import contextlib

from prunelab.eval.task_metric import make_task_metric
from prunelab.log import progress
from prunelab.models.adapters import _get, _set


@contextlib.contextmanager
def without_blocks(adapter, drop: list[int]):
    """``adapter``'s model with blocks ``drop`` removed, restored on exit (the same block
    objects, config count and ``layer_idx`` values)."""
    old = adapter.blocks()
    field = adapter.spec.layers_field
    count = getattr(adapter.config, field, None)
    idx = [(m, m.layer_idx) for m in old.modules() if hasattr(m, "layer_idx")]
    try:
        adapter.delete_blocks(drop)
        yield adapter
    finally:
        _set(adapter.base, adapter.spec.blocks, old)
        if count is not None:
            setattr(adapter.config, field, count)
        for m, v in idx:
            m.layer_idx = v
    assert _get(adapter.base, adapter.spec.blocks) is old


def leave_one_out_by_metric(cfg, ctx, resume=None, on_progress=None) -> list[dict]:
    """Scores ``{"layers": [i], "value": loss change, "metric": value without i,
    "dense": dense value}`` for every block of ``ctx``'s stack."""
    opts = {"data": cfg.metric_data} if cfg.metric_data else {}
    metric = make_task_metric(cfg.metric, ctx.lm, **opts)
    n = ctx.adapter.num_blocks
    done = {s["layers"][0]: s for s in (resume or {}).get("scores", [])}
    scores = [done[i] for i in sorted(done)]
    dense = scores[0]["dense"] if scores else metric(ctx.lm)
    for i in progress([i for i in range(n) if i not in done], desc=f"leave-one-out "
                      f"({cfg.metric})"):
        with without_blocks(ctx.adapter, [i]):
            value = metric(ctx.lm)
        scores.append({"layers": [i], "value": metric.loss(value) - metric.loss(dense),
                       "metric": value, "dense": dense, "metric_name": cfg.metric})
        if on_progress is not None:
            on_progress(sorted(scores, key=lambda s: s["layers"]))
    return sorted(scores, key=lambda s: s["layers"])
