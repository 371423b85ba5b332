"""Factorization: residual-stream slicing (SliceGPT, one global rotation,
sensitivity-aware), whitened low-rank factorization (SVD-LLM) and cross-layer shared
dictionaries (Basis Sharing and an optimized pairing), one config class per method on
:class:`~prunelab.pruning.factor.config.FactorConfig`."""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=("lowrank", "shared", "slicing"))

from prunelab.pruning.factor.config import FactorConfig, factor_methods, factorized_modules

__all__ = ["FactorConfig", "factor_methods", "factorized_modules"]
