"""Matched budgets: one figure (``params:0.8``, ``sparsity:0.5``, ``blocks:6``) turned into
each method's own option, and the figure a pruned model actually reaches.

Definitions (counted on the model, tied tensors once): ``params:p`` keeps a fraction
``p`` of the dense model's parameters, an exactly-zero weight counting as removed;
``sparsity:s`` removes a fraction ``s`` of the weights of the blocks' linear maps (a
removed block or channel removes its weights); ``blocks:n`` removes the parameters of
``n`` whole blocks. A method takes the budget through the first field it has among
``remove`` (depth: blocks), ``target_params`` (structured and factorization methods:
fraction of parameters kept) and ``sparsity`` (unstructured), converted with the dense
model's counts; what it reaches is measured afterwards (:func:`achieved`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prunelab.errors import ConfigError

KINDS = ("params", "sparsity", "blocks")


@dataclass(frozen=True)
class Budget:
    kind: str
    value: float

    def __str__(self) -> str:
        v = int(self.value) if self.kind == "blocks" else self.value
        return f"{self.kind}:{v}"


def parse_budget(text: str) -> Budget:
    """``params:0.8`` (fraction kept, in (0, 1)), ``sparsity:0.5`` (in (0, 1)) or
    ``blocks:6`` (a positive integer)."""
    kind, sep, value = str(text).partition(":")
    if not sep or kind not in KINDS:
        raise ConfigError(f"--budget takes params:F, sparsity:F or blocks:N, got {text!r}")
    try:
        v = int(value) if kind == "blocks" else float(value)
    except ValueError:
        raise ConfigError(f"--budget {text!r}: {value!r} is not a number") from None
    if kind == "blocks" and v < 1:
        raise ConfigError(f"--budget blocks:N needs N >= 1, got {v}")
    if kind != "blocks" and not 0.0 < v < 1.0:
        raise ConfigError(f"--budget {kind}:F needs 0 < F < 1, got {v}")
    return Budget(kind, v)


def parse_budgets(text: str) -> list[Budget]:
    """One budget or a list of one kind: ``blocks:2,4,6``, ``params:0.9,0.8,0.7`` (each
    value checked as in :func:`parse_budget`, in the order given); a second kind, a
    value that is not a number or a value given twice is a one-line :class:`ConfigError`."""
    kind, sep, values = str(text).partition(":")
    if not sep or kind not in KINDS:
        raise ConfigError(f"--budget takes params:F, sparsity:F or blocks:N (or a list of "
                          f"one kind, blocks:2,4,6), got {text!r}")
    items = [v.strip() for v in values.split(",")]
    out: list[Budget] = []
    for item in items:
        if ":" in item:
            raise ConfigError(f"--budget {text!r}: one kind per list ({kind}:...), got "
                              f"{item!r}")
        if not item:
            raise ConfigError(f"--budget {text!r}: an empty value in the list")
        try:
            b = parse_budget(f"{kind}:{item}")
        except ConfigError as exc:
            if len(items) == 1:
                raise
            why = str(exc).split(": ", 1)[-1] if "is not a number" in str(exc) else \
                str(exc).removeprefix("--budget ")
            raise ConfigError(f"--budget {text!r}: {why}") from None
        if b in out:
            raise ConfigError(f"--budget {text!r}: {b} is listed twice")
        out.append(b)
    return out


def _unique_params(modules) -> int:
    seen, n = set(), 0
    for m in modules:
        for p in m.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                n += p.numel()
    return n


def _nonzero(modules) -> int:
    seen, n = set(), 0
    for m in modules:
        for p in m.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                n += int((p.detach() != 0).sum())
    return n


def sizes(lm) -> dict:
    """Counts of ``lm``: ``params``, ``nonzero_params``, ``blocks``, ``block_params``
    (mean per block), ``linear_params`` and ``nonzero_linear_params`` (blocks' linears)."""
    ad = lm.adapter
    blocks = [ad.block(i) for i in range(ad.num_blocks)]
    linears = [m for i in range(ad.num_blocks) for m in ad.linears(i).values()]
    return {"params": _unique_params([lm.model]), "nonzero_params": _nonzero([lm.model]),
            "blocks": ad.num_blocks,
            "block_params": _unique_params(blocks) / max(ad.num_blocks, 1),
            "linear_params": _unique_params(linears),
            "nonzero_linear_params": _nonzero(linears)}


def apply_budget(config, budget: Budget, dense: dict):
    """``config`` with the budget set in its budget field (see the module docstring); a
    config without one is a :class:`ConfigError`."""
    fields = {f.name for f in dataclasses.fields(config)}
    removed_params = {"params": (1 - budget.value) * dense["params"],
                      "sparsity": budget.value * dense["linear_params"],
                      "blocks": budget.value * dense["block_params"]}[budget.kind]
    name = getattr(config, "registry_name", type(config).__name__)
    if "remove" in fields and "target_params" in fields:  # depth
        if budget.kind == "blocks":
            return dataclasses.replace(config, remove=int(budget.value), target_params=None)
        n = max(1, round(removed_params / dense["block_params"]))
        return dataclasses.replace(config, remove=n, target_params=None)
    if "target_params" in fields:
        kept = round(1.0 - removed_params / dense["params"], 6)
        extra = {"ratio": None} if "ratio" in fields else {}
        return dataclasses.replace(config, target_params=kept, **extra)
    if "sparsity" in fields:
        s = round(removed_params / dense["linear_params"], 6)
        if not 0.0 < s < 1.0:
            raise ConfigError(f"{name}: budget {budget} needs sparsity {s:.3f} of the blocks' "
                              "linears, outside (0, 1)")
        extra = {"pattern": None} if "pattern" in fields else {}
        return dataclasses.replace(config, sparsity=s, **extra)
    raise ConfigError(f"method {name} takes no budget (no remove, target_params or sparsity "
                      "option): give it in a recipe with its own options instead")


def achieved(after: dict, dense: dict, budget: Budget) -> dict:
    """The budget figure the pruned model reaches (``achieved``, in the budget's unit),
    plus ``params_kept`` and ``sparsity`` for every method."""
    base = dense.get("nonzero_params", dense["params"])  # a dense model has a few zeros
    kept = after["nonzero_params"] / base
    sparsity = 1.0 - after["nonzero_linear_params"] / dense.get("nonzero_linear_params",
                                                                dense["linear_params"])
    blocks = (base - after["nonzero_params"]) / dense["block_params"]
    value = {"params": kept, "sparsity": sparsity, "blocks": blocks}[budget.kind]
    exact = dense["blocks"] - after["blocks"] if budget.kind == "blocks" else None
    label = (f"blocks {exact}" if exact and abs(exact - blocks) < 0.5 else
             f"{budget.kind} {value:.3f}")
    return {"achieved": label, "achieved_value": value, "params_kept": kept,
            "sparsity": sparsity, "blocks_removed": dense["blocks"] - after["blocks"]}
