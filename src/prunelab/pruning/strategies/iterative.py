"""``iterative``: remove one block at a time, re-probing the shrunken model after each
removal (the probe is the Depth config's)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from prunelab.pruning.strategies.base import STRATEGIES, SelectJob, Strategy


@STRATEGIES.register("iterative")
@dataclass(frozen=True)
class Iterative(Strategy):
    """remove one block at a time, re-probing the shrunken model after each removal"""

    def choose(self, job: SelectJob) -> tuple[list[int], dict]:
        return iterative(job), {"strategy": "iterative", "probe": job.cfg.probe}


def iterative(job: SelectJob) -> list[int]:
    """Blocks removed one by one, each the lowest of a fresh probe of the model without the
    earlier ones (0-based, original numbering, sorted)."""
    from prunelab.models.loading import wrap
    from prunelab.probes import ProbeContext

    lm, ctx = job.lm, job.ctx
    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    work.offload_to = getattr(lm, "offload_to", None)  # the copy calibrates alike
    alive = list(range(lm.adapter.num_blocks))
    removed = []
    for step in range(job.n):
        sub = ctx if step == 0 else ProbeContext(work, ctx.input_ids,
                                                 batch_size=ctx.runner.batches[0].shape[0])
        values = job.run_probe(job.cfg.probe, sub, 1).layer_values()
        pick = min((i for i, v in enumerate(values) if v is not None), key=lambda i: values[i])
        removed.append(alive.pop(pick))
        work.adapter.delete_blocks([pick])
        if sub is not ctx:
            sub.close()
    return sorted(removed)
