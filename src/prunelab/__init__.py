"""prunelab: measure where a transformer is redundant and remove that redundancy.

Public verbs: :func:`load`, :func:`info`, :func:`probe`, :func:`prune`, :func:`evaluate`,
:func:`save`.
"""

__version__ = "0.1.0"

from prunelab.pruning import (  # noqa: E402
    Depth,
    Magnitude,
    Owl,
    Pals,
    QKWanda,
    Ramp,
    Rose,
    SparseGPT,
    SparsityConfig,
    Uniform,
    Wanda,
    Width,
)

# isort: split
from prunelab.api import evaluate, info, load, probe, prune, save  # noqa: E402
from prunelab.calib.runner import BlockRunner, StateStore  # noqa: E402
from prunelab.errors import PrunelabError  # noqa: E402
from prunelab.models.adapters import get_adapter  # noqa: E402
from prunelab.models.loading import LoadedModel, wrap  # noqa: E402

__all__ = ["BlockRunner", "Depth", "LoadedModel", "Magnitude", "Owl", "Pals", "PrunelabError",
           "QKWanda", "Ramp", "Rose", "SparseGPT", "SparsityConfig", "StateStore", "Uniform",
           "Wanda", "Width", "evaluate", "get_adapter", "info", "load", "probe", "prune",
           "save", "wrap", "__version__"]
