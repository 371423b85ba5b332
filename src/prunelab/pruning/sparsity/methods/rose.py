"""ROSE (Su & Wang 2025, "ROSE: Reordered SparseGPT for More Accurate One-Shot Large
Language Models Pruning", arXiv:2510.06751): SparseGPT on columns reordered by their
Wanda pre-pruning loss when the layer is "columnar" (maths in
:mod:`prunelab.pruning.sparsity.rose`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prunelab.calib.stats import Gram, SumSquares
from prunelab.pruning.base import METHODS
from prunelab.pruning.sparsity.config import find
from prunelab.pruning.sparsity.methods.sparsegpt import SparseGPT
from prunelab.pruning.sparsity.rose import rose_prune
from prunelab.registry import check_range


@METHODS.register("rose")
@dataclass(frozen=True)
class Rose(SparseGPT):
    """ROSE: SparseGPT on columns reordered by Wanda pre-pruning loss when the layer is
    "columnar" (block-loss spread > ``threshold``); ``reorder=False`` is SparseGPT."""

    reorder: bool = field(default=True, metadata={
        "help": "rose: no reordering", "flag": "--no-reorder", "negate": True})
    threshold: float = field(default=0.5, metadata={
        "help": "rose: a layer is columnar when its block-loss spread exceeds this"})

    def __post_init__(self):
        super().__post_init__()
        check_range("threshold", self.threshold)  # a finite number (nan / inf refused)

    def accumulators(self):
        return lambda name: [SumSquares(), Gram(torch.float32)]

    def prune_weight(self, w, accs, sparsity):
        return rose_prune(w, self.hessian(accs), find(accs, SumSquares).sum_sq, sparsity,
                          reorder=self.reorder, threshold=self.threshold,
                          **self.sparsegpt_kwargs())[0]

    def joint_key(self, w, accs):
        return None  # the column order is chosen per linear
