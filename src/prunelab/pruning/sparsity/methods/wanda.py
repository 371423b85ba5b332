"""Wanda (Sun et al. 2024, "A Simple and Effective Pruning Approach for Large Language
Models"): score ``|W_ij| * ||X_j||``, compared per output row; no weight update."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.calib.stats import SumSquares
from prunelab.errors import ConfigError
from prunelab.pruning.base import METHODS
from prunelab.pruning.sparsity.config import SparsityConfig, find
from prunelab.pruning.sparsity.scores import wanda_scores


def wanda_weight(cfg: SparsityConfig, w: torch.Tensor, accs: list,
                 sparsity: float) -> torch.Tensor:
    """``w`` ``[d_out, d_in]`` with the lowest Wanda scores zeroed (the ``SumSquares`` of
    ``accs`` gives ``||X_j||^2``; ``cfg`` the pattern and comparison group)."""
    ss = find(accs, SumSquares)
    keep = cfg.keep_mask(wanda_scores(w, ss.sum_sq.to(w.device)), sparsity)
    return w * keep.to(w.device)


@METHODS.register("wanda")
@dataclass(frozen=True)
class Wanda(SparsityConfig):
    """Wanda (Sun et al. 2024): |W| * ||X_j||, per output row; no weight update.

    Defaults to ``within_block="dense"`` (every linear's norms from the dense block) and
    ``propagate="auto"``: the dense outputs feed the next block for an unstructured target
    (one dense pass in all), the pruned outputs for an N:M pattern (one more pass per
    block). Measured on SmolLM2-135M (64 x 512 calibration, 32 x 512 test tokens,
    benchmarks/sparsity_vs_llmcompressor.py): at 50 % test ppl 35.29 with dense
    propagation, 35.85 with pruned (sequential order with pruned propagation: 36.46); at
    2:4 137.39 with pruned propagation, 140.43 with dense (146.7 sequential; llm-compressor,
    which propagates the pruned outputs: 35.82 and 139.99)."""

    within_block: str = "dense"
    propagate: str = "auto"

    def __post_init__(self):
        if self.propagate not in ("auto", "modified", "dense"):
            raise ConfigError(f"propagate must be auto, modified or dense, got "
                              f"{self.propagate!r}")
        if self.propagate == "auto":
            object.__setattr__(self, "propagate", "modified" if self.pattern else "dense")
        super().__post_init__()

    def accumulators(self):
        return lambda name: [SumSquares()]

    def prune_weight(self, w, accs, sparsity):
        return wanda_weight(self, w, accs, sparsity)
