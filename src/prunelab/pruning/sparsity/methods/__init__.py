"""The built-in sparsity methods, one module each. Importing this package imports every
module in it, so each registers itself in :data:`prunelab.pruning.base.METHODS`: a new
built-in method is one new file here (a user's method registers from anywhere)."""

from __future__ import annotations

import importlib
import pkgutil

# registration order is the order the CLI lists them in
# isort: off
from prunelab.pruning.sparsity.methods.magnitude import Magnitude
from prunelab.pruning.sparsity.methods.wanda import Wanda
from prunelab.pruning.sparsity.methods.sparsegpt import SparseGPT
from prunelab.pruning.sparsity.methods.rose import Rose
from prunelab.pruning.sparsity.methods.qk_wanda import QKWanda
# isort: on

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["Magnitude", "QKWanda", "Rose", "SparseGPT", "Wanda"]
