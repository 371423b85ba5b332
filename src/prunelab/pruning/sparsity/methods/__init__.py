"""The built-in sparsity methods, one module each. Importing this package imports every
module in it, so each registers itself in :data:`prunelab.pruning.base.METHODS`: a new
built-in method is one new file here (a user's method registers from anywhere)."""

from __future__ import annotations

from prunelab.registry import import_submodules

# registration order = the order the CLI lists them in (then the other modules by name)
import_submodules(__name__, first=("magnitude", "wanda", "sparsegpt", "rose", "qk_wanda"))

from prunelab.pruning.sparsity.methods.magnitude import Magnitude
from prunelab.pruning.sparsity.methods.qk_wanda import QKWanda
from prunelab.pruning.sparsity.methods.rose import Rose
from prunelab.pruning.sparsity.methods.sparsegpt import SparseGPT
from prunelab.pruning.sparsity.methods.wanda import Wanda

__all__ = ["Magnitude", "QKWanda", "Rose", "SparseGPT", "Wanda"]
