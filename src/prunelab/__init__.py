"""prunelab: measure where a transformer is redundant and remove that redundancy.

Public verbs: :func:`load`, :func:`info`, :func:`probe`, :func:`prune`, :func:`evaluate`,
:func:`save`.
"""

__version__ = "0.1.0"

from prunelab.inference import (  # noqa: E402
    H2O,
    DecayEviction,
    EntroPrefill,
    LazyLLM,
    SnapKV,
    StreamingLLM,
    press,
)
from prunelab.pruning import (  # noqa: E402  # noqa: E402
    Beam,
    Blend,
    Boundary,
    Depth,
    Foldable,
    Gates,
    Ghost,
    Iterative,
    LastN,
    Lra,
    Magnitude,
    NoAdjacent,
    NoRecovery,
    OneShot,
    Owl,
    Pals,
    PrunePath,
    QKWanda,
    Ramp,
    Random,
    Rose,
    Sleb,
    Span,
    SparseGPT,
    SparsityConfig,
    Uniform,
    Wanda,
    Width,
)
from prunelab.pruning.elastic import ElasticRanking, elastic  # noqa: E402
from prunelab.pruning.width import (  # noqa: E402
    AblationKL,
    CoCurve,
    Flap,
    MagnitudeProfile,
    Putri,
    WandaSP,
)

# isort: split
from prunelab.api import evaluate, info, load, probe, prune, save  # noqa: E402
from prunelab.calib.runner import BlockRunner, StateStore  # noqa: E402
from prunelab.errors import PrunelabError  # noqa: E402
from prunelab.models.adapters import get_adapter  # noqa: E402
from prunelab.models.loading import LoadedModel, wrap  # noqa: E402

__all__ = ["AblationKL", "Beam", "Blend", "BlockRunner", "Boundary", "CoCurve", "Depth",
           "DecayEviction", "ElasticRanking", "EntroPrefill", "Flap", "Gates", "H2O",
           "LazyLLM", "PrunePath", "Sleb", "SnapKV", "StreamingLLM", "press",
           "Foldable", "Ghost", "Iterative", "LastN", "LoadedModel", "Lra", "Magnitude",
           "MagnitudeProfile", "NoAdjacent", "NoRecovery", "OneShot", "Owl", "Pals",
           "PrunelabError", "Putri", "QKWanda", "Ramp", "Random", "Rose", "Span", "SparseGPT",
           "SparsityConfig", "StateStore", "Uniform", "Wanda", "WandaSP", "Width", "evaluate",
           "get_adapter", "info", "load", "probe", "prune", "elastic", "save", "wrap",
           "__version__"]
