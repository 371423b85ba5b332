"""The built-in sparsity methods, one module each; importing this package registers them
in :data:`prunelab.pruning.base.METHODS`."""

from __future__ import annotations

from prunelab.pruning.sparsity.methods.magnitude import Magnitude
from prunelab.pruning.sparsity.methods.qk_wanda import QKWanda
from prunelab.pruning.sparsity.methods.rose import Rose
from prunelab.pruning.sparsity.methods.sparsegpt import SparseGPT
from prunelab.pruning.sparsity.methods.wanda import Wanda

__all__ = ["Magnitude", "QKWanda", "Rose", "SparseGPT", "Wanda"]
