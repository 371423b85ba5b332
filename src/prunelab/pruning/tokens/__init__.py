"""Patch-token pruning for vision transformers (TAP-Path style), for real: the blocks after
a pruning layer run on fewer tokens. See :mod:`prunelab.pruning.tokens.runtime` (the
pruned forward) and :mod:`prunelab.pruning.tokens.head` (multi-depth feature recovery and
a gated task head)."""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__)

from prunelab.pruning.tokens.checkpoint import TokenPruner
from prunelab.pruning.tokens.evaluate import evaluate_token_pruning
from prunelab.pruning.tokens.head import (
    GatedDepthHead,
    depth_features,
    lfw_gated_accuracy,
    train_gated_head,
)
from prunelab.pruning.tokens.pruner import TokenPruningPruner, install_token_pruning
from prunelab.pruning.tokens.runtime import TokenPrunedEncoder, TokenPruning, cls_attention

__all__ = ["GatedDepthHead", "TokenPrunedEncoder", "TokenPruner", "TokenPruning",
           "TokenPruningPruner", "cls_attention",
           "depth_features", "evaluate_token_pruning", "lfw_gated_accuracy",
           "install_token_pruning", "train_gated_head"]
