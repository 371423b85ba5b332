"""prunelab: measure where a transformer is redundant and remove that redundancy.

Public verbs: :func:`load`, :func:`info`, :func:`probe`, :func:`prune`, :func:`evaluate`,
:func:`save`.

The names below are exposed lazily (PEP 562): ``import prunelab`` and ``import prunelab.cli``
load neither torch nor transformers; ``prunelab.Wanda`` imports its module on first use.
"""

from __future__ import annotations

import importlib

from prunelab._version import __version__  # noqa: F401 - public

# public name -> the module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    **dict.fromkeys((
        'DecayEviction', 'EntroPrefill', 'ExpectedAttention', 'H2O', 'KNorm', 'LazyLLM',
        'SnapKV', 'StreamingLLM', 'TOVA', 'press',
    ), "prunelab.inference"),
    **dict.fromkeys((
        'Beam', 'Blend', 'Boundary', 'Depth', 'Foldable', 'Gates', 'Ghost', 'Iterative',
        'LastN', 'Lra', 'Magnitude', 'NoAdjacent', 'NoRecovery', 'OneShot', 'Owl',
        'Pals', 'PrunePath', 'QKWanda', 'Ramp', 'Random', 'Rose', 'Sleb', 'Span',
        'SparseGPT', 'SparsityConfig', 'Uniform', 'Wanda', 'Width',
    ), "prunelab.pruning"),
    **dict.fromkeys((
        'ElasticRanking', 'elastic',
    ), "prunelab.pruning.width.elastic"),
    **dict.fromkeys((
        'AblationKL', 'CoCurve', 'Flap', 'MagnitudeProfile', 'Putri', 'WandaSP',
    ), "prunelab.pruning.width"),
    **dict.fromkeys((
        'evaluate', 'info', 'load', 'probe', 'prune', 'save',
    ), "prunelab.api"),
    **dict.fromkeys((
        'BlockRunner', 'StateStore',
    ), "prunelab.calib.runner"),
    **dict.fromkeys((
        'PrunelabError',
    ), "prunelab.errors"),
    **dict.fromkeys((
        'get_adapter',
    ), "prunelab.models.adapters"),
    **dict.fromkeys((
        'LoadedModel', 'wrap',
    ), "prunelab.models.loading"),
}

__all__ = sorted([*_LAZY, "__version__"])


#: sub-packages reachable as attributes (``prunelab.probes.Interchange``) without an import
_SUBPACKAGES = ("api", "calib", "checkpoint", "cli", "data", "eval", "heal", "inference", "io",
                "models", "probes", "pruning", "report", "train", "workflow")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"prunelab.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'prunelab' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBPACKAGES})
