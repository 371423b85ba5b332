"""``validation``: choose the blocks to remove by a task metric on a validation split.

TAP-Path's validation-driven block selection (a pathology ViT restructured to 24 of its 32
blocks, with 70 % of the patch tokens kept, for 35 % less compute): every candidate removal
set is scored by the downstream task metric of the model without those blocks, not by a
proxy of the hidden states. Greedy (``width=1``) adds one block per step, the one whose
removal keeps the metric best; beam search (``width>1``) keeps the ``width`` best sets of
each size. Ties (coarse metrics such as an accuracy on 50 images) are broken by the main
probe's per-block removability summed over the set (lower first), then by the set itself.

The metric is any registered task metric (:mod:`prunelab.eval.task_metric`), bound once
to the dense model: ``lfw-acc`` (its default split is the probe split, so the test split
stays untouched), ``embed-cos``, ``knn-agree`` for vision encoders; ``perplexity`` for causal
LMs (when no module registers it: the perplexity of the calibration windows).
``metric="auto"`` picks ``embed-cos`` for vision models (``lfw-acc`` saturates at 1.0 on
the small LFW subset: every candidate ties, measured) and ``perplexity`` otherwise. Each
candidate is evaluated on the model itself with the blocks taken out temporarily (no
copy), restored afterwards.

**Recovery in the loop** (``Depth(recovery_in_loop=True, recovery=...)``): each candidate is
also scored after its closed-form recovery, fitted exactly as the applied model will be
(:func:`prunelab.pruning.depth.recovery.recover` on a copy of the model without the candidate's
blocks, on the calibration windows), so the search picks the blocks that *recover* best.
Least squares at the cut does not maximise the task metric, and can lower it: a candidate's
value is the better of its raw and repaired scores, and the chosen set is repaired only when
its repair helped (``how["repaired"]``, ``how["repair_spans"]``, used by the applied model).
Each candidate then costs one model copy, one recovery fit (the calibration windows through
the blocks up to the last cut) and a second metric evaluation.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.perplexity import score_windows
from prunelab.eval.task_metric import TASK_METRICS, TaskMetric, make_task_metric
from prunelab.log import progress
from prunelab.models.adapters import _set
from prunelab.models.loading import wrap
from prunelab.pruning.depth.recovery import recover
from prunelab.pruning.depth.selection import contiguous_spans
from prunelab.pruning.depth.strategies.base import STRATEGIES, SelectJob, Strategy
from prunelab.registry import check_range


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


@STRATEGIES.register("validation")
@dataclass(frozen=True)
class Validation(Strategy):
    """greedy / beam search over blocks scored by a task metric on a validation split"""

    metric: str = field(default="auto", metadata={
        "cli": "val_metric", "help": "validation: task metric (lfw-acc, embed-cos, "
        "knn-agree, perplexity...; auto: embed-cos for vision, perplexity for text)"})
    width: int = field(default=1, metadata={"cli": "val_width",
                                            "help": "validation: beam width (1 = greedy)"})
    options: tuple = field(default=(), metadata={
        "cli": "val_options", "help": "validation: metric options KEY=VALUE"})

    def __post_init__(self):
        check_range("validation width", self.width, 1, None, integer=True)
        opts = tuple(self.options.split(",")) if isinstance(self.options, str) \
            else tuple(self.options)
        for item in opts:
            if "=" not in item:
                raise ConfigError(f"validation metric options take KEY=VALUE, got {item!r}")
        object.__setattr__(self, "options", opts)

    def metric_name(self, lm) -> str:
        if self.metric != "auto":
            return self.metric
        return "embed-cos" if getattr(lm.adapter, "is_vision", False) else "perplexity"

    def choose(self, job: SelectJob) -> tuple[list[int], dict]:
        name = self.metric_name(job.lm)
        kwargs = {k: _parse_value(v) for k, v in (o.split("=", 1) for o in self.options)}
        metric = _bind_metric(name, job, kwargs)
        prior = job.result().layer_values() if job.cfg.probe else None
        repair = _repairer(job) if job.cfg.recovery_in_loop else None
        removed, how = validation_search(job.lm, metric, job.n, self.width, prior, name,
                                         repair=repair)
        if repair is not None:
            how["recovery_in_loop"] = True
            how["repair_spans"] = [list(sp) for sp in contiguous_spans(removed)] \
                if how["repaired"] else []
        return removed, how


def repaired_copy(lm, cfg, ctx, removed) -> object | None:
    """A copy of ``lm`` without blocks ``removed`` (0-based), repaired by ``cfg.recovery``
    on ``ctx``'s calibration windows as :func:`prunelab.pruning.depth.surgery.run_depth`
    repairs the applied model; ``None`` when the recovery cannot repair these cuts."""
    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    work.offload_to = getattr(lm, "offload_to", None)
    work.calib_dtype = getattr(lm, "calib_dtype", None)
    work.adapter.delete_blocks(sorted(removed))
    try:
        recover(work, cfg, ctx, sorted(removed), ctx.runner.batches[0].shape[0])
    except UnsupportedOperationError:
        return None
    return work


def _repairer(job: SelectJob):
    job.ctx.ensure_cached()  # the dense boundaries (targets) once, before the search
    return lambda cand: repaired_copy(job.lm, job.cfg, job.ctx, cand)


def _bind_metric(name: str, job: SelectJob, kwargs: dict):
    """The registered task metric ``name``; ``perplexity`` on a causal LM falls back, when
    no module registered it, to the perplexity of the calibration windows."""
    try:
        return make_task_metric(name, job.lm, **kwargs)
    except ConfigError:
        if name != "perplexity" or name in TASK_METRICS or job.ctx.encoder:
            raise

    ids, batch = job.ctx.input_ids, int(kwargs.get("batch_size", 8))
    return TaskMetric("perplexity", lambda m: score_windows(m, ids, batch_size=batch,
                                                            desc="validation")["perplexity"],
                      higher_is_better=False)


@contextlib.contextmanager
def blocks_removed(lm, drop):
    """``lm`` with blocks ``drop`` taken out inside the block, restored after (same
    module objects, config fields and layer indices)."""
    ad = lm.adapter
    original = ad.blocks()
    n = len(original)
    types = ad.layer_types()
    layers = getattr(ad.config, "num_hidden_layers", None)
    ad.delete_blocks(drop)
    try:
        yield lm
    finally:
        _set(ad.base, ad.spec.blocks, original)
        ad.reorder_blocks(list(range(n)))
        if types is not None:
            ad.config.layer_types = types
        if layers is not None:
            ad.config.num_hidden_layers = layers


def _score(lm, metric, cand, repair) -> tuple[float, float, bool]:
    """``(loss, raw loss, repaired)`` of removing ``cand``: with ``repair`` (``cand ->``
    repaired copy or ``None``) the better of the raw and the repaired model."""
    with blocks_removed(lm, cand):
        raw = metric.loss(metric(lm))
    fixed = repair(cand) if repair is not None else None
    if fixed is None:
        return raw, raw, False
    rep = metric.loss(metric(fixed))
    return (rep, raw, True) if rep < raw else (raw, raw, False)


def validation_search(lm, metric, n: int, width: int, prior=None, name: str = "",
                      repair=None) -> tuple[list[int], dict]:
    """Beam (greedy when ``width == 1``) search for ``n`` blocks whose removal keeps
    ``metric`` best; ``prior``: per-block probe values breaking ties (lower first);
    ``repair``: ``cand -> repaired model copy | None`` (recovery in the loop: each candidate
    valued by the better of its raw and repaired scores). Returns the sorted blocks and
    ``how`` (every step's best sets, values, values without repair and whether repaired)."""
    total = lm.adapter.num_blocks
    if n >= total:
        raise ConfigError(f"cannot remove {n} of {total} blocks")
    dense = metric(lm)

    def tie(s):
        return sum((prior[b] or 0.0) for b in s) if prior else 0.0

    def value(loss):
        return -loss if metric.higher_is_better else loss

    beam: list[tuple[float, tuple]] = [(metric.loss(dense), ())]
    steps, evaluations, info = [], 0, {}
    for step in range(n):
        scored: dict[tuple, float] = {}
        for _, base in beam:
            for b in progress([b for b in range(total) if b not in base],
                              desc=f"validation step {step + 1}"):
                cand = tuple(sorted(base + (b,)))
                if cand in scored:
                    continue
                loss, raw, fixed = _score(lm, metric, cand, repair)
                scored[cand], info[cand] = loss, (raw, fixed)
                evaluations += 1
        ranked = sorted(scored.items(), key=lambda kv: (kv[1], tie(kv[0]), kv[0]))
        beam = [(loss, s) for s, loss in ranked[:width]]
        steps.append({"best": [list(s) for _, s in beam],
                      "values": [value(loss) for loss, _ in beam]})
        if repair is not None:
            steps[-1]["values_without_recovery"] = [value(info[s][0]) for _, s in beam]
            steps[-1]["repaired"] = [info[s][1] for _, s in beam]
    how = {"strategy": "validation", "metric": name or metric.name, "width": width,
           "dense_value": dense, "evaluations": evaluations, "steps": steps,
           "value": steps[-1]["values"][0]}
    if repair is not None:
        how["repaired"] = steps[-1]["repaired"][0]
    return list(beam[0][1]), how
