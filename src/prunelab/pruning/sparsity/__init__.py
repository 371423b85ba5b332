"""Unstructured and N:M sparsity: masks, importance scores, SparseGPT / ROSE weight updates
and per-block sparsity allocation (pure tensor maths; no model code, no hooks).

Weights are ``[d_out, d_in]``; calibration statistics (column norms, Hessians) come
precomputed. The registered methods (configs and their hooks) live in
:mod:`prunelab.pruning.sparsity.methods`, one module each.
"""

from __future__ import annotations

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=("config", "methods"))

from prunelab.pruning.allocation import (
    outlier_ratio,
    owl,
    pals,
    ramp,
    rescale_to_target,
    uniform,
)
from prunelab.pruning.sparsity.masks import (
    achieved_sparsity,
    nm_mask,
    parse_pattern,
    unstructured_mask,
)
from prunelab.pruning.sparsity.rose import rose_permutation, rose_prune
from prunelab.pruning.sparsity.scores import (
    magnitude_scores,
    qk_wanda_causal_scores,
    qk_wanda_causal_stats,
    qk_wanda_scores,
    shared_budget_masks,
    wanda_scores,
)
from prunelab.pruning.sparsity.sparsegpt import hessian_blend, sparsegpt_prune

__all__ = [
    "achieved_sparsity",
    "hessian_blend",
    "magnitude_scores",
    "nm_mask",
    "outlier_ratio",
    "owl",
    "pals",
    "parse_pattern",
    "qk_wanda_causal_scores",
    "qk_wanda_causal_stats",
    "qk_wanda_scores",
    "ramp",
    "rescale_to_target",
    "rose_permutation",
    "rose_prune",
    "shared_budget_masks",
    "sparsegpt_prune",
    "uniform",
    "unstructured_mask",
    "wanda_scores",
]
