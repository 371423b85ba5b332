"""Four methods added from outside prunelab: a sparsity method, a probe, a depth recovery
and a width score (in a project, one file each). Importing this module registers them;
`tests/test_examples.py` runs each through `prunelab.prune` / `prunelab.probe` and the CLI.
"""
from dataclasses import dataclass, field

import torch

from prunelab.calib.stats import SumSquares
from prunelab.errors import UnsupportedOperationError
from prunelab.probes import PROBES, ProbeResult
from prunelab.pruning import METHODS, SparsityConfig
from prunelab.pruning.depth.recoveries import RECOVERIES, Recovery
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, ColumnScore


# a sparsity method: |W| * ||X_j||^p, compared per row (or N:M) like Wanda
@METHODS.register("wanda-power")
@dataclass(frozen=True)
class WandaPower(SparsityConfig):
    """|W| times the input norm to the power p"""

    power: float = field(default=1.0, metadata={"help": "exponent of ||X_j||"})

    def accumulators(self):
        return lambda path: [SumSquares()]          # statistics gathered per linear

    def prune_weight(self, w, accs, sparsity):       # w: [d_out, d_in]
        norm = accs[0].sum_sq.to(w.device).sqrt()
        return w * self.keep_mask(w.abs() * norm ** self.power, sparsity)


# a probe: forward-free, one value per block (low = removable)
@PROBES.register("weight-norm", forward=False)
@dataclass(frozen=True)
class WeightNorm:
    """Frobenius norm of each block's parameters"""

    def run(self, ctx):
        scores = [{"layers": [i], "value": float(torch.cat(
            [p.detach().flatten() for p in ctx.adapter.block(i).parameters()]).norm())}
            for i in range(ctx.num_blocks)]
        return ProbeResult("weight-norm", {}, scores, kind="layer", num_blocks=ctx.num_blocks)


# a depth recovery: add the mean residual change of the removed span after the cut
@RECOVERIES.register("mean-shift")
@dataclass(frozen=True)
class MeanShift(Recovery):
    """adds the dense model's mean change over the removed span"""

    def at_block(self, runner, index, inputs, targets):
        outs = runner.run_block(index, inputs)
        pairs = zip(outs, targets, strict=True)
        shift = sum((y - x).double().mean((0, 1)) for x, y in pairs) / len(outs)
        bias = runner.adapter.mlp_projections(index)["down"].bias
        if bias is None:
            raise UnsupportedOperationError("mean-shift needs a bias on the down projection")
        with torch.no_grad():
            bias += shift.to(bias.dtype)
        return {}


# a width score: the L2 norm of each consumer column
@WIDTH_SCORES.register("column-norm")
@dataclass(frozen=True)
class ColumnNorm(ColumnScore):
    """L2 norm of each consumer input column"""

    def columns(self, w, accs, job):
        return w.double().norm(dim=0)
