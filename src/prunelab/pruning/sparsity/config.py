"""The sparsity method contract: :class:`SparsityConfig`, the base of every registered
sparsity method, and the layerwise allocations (:data:`ALLOCATIONS`).

A method is a frozen dataclass subclass of :class:`SparsityConfig` registered in
:data:`prunelab.pruning.base.METHODS` under its name; the shared executor
(:mod:`prunelab.pruning.sparsity.execute`) calls only the hooks below and knows no method
by name::

    @METHODS.register("my-method")
    @dataclass(frozen=True)
    class MyMethod(SparsityConfig):
        seed: int = field(default=0, metadata={"help": "my-method: random seed"})

        def prune_weight(self, w, accs, sparsity):
            return w * self.keep_mask(w.abs(), sparsity)

Every field carries ``metadata={"help": ...}`` (one line, for the generated CLI); a field
whose CLI flag is not ``--field-name`` names it with ``"flag"`` (``"negate": True`` for a
switch that sets a boolean field to ``False``). :func:`config_options` lists them.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from prunelab.calib.stats import AbsQuantile, SumSquares
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.pruning.allocation import outlier_ratio, owl, pals, ramp, uniform
from prunelab.pruning.base import METHODS
from prunelab.pruning.sparsity import masks
from prunelab.pruning.sparsity.scores import wanda_scores
from prunelab.registry import Registry, check_range, field_metadata, to_dict

#: Layerwise (per-block) sparsity allocations by name.
ALLOCATIONS = Registry("allocation")


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@dataclass(frozen=True)
class Allocation:
    """Base of the allocations: one sparsity per block whose parameter-weighted mean is the
    target. An allocation that needs calibration statistics returns an accumulator factory
    from :meth:`accumulators`, turns a block's accumulators into one number with
    :meth:`block_value`, and gets those numbers (one per block) in :meth:`sparsities`."""

    def accumulators(self, index: int) -> Callable[[str], list] | None:
        """Statistics of block ``index``'s linears (dense pass), or ``None``: no pass."""
        return None

    def block_value(self, weights: dict[str, torch.Tensor], accs: dict) -> float:
        """One number for a block from its selected weights ``[d_out, d_in]`` and their
        accumulators (called only when :meth:`accumulators` is not ``None``)."""
        raise TypeError(f"{type(self).__name__} does not define block_value()")

    def sparsities(self, target: float, weights: list[float],
                   values: list[float] | None) -> list[float]:
        """Per-block sparsities; ``weights``: parameter counts per block."""
        raise TypeError(f"{type(self).__name__} does not define sparsities()")


@ALLOCATIONS.register("uniform")
@dataclass(frozen=True)
class Uniform(Allocation):
    """Every block gets the target sparsity."""

    def sparsities(self, target, weights, values):
        return uniform(len(weights), target)


@ALLOCATIONS.register("owl")
@dataclass(frozen=True)
class Owl(Allocation):
    """OWL (Yin et al. 2024): less sparsity for blocks with more outliers (Wanda scores above
    ``m`` times the mean); deviations spread over ``[-lam, lam]``."""

    m: float = field(default=5.0, metadata=_help("owl: outlier threshold M", flag="--owl-m"))
    lam: float = field(default=0.08, metadata=_help("owl: lambda", flag="--owl-lambda"))

    def __post_init__(self):
        check_range("owl m", self.m, 1e-6, None)
        check_range("owl lambda", self.lam, 0.0, 0.5)

    def accumulators(self, index):
        return lambda name: [SumSquares()]

    def block_value(self, weights, accs):
        return outlier_ratio([wanda_scores(w, accs[p][0].sum_sq) for p, w in weights.items()],
                             m=self.m)

    def sparsities(self, target, weights, values):
        return owl(values, target, lam=self.lam, weights=weights)


@ALLOCATIONS.register("pals")
@dataclass(frozen=True)
class Pals(Allocation):
    """PALS (derived): sparsity from the 99th-percentile input activation per block,
    ``s_l = s + delta (1 - 2 z_l)``."""

    delta: float = field(default=0.05, metadata=_help("pals: delta", flag="--pals-delta"))

    def __post_init__(self):
        check_range("pals delta", self.delta, 0.0, 0.5)

    def accumulators(self, index):
        return lambda name: [AbsQuantile(200_000, seed=index)]

    def block_value(self, weights, accs):
        return max(accs[p][0].quantile(0.99) for p in weights)

    def sparsities(self, target, weights, values):
        return pals(values, target, delta=self.delta, weights=weights)


@ALLOCATIONS.register("ramp")
@dataclass(frozen=True)
class Ramp(Allocation):
    """Sparsity rising (``increasing``) or falling linearly with depth, target +- span."""

    span: float = field(default=0.1, metadata=_help("ramp: +- span around the target",
                                                    flag="--ramp-span"))
    increasing: bool = field(default=True, metadata=_help(
        "ramp: sparsity falls with depth", flag="--ramp-down", negate=True))

    def __post_init__(self):
        check_range("ramp span", self.span, 0.0, 0.5)

    def sparsities(self, target, weights, values):
        return ramp(len(weights), target, span=self.span, increasing=self.increasing,
                    weights=weights)


@ALLOCATIONS.register("taper")
@dataclass(frozen=True)
class Taper(Allocation):
    """CascadeFormer's taper for sparsity: density falls linearly with depth, the first
    block's density ``slope`` above the last's (a ramp of span ``slope / 2``)."""

    slope: float = field(default=0.2, metadata=_help("taper: density of the first block "
                                                     "minus the last's", flag="--taper-slope"))

    def __post_init__(self):
        check_range("taper slope", self.slope, -1.0, 1.0)

    def sparsities(self, target, weights, values):
        return ramp(len(weights), target, span=abs(self.slope) / 2,
                    increasing=self.slope >= 0, weights=weights)


@dataclass(frozen=True)
class BlockStage:
    """What a block-level hook (:meth:`SparsityConfig.prune_group`) may use: the model,
    the calibration runner, the block index and the block's inputs (one tensor per batch)."""

    lm: Any
    runner: Any
    index: int
    inputs: list


@dataclass(frozen=True)
class SparsityConfig:
    """Shared options and the hooks of a sparsity method.

    ``sparsity`` (default 0.5) or ``pattern`` "N:M" (e.g. "2:4": target ``1 - N/M``), not
    both; ``group`` is the unstructured comparison group ("row" as in Wanda, or "layer");
    ``targets`` / ``ignore`` are glob patterns on a linear's path inside its block
    (``self_attn.q_proj``, ``mlp.*``) or on its full module name; ``propagate`` passes the
    pruned block's outputs on (``modified``) or the dense ones (``dense``).
    ``within_block``: ``"sequential"`` calibrates each sublayer group (``[q, k, v]``, ``o``,
    ``[gate, up]``, ``down``) with the earlier groups of the block already pruned (about one
    pass per block); ``"dense"`` calibrates every linear of the block on the dense block
    (the Wanda / SparseGPT reference codes and llm-compressor; one dense and one pruned
    pass per block). A subclass declares its own default order by overriding the defaults.
    """

    sparsity: float | None = field(default=None, metadata=_help(
        "unstructured target (mean over layers); default 0.5", budget="remove-weights"))
    pattern: str | None = field(default=None, metadata=_help("N:M pattern, e.g. 2:4"))
    allocation: Allocation = field(default_factory=Uniform, metadata=_help(
        "uniform | owl | pals | ramp"))
    group: str = field(default="row", metadata=_help(
        "unstructured comparison group: row or layer"))
    targets: tuple[str, ...] = field(default=(), metadata=_help(
        "glob patterns of linears to prune"))
    ignore: tuple[str, ...] = field(default=(), metadata=_help(
        "glob patterns of linears to keep"))
    propagate: str = field(default="modified", metadata=_help(
        "modified or dense block outputs passed on (wanda's auto: dense for a sparsity "
        "target, modified for an N:M pattern)"))
    within_block: str = field(default="sequential", metadata=_help(
        "sequential (each sublayer group calibrated after the earlier ones were pruned) or "
        "dense (the whole block calibrated dense)"))

    _registries: ClassVar[dict] = {"allocation": ALLOCATIONS}
    #: True when :meth:`prune_group` runs passes through the block itself (QK-Wanda taps
    #: q/k outputs): the executor then prunes group by group with separate passes instead
    #: of replaying one pass per block.
    own_block_passes: ClassVar[bool] = False

    def __post_init__(self):
        nm = masks.parse_pattern(self.pattern) if self.pattern else None
        if nm is not None and self.sparsity is not None:
            raise ConfigError("give sparsity or pattern, not both")
        if nm is None:
            if self.sparsity is None:
                object.__setattr__(self, "sparsity", 0.5)
            check_range("sparsity", self.sparsity, 0.0, 0.99)
            if self.sparsity == 0:
                raise ConfigError("sparsity 0 removes no weight (an unpruned checkpoint); "
                                  "give --budget remove-weights:F with F > 0")
        if isinstance(self.allocation, (str, dict)):
            object.__setattr__(self, "allocation", ALLOCATIONS.from_dict(self.allocation))
        if not isinstance(self.allocation, Allocation):
            raise ConfigError(f"allocation must be one of {', '.join(ALLOCATIONS.names())}, "
                              f"got {self.allocation!r}")
        if nm is not None and not isinstance(self.allocation, Uniform):
            raise ConfigError("N:M patterns use the same N:M in every layer: use "
                              "--allocation uniform")
        if self.group not in ("row", "layer"):
            raise ConfigError(f"group must be row or layer, got {self.group!r}")
        if self.propagate not in ("modified", "dense"):
            raise ConfigError(f"propagate must be modified or dense, got {self.propagate!r}")
        if self.within_block not in ("sequential", "dense"):
            raise ConfigError(f"within-block must be sequential or dense, got "
                              f"{self.within_block!r}")
        for name in ("targets", "ignore"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) \
                    or not all(isinstance(p, str) and p for p in value):
                raise ConfigError(f"{name} must be a list of glob patterns (strings), got "
                                  f"{value!r}")
            object.__setattr__(self, name, tuple(value))

    @property
    def nm(self) -> tuple[int, int] | None:
        """The N:M pattern as ``(n, m)``, or ``None`` (unstructured)."""
        return masks.parse_pattern(self.pattern) if self.pattern else None

    @property
    def target_sparsity(self) -> float:
        """The target: ``sparsity``, or ``1 - N/M`` for an N:M pattern."""
        nm = self.nm
        return 1.0 - nm[0] / nm[1] if nm is not None else float(self.sparsity)

    def keep_mask(self, score: torch.Tensor, sparsity: float) -> torch.Tensor:
        """Kept mask of ``score`` ``[d_out, d_in]``: the N:M pattern, else the lowest
        ``sparsity`` per ``group``."""
        nm = self.nm
        if nm is not None:
            return masks.nm_mask(score, *nm)
        return masks.unstructured_mask(score, sparsity, group=self.group)

    # -- hooks a method declares ------------------------------------------------------

    def precheck(self, lm) -> None:
        """Raise the errors a user can cause on ``lm`` before any data is read."""

    def select(self, lm, index: int, linears: dict[str, torch.nn.Module]) -> dict:
        """The block's linears (after ``targets`` / ``ignore``) this method prunes."""
        return linears

    def accumulators(self) -> Callable[[str], list] | None:
        """Factory ``path -> [Accumulator, ...]`` of the statistics one linear needs (fed
        its inputs; linears reading the same tensor share one set), or ``None``: the
        method needs no calibration statistics."""
        return None

    def model_statistics(self, lm, input_ids: torch.Tensor, linears: dict,
                         batch_size: int) -> dict | None:
        """Whole-model statistics computed once on the dense model before pruning, by
        ``"{block}:{path}"`` of ``linears``; each is appended to that linear's
        accumulators. Default: none."""
        return None

    def prune_group(self, stage: BlockStage, group: dict, sparsity: float) -> dict:
        """Block-level stage, before a group's statistics are gathered: prune what the
        method prunes on its own and return the linears left for :meth:`prune_weight`
        (default: all). Overriding it needs ``own_block_passes = True``."""
        return group

    def prune_weight(self, w: torch.Tensor, accs: list | None, sparsity: float
                     ) -> torch.Tensor:
        """The pruned ``[d_out, d_in]`` weight from ``w`` (detached; do not change it in
        place), the linear's accumulators (``None`` without statistics) and its block's
        sparsity (for an N:M pattern use :meth:`keep_mask`)."""
        raise TypeError(f"{type(self).__name__} must define prune_weight")

    def joint_key(self, w: torch.Tensor, accs: list | None) -> Hashable | None:
        """Linears of one group with the same key are pruned together by
        :meth:`prune_joint` (e.g. they read the same tensor); ``None``: alone."""
        return None

    def prune_joint(self, ws: list[torch.Tensor], accs: list, sparsity: float
                    ) -> list[torch.Tensor]:
        """The pruned weights of linears sharing a :meth:`joint_key`."""
        return [self.prune_weight(w, a, sparsity) for w, a in zip(ws, accs, strict=True)]

    def check_streamable(self) -> None:
        """``--stream`` runs the method block by block; one that needs gradients through
        the whole model (its own :meth:`model_statistics`) is refused in one line."""
        own = type(self).model_statistics is not SparsityConfig.model_statistics
        if own and getattr(self, "hessian_alpha", 1.0) > 0:
            raise UnsupportedOperationError(
                f"--stream: {type(self).__name__.lower()} needs gradients through the whole "
                "model (model statistics): run it without --stream")


def find(accs: list | None, kind: type) -> Any:
    """The first accumulator of type ``kind`` in a linear's ``accs`` (``None`` if absent)."""
    return next((a for a in accs or () if isinstance(a, kind)), None)


def sparsity_methods() -> dict[str, type[SparsityConfig]]:
    """Every registered sparsity method, ``{name: config class}`` (user ones included)."""
    return {name: METHODS.get(name) for name in METHODS.names()
            if issubclass(METHODS.get(name), SparsityConfig)}


def config_options(cls: type) -> list[dict]:
    """The CLI-facing options of a config class: ``name``, ``type``, ``default``, ``help``
    and the optional ``flag`` / ``negate`` (from the field metadata; a field overridden
    in a subclass without metadata keeps the base class's help)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        meta = field_metadata(cls, f)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        out.append({"name": f.name, "type": hints.get(f.name), "default": default, **meta})
    return out


def from_dict(d: dict | str) -> SparsityConfig:
    """A sparsity config from :func:`to_dict` output; manifests written before the
    registry (a ``"method"`` key, ``sparsity`` recorded beside ``pattern``) are accepted."""
    if isinstance(d, dict) and "name" not in d and "method" in d:
        d = dict(d)
        d["name"] = d.pop("method")
        if d.get("pattern") and masks.parse_pattern(d["pattern"]):
            d.pop("sparsity", None)
    cfg = METHODS.from_dict(d)
    if not isinstance(cfg, SparsityConfig):
        raise ConfigError(f"{METHODS.name_of(cfg)!r} is not a sparsity method")
    return cfg


__all__ = ["ALLOCATIONS", "Allocation", "BlockStage", "Owl", "Pals", "Ramp",
           "SparsityConfig", "Uniform", "config_options", "find", "from_dict", "sparsity_methods",
           "to_dict"]
