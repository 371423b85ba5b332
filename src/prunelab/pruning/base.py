"""The contract of the pruning verb: a method config, its registered :class:`Pruner`, and
the one report type.

``prunelab.prune(lm, config, data)`` finds the pruner registered for ``type(config)`` (or
its nearest base class), calls :meth:`Pruner.precheck` before any tokenisation or
calibration, then :meth:`Pruner.run`, which prunes in place and returns its own part of
the report (a :class:`MethodReport`). The wrapper (:func:`prunelab.api.prune`) adds what
every method shares -- timing, sizes before and after, the calibration data, the config --
into a :class:`PruneReport`, and records the operation in the model's history (the
manifest rebuilds the config from it with :func:`config_from_dict`).

Adding a family of methods: register its config class in :data:`METHODS` under a name and
its pruner in :data:`PRUNERS` under the config class::

    @METHODS.register("my-depth")
    @dataclass(frozen=True)
    class MyDepth:
        remove: int = 1

    @PRUNERS.register(MyDepth)
    class MyDepthPruner(Pruner):
        operation = "prune-depth"
        def run(self, lm, config, input_ids, *, batch_size):
            lm.adapter.delete_blocks(list(range(config.remove)))
            return DictReport({"removed_blocks": list(range(config.remove))})
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prunelab.errors import UnsupportedOperationError
from prunelab.models.custom import custom_modules
from prunelab.registry import Registry, to_dict

#: Every pruning config class by its user-facing name ("depth", "width", "wanda", ...).
METHODS = Registry("pruning method")


class MethodReport:
    """A method's own part of the report; dataclass subclasses get :meth:`to_dict` free."""

    def to_dict(self) -> dict:
        if dataclasses.is_dataclass(self):
            return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        raise TypeError(f"{type(self).__name__} must be a dataclass or define to_dict")

    def history(self) -> dict:
        """What the model's history (and so the manifest) keeps of this run, beside the
        operation and the config."""
        return {}


@dataclass
class DictReport(MethodReport):
    """A method report given as a plain dict (``history_keys`` go to the history)."""

    values: dict
    history_keys: tuple = ()

    def to_dict(self) -> dict:
        return dict(self.values)

    def history(self) -> dict:
        return {k: self.values[k] for k in self.history_keys if k in self.values}


class Pruner(abc.ABC):
    """Handler of one config type (and its subclasses)."""

    #: recorded as the history's ``operation`` ("prune-depth", "prune-sparsity", ...)
    operation: ClassVar[str] = "prune"
    #: ``False``: the method reads no calibration data (``run`` gets ``input_ids=None``)
    needs_data: ClassVar[bool] = True

    #: prunelab custom module kinds (``prunelab_kind``, :mod:`prunelab.models.custom`) this
    #: method cannot prune through: a model holding one is refused in one line before any
    #: data is read (:func:`check_composable`); ``"*"``: every kind
    refuses_kinds: ClassVar[frozenset] = frozenset()

    def precheck(self, lm, config) -> None:  # noqa: B027 - optional hook, no-op default
        """Raise the errors a user can cause before any data is read (default: none)."""

    @abc.abstractmethod
    def run(self, lm, config, input_ids, *, batch_size: int) -> MethodReport:
        """Prune ``lm`` in place on calibration ``input_ids`` ``[N, T]``."""


#: The :class:`Pruner` (one instance) of every config type (and its subclasses).
PRUNERS = Registry(
    "pruner", by_type=True, instantiate=True,
    missing=lambda cls: (f"no pruning method for {cls.__name__}; registered: "
                         f"{', '.join(METHODS.names())}"))


#: custom module kinds by what made them (:attr:`Pruner.refuses_kinds` is built of these)
FACTORED = frozenset({"low_rank_linear", "shared_dictionary", "shared_basis_linear",
                      "sparse_lowrank_linear"})
EXPERTS = frozenset({"prunepath_mlp"})
SKIPPED = frozenset({"skipped_attention", "skipped_mlp", "skipped_norm"})
STREAM = frozenset({"residual_shortcut", "stream_shapes"})
TOKENS = frozenset({"token_pruner"})


def check_composable(lm, pruner: Pruner, method: str, config: Any = None) -> None:
    """Refuse in one line (:class:`~prunelab.errors.UnsupportedOperationError`) a model
    holding prunelab custom modules that ``pruner`` cannot prune through (its
    :attr:`Pruner.refuses_kinds`, and a ``refuses_kinds`` of ``config``), naming them and
    the operations that made them."""
    refused = pruner.refuses_kinds | getattr(config, "refuses_kinds", frozenset())
    kinds = sorted({m.prunelab_kind for _, m in custom_modules(lm.model)})
    bad = [k for k in kinds if "*" in refused or k in refused]
    if not bad:
        return
    ops = [op.get("operation") for op in getattr(lm, "history", []) or []
           if op.get("operation") and op.get("operation") != pruner.operation]
    made = f" (made by {', '.join(dict.fromkeys(ops))})" if ops else ""
    raise UnsupportedOperationError(
        f"{method}: the model holds prunelab {', '.join(bad)} modules{made}, which "
        f"{method} cannot prune through; apply {method} to the model before that step")


def pruner_for(config: Any) -> Pruner:
    """The pruner registered for ``type(config)`` or its nearest base class."""
    return PRUNERS.for_config(config)


def config_from_dict(d: dict | str) -> Any:
    """A pruning config from its :func:`prunelab.registry.to_dict` form (as the manifest
    keeps it in ``operations[i]["config"]``)."""
    return METHODS.from_dict(d)


@dataclass
class PruneReport(Mapping):
    """What :func:`prunelab.prune` returns: the shared fields plus the method's own
    (``report["removed_blocks"]`` reads either; :meth:`to_dict` flattens both)."""

    operation: str
    method: str
    config: dict
    data: dict
    size_before: dict
    size_after: dict
    seconds: float
    details: MethodReport = field(repr=False)

    def to_dict(self) -> dict:
        shared = {"operation": self.operation, "method": self.method, "config": self.config,
                  "data": self.data, "size_before": self.size_before,
                  "size_after": self.size_after, "seconds": self.seconds}
        return {**self.details.to_dict(), **shared}

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def method_name(config: Any) -> str:
    """The registered name of ``config``'s class (its class name when unregistered)."""
    return getattr(type(config), "registry_name", type(config).__name__)


def config_dict(config: Any) -> dict:
    """``to_dict`` of a config, registered or not."""
    return to_dict(config)
