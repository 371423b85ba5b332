"""Magnitude pruning (Han et al. 2015, "Learning both Weights and Connections for
Efficient Neural Networks"): prune the smallest ``|W_ij|``; no calibration statistics."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.pruning.base import METHODS
from prunelab.pruning.sparsity.config import SparsityConfig
from prunelab.pruning.sparsity.scores import magnitude_scores


@METHODS.register("magnitude")
@dataclass(frozen=True)
class Magnitude(SparsityConfig):
    """|W| per row (or per layer); needs no calibration statistics."""

    def prune_weight(self, w: torch.Tensor, accs, sparsity: float) -> torch.Tensor:
        return w * self.keep_mask(magnitude_scores(w), sparsity).to(w.device)
