"""``iterative``: remove one block at a time, re-probing the shrunken model after each
removal (the probe is the Depth config's).

With ``recovery_in_loop`` the shrunken model is repaired (the Depth config's recovery,
fitted at every cut on the calibration windows towards the dense model's boundaries)
before it is probed again, so each step ranks the blocks of the model as it will be
applied. A step whose cuts the recovery cannot repair (e.g. ``foldable`` after block 0
went) probes the model unrepaired (recorded in ``how``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from prunelab.errors import UnsupportedOperationError
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext
from prunelab.pruning.depth.recovery import recover
from prunelab.pruning.depth.strategies.base import STRATEGIES, SelectJob, Strategy


@STRATEGIES.register("iterative")
@dataclass(frozen=True)
class Iterative(Strategy):
    """remove one block at a time, re-probing the shrunken model after each removal"""

    def choose(self, job: SelectJob) -> tuple[list[int], dict]:
        how = {"strategy": "iterative", "probe": job.cfg.probe}
        return iterative(job, how), how


def _work_copy(job: SelectJob, removed: list[int], how: dict):
    """A copy of the dense model without ``removed`` (original numbering), repaired when
    the config asks for recovery in the loop."""
    lm = job.lm
    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    work.offload_to = getattr(lm, "offload_to", None)  # the copy calibrates alike
    work.calib_dtype = getattr(lm, "calib_dtype", None)
    if removed:
        work.adapter.delete_blocks(sorted(removed))
    if removed and job.cfg.recovery_in_loop:
        try:
            recover(work, job.cfg, job.ctx, sorted(removed),
                    job.ctx.runner.batches[0].shape[0])
        except UnsupportedOperationError as exc:
            how.setdefault("unrepaired_steps", []).append(
                {"removed": sorted(removed), "why": str(exc)})
    return work


def iterative(job: SelectJob, how: dict | None = None) -> list[int]:
    """Blocks removed one by one, each the lowest of a fresh probe of the model without the
    earlier ones (0-based, original numbering, sorted). ``how`` gains the block
    evaluations of the probes (the recovery fits of ``recovery_in_loop`` excluded)."""
    how = {} if how is None else how
    lm, ctx = job.lm, job.ctx
    in_loop = job.cfg.recovery_in_loop
    work = None if in_loop else _work_copy(job, [], how)
    alive = list(range(lm.adapter.num_blocks))
    removed: list[int] = []
    evals = 0.0
    for step in range(job.n):
        if step and in_loop:
            work = _work_copy(job, removed, how)
        sub = ctx if step == 0 else ProbeContext(work, ctx.input_ids,
                                                 batch_size=ctx.runner.batches[0].shape[0])
        before = sub.block_evaluations if sub is ctx else 0.0
        values = job.run_probe(job.cfg.probe, sub, 1).layer_values()
        evals += sub.block_evaluations - before
        pick = min((i for i, v in enumerate(values) if v is not None), key=lambda i: values[i])
        removed.append(alive.pop(pick))
        if not in_loop:
            work.adapter.delete_blocks([pick])
        if sub is not ctx:
            sub.close()
    how["block_evaluations"] = evals
    if in_loop:
        how["recovery_in_loop"] = True
    return sorted(removed)
