"""Matched budgets: one figure (``keep-params:0.8``, ``remove-weights:0.5``,
``remove-blocks:6``; the vocabulary of :mod:`prunelab.budget`) turned into each method's
own option, and the figure a pruned model actually reaches.

Definitions (counted on the model, tied tensors once): ``keep-params:p`` keeps a fraction
``p`` of the dense model's parameters, an exactly-zero weight counting as removed;
``remove-weights:s`` removes a fraction ``s`` of the weights of the blocks' linear maps (a
removed block or channel removes its weights); ``remove-blocks:n`` removes the parameters
of ``n`` whole blocks (``remove-params:F`` and ``keep-weights:F`` are the same figures
counted the other way). A method takes the budget through the first field it has among
``remove`` (depth: blocks), ``target_params`` (structured and factorization methods:
fraction of parameters kept) and ``sparsity`` (unstructured), converted with the dense
model's counts; what it reaches is measured afterwards (:func:`achieved`).
"""

from __future__ import annotations

import dataclasses

from prunelab.budget import Budget, parse_budget_list
from prunelab.budget import parse_budget as _parse_one
from prunelab.errors import ConfigError

#: what a matched comparison counts, each in the direction it is reported
CANONICAL = {"params": "keep", "weights": "remove", "blocks": "remove"}
KINDS = tuple(f"{a}-{q}" for q, a in CANONICAL.items())


def _canonical(b: Budget, text: str) -> Budget:
    if b.quantity not in CANONICAL:
        raise ConfigError(f"compare --budget takes keep-params:F, remove-weights:F or "
                          f"remove-blocks:N (the figures every method can be matched on), "
                          f"got {text!r}")
    return b.to(CANONICAL[b.quantity])


def parse_budget(text: str | Budget) -> Budget:
    """``keep-params:0.8`` (fraction kept, in (0, 1)), ``remove-weights:0.5`` (in (0, 1))
    or ``remove-blocks:6`` (a positive integer); the reverse spellings of the two
    fractions are accepted and turned round."""
    b = text if isinstance(text, Budget) else _parse_one(text)
    b = _canonical(b, str(text))
    if b.quantity == "blocks" and b.value < 1:
        raise ConfigError(f"--budget remove-blocks:N needs N >= 1, got {int(b.value)}")
    if b.quantity != "blocks" and not (b.is_fraction and 0.0 < b.value < 1.0):
        raise ConfigError(f"--budget {b.kind}:F needs 0 < F < 1, got {b.value}")
    return b


def parse_budgets(text: str) -> list[Budget]:
    """One budget or a list of one kind: ``remove-blocks:2,4,6``, ``keep-params:0.9,0.8``
    (each checked as in :func:`parse_budget`, in the order given); a second kind, a value
    that is not a number or a value given twice is a one-line :class:`ConfigError`."""
    out = [parse_budget(b) for b in parse_budget_list(text)]
    if len(set(out)) != len(out):
        raise ConfigError(f"--budget {text!r}: a value is listed twice")
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
    budget = parse_budget(budget)
    removed_params = {"params": (1 - budget.value) * dense["params"],
                      "weights": budget.value * dense["linear_params"],
                      "blocks": budget.value * dense["block_params"]}[budget.quantity]
    name = getattr(config, "registry_name", type(config).__name__)
    if "remove" in fields and "target_params" in fields:  # depth
        if budget.quantity == "blocks":
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
    value = {"params": kept, "weights": sparsity, "blocks": blocks}[budget.quantity]
    exact = dense["blocks"] - after["blocks"] if budget.quantity == "blocks" else None
    label = (f"remove-blocks {exact}" if exact and abs(exact - blocks) < 0.5 else
             f"{budget.kind} {value:.3f}")
    return {"achieved": label, "achieved_value": value, "params_kept": kept,
            "sparsity": sparsity, "blocks_removed": dense["blocks"] - after["blocks"]}
