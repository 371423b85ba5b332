"""The factorization family's contract: one config class per method (a subclass of
:class:`FactorConfig`, registered in :data:`~prunelab.pruning.base.METHODS`), one pruner
for all of them, one report.

A method implements :meth:`FactorConfig.apply` (factorize ``lm`` in place on calibration
``input_ids``, return its own report values) and, when some families cannot take it,
:meth:`FactorConfig.precheck` (raise :class:`~prunelab.errors.UnsupportedOperationError`
with one line). The pruner adds what every method reports: parameters as the checkpoint
stores them (shared tensors once, an untied head counted), FLOPs per token, the kept
fraction, the factorized modules and whether the checkpoint needs remote code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from prunelab.checkpoint.remote import needs_remote_code
from prunelab.models.custom import custom_modules
from prunelab.models.size import size_summary
from prunelab.pruning.base import EXPERTS, FACTORED, METHODS, PRUNERS, TOKENS, DictReport, Pruner
from prunelab.registry import check_range


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@dataclass(frozen=True)
class FactorConfig:
    """Shared options of the factorization methods.

    ``target_params``: the fraction of the model's parameters to keep, counted as the
    checkpoint stores them (tied tensors once; shortcut matrices, both factors, shared
    dictionaries and an untied head included). When ``None`` the method's own knob
    (``ratio``, ``rank``, ...) decides.
    """

    target_params: float | None = field(default=None, metadata=_help(
        "fraction of the model's parameters to keep, everything stored counted",
        budget="keep-params"))

    def __post_init__(self) -> None:
        if self.target_params is not None:
            check_range("target_params", self.target_params, 0.0, 1.0)
            if self.target_params == 0:
                check_range("target_params", self.target_params, 1e-9, 1.0)

    def precheck(self, lm) -> None:
        """Raise the user errors that need no data (a family the method cannot handle)."""

    def apply(self, lm, input_ids, *, batch_size: int) -> dict:
        """Factorize ``lm`` in place; return the method's own report values."""
        raise TypeError(f"{type(self).__name__} must define apply()")

    #: report keys the model's history (and the manifest) keeps
    history_keys: ClassVar[tuple] = ()


def factor_methods() -> dict[str, type[FactorConfig]]:
    """Every registered factorization method, ``{name: config class}``."""
    return {name: METHODS.get(name) for name in METHODS.names()
            if issubclass(METHODS.get(name), FactorConfig)}


def factorized_modules(model) -> list[dict]:
    """``{"module", "kind", **spec}`` of every custom module in ``model`` (what
    ``prunelab info`` shows)."""
    return [{"module": path, "kind": m.prunelab_kind, **m.prunelab_spec()}
            for path, m in custom_modules(model)]


@PRUNERS.register(FactorConfig)
class FactorPruner(Pruner):
    """Every factorization method: :meth:`FactorConfig.apply` plus the shared report."""

    operation = "prune-factor"
    refuses_kinds = FACTORED | EXPERTS | TOKENS

    def precheck(self, lm, config: FactorConfig) -> None:
        config.precheck(lm)

    def run(self, lm, config: FactorConfig, input_ids, *, batch_size: int) -> DictReport:
        before = size_summary(lm.model)
        values = dict(config.apply(lm, input_ids, batch_size=batch_size))
        after = size_summary(lm.model)
        values.update({
            "params_before": before["params"], "params_after": after["params"],
            "kept_params": after["params"] / before["params"],
            "flops_per_token_before": before["flops_per_token"],
            "flops_per_token_after": after["flops_per_token"],
            "factorized_modules": len(factorized_modules(lm.model)),
            "needs_remote_code": needs_remote_code(lm.model),
        })
        keys = ("params_before", "params_after", "kept_params", "flops_per_token_before",
                "flops_per_token_after", "needs_remote_code", *config.history_keys)
        return DictReport(values, history_keys=keys)
