"""How much to remove, said one way everywhere: ``--budget KIND:VALUE``.

``KIND`` is ``keep-QUANTITY`` or ``remove-QUANTITY``: it names what is counted and
whether the figure is what stays or what goes (``remove-blocks:6``, ``keep-params:0.8``,
``remove-weights:0.5``). The quantities (:data:`QUANTITIES`):

========  ===================  ==========================================================
quantity  value                what is counted
========  ===================  ==========================================================
blocks    a count              whole blocks of the stack (depth)
params    fraction or count    parameters of the model, tied tensors once
weights   fraction             weights of the blocks' linear maps (sparsity, low rank)
units     fraction             parameters of the pruned units: KV groups / heads / FFN
                               channels (width, elastic, rep-lie)
hidden    fraction             the hidden size (residual-stream slicing)
compute   fraction             sublayer compute per token (conditional gates)
mass      fraction             router probability mass a token is routed through (experts)
cache     fraction             KV-cache entries of the prompt (inference presses)
tokens    fraction             tokens kept at each layer (token pruning)
========  ===================  ==========================================================

A fraction can be given either way: ``keep-units:0.8`` is ``remove-units:0.2``. A method
declares which budget sets which of its config fields with the field metadata
``budget="remove-blocks"`` (the kind the field counts); :func:`budget_options` turns a
budget into those fields, and :func:`accepted_kinds` lists what a config takes, for its
help and its errors. The flags of earlier versions (``--remove``, ``--ratio``, ...) are in
:data:`RETIRED` with their new spelling.

This module is pure Python (core floor): the CLI parses budgets without importing torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from prunelab.errors import ConfigError
from prunelab.registry import field_metadata


@dataclass(frozen=True)
class Quantity:
    """What a budget counts: ``unit`` is ``count``, ``fraction`` or ``fraction-or-count``
    (a value above 1 is a count, e.g. ``keep-params:90000000``)."""

    name: str
    unit: str
    what: str


QUANTITIES: dict[str, Quantity] = {q.name: q for q in (
    Quantity("blocks", "count", "whole blocks of the stack"),
    Quantity("params", "fraction-or-count", "parameters of the model (tied tensors once)"),
    Quantity("weights", "fraction", "weights of the blocks' linear maps"),
    Quantity("units", "fraction", "parameters of the pruned units (KV groups, heads, FFN "
             "channels)"),
    Quantity("hidden", "fraction", "the hidden size (residual-stream width)"),
    Quantity("compute", "fraction", "sublayer compute per token"),
    Quantity("mass", "fraction", "router probability mass a token is routed through"),
    Quantity("cache", "fraction", "KV-cache entries of the prompt"),
    Quantity("tokens", "fraction", "tokens at each layer"),
)}
ACTIONS = ("keep", "remove")

#: flags of earlier versions -> how to say it now (a one-line error names the new form)
RETIRED: dict[str, str] = {
    "--remove": "--budget remove-blocks:N",
    "--target-params": "--budget keep-params:F",
    "--sparsity": "--budget remove-weights:F",
    "--ratio": "--budget remove-units:F (width, rep-lie), remove-weights:F (low-rank, "
               "dictionaries) or remove-hidden:F (slicing)",
    "--budgets": "--budget remove-units:LOW..HIGH",
    "--keep": "--budget keep-units:F (export) or keep-tokens:F (prune tokens)",
    "--mass": "--budget keep-mass:F",
    "--moe-mass": "--budget keep-mass:F",
    "--press-ratio": "--budget remove-cache:F",
}
#: where a retired flag meant one thing in one command (``prunelab <command path>``)
RETIRED_IN: dict[str, dict[str, str]] = {
    "prune width": {"--ratio": "--budget remove-units:F"},
    "prune factor": {"--ratio": "--budget remove-weights:F (svd-llm, dictionaries) or "
                                "remove-hidden:F (slicegpt)"},
    "heal": {"--ratio": "--budget remove-units:F", "--remove": "--budget remove-blocks:N"},
    "export": {"--keep": "--budget keep-units:F"},
    "prune tokens": {"--keep": "--budget keep-tokens:F"},
    "sweep depth": {"--remove": "--budget remove-blocks:N..M (or N,M,...)"},
    "prune elastic": {"--budgets": "--budget remove-units:LOW..HIGH"},
}
#: the kinds ``compare --budget`` took before the vocabulary was one
OLD_KINDS = {"params": "keep-params", "sparsity": "remove-weights", "blocks": "remove-blocks"}


def retired_hint(command: str, flag: str) -> str | None:
    """How ``flag`` of an earlier version is spelled now in ``command`` (``prune width``),
    or ``None`` when it was not a budget flag."""
    for path, flags in RETIRED_IN.items():
        if (command == path or command.endswith(" " + path)) and flag in flags:
            return flags[flag]
    return RETIRED.get(flag)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and value >= 1 else repr(value)


@dataclass(frozen=True)
class Budget:
    """``action`` (keep / remove) of ``value`` of ``quantity``; ``str()`` is the
    command-line spelling."""

    action: str
    quantity: str
    value: float

    @property
    def kind(self) -> str:
        return f"{self.action}-{self.quantity}"

    @property
    def is_fraction(self) -> bool:
        unit = QUANTITIES[self.quantity].unit
        return unit == "fraction" or (unit == "fraction-or-count" and self.value <= 1)

    def __str__(self) -> str:
        return f"{self.kind}:{_fmt(self.value)}"

    def to(self, action: str) -> Budget:
        """The same budget counted the other way (fractions only: ``keep-units:0.8`` ->
        ``remove-units:0.2``)."""
        if action == self.action:
            return self
        if not self.is_fraction:
            raise ConfigError(f"--budget {self}: a count cannot be turned into "
                              f"{action}-{self.quantity}; give {action}-{self.quantity}:N")
        return Budget(action, self.quantity, round(1.0 - self.value, 12))


def _kind(kind: str, text: str) -> tuple[str, str]:
    if kind in OLD_KINDS:
        raise ConfigError(f"--budget {text!r}: the kind {kind!r} is now spelled "
                          f"{OLD_KINDS[kind]} (e.g. {OLD_KINDS[kind]}:"
                          f"{text.partition(':')[2]})")
    action, _, quantity = kind.partition("-")
    if action not in ACTIONS or quantity not in QUANTITIES:
        raise ConfigError(f"--budget takes KIND:VALUE with KIND keep-Q or remove-Q, Q one "
                          f"of {', '.join(QUANTITIES)} (e.g. remove-blocks:6, "
                          f"keep-params:0.8); got {text!r}")
    return action, quantity


def _value(action: str, quantity: str, raw: str, text: str) -> float:
    unit = QUANTITIES[quantity].unit
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"--budget {text!r}: {raw!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"--budget {text!r}: the value must be a finite number >= 0")
    value += 0.0  # -0 is 0 (never "-0.0" in a manifest)
    if unit == "count" or (unit == "fraction-or-count" and value > 1):
        if not value.is_integer():
            what = "a whole number" if unit == "count" else "a fraction <= 1 or a count"
            raise ConfigError(f"--budget {text!r}: {action}-{quantity} takes {what}, "
                              f"got {raw}")
        return int(value)
    if value > 1:
        raise ConfigError(f"--budget {text!r}: {action}-{quantity} takes a fraction in "
                          f"[0, 1], got {raw}")
    return value


def check_given(text) -> None:
    """An empty budget (``--budget ""``, an unset shell variable, ``budget: ""`` in a
    recipe) is a one-line :class:`ConfigError`, never the default."""
    if text is not None and not isinstance(text, Budget) and not str(text).strip():
        raise ConfigError("--budget is empty (an unset shell variable?): give KIND:VALUE, "
                          "e.g. remove-blocks:2 or keep-params:0.8")


def parse_budget(text: str) -> Budget:
    """``KIND:VALUE`` as a :class:`Budget` (see the module docstring); anything else is a
    one-line :class:`ConfigError` naming the accepted form."""
    check_given(text)
    kind, sep, raw = str(text).strip().partition(":")
    if not sep:
        raise ConfigError(f"--budget takes KIND:VALUE (e.g. remove-blocks:6, "
                          f"keep-params:0.8), got {text!r}")
    action, quantity = _kind(kind.strip(), str(text))
    return Budget(action, quantity, _value(action, quantity, raw.strip(), str(text)))


def parse_budget_list(text: str) -> list[Budget]:
    """Several budgets of one kind: ``remove-blocks:2,4,6``, ``keep-params:0.9,0.8`` or an
    integer range of a count, ``remove-blocks:1..4``; in the order given, each once."""
    check_given(text)
    kind, sep, values = str(text).strip().partition(":")
    if not sep:
        raise ConfigError(f"--budget takes KIND:VALUE or KIND:V1,V2,... (e.g. "
                          f"remove-blocks:2,4,6), got {text!r}")
    action, quantity = _kind(kind.strip(), str(text))
    if ".." in values:
        lo, _, hi = values.partition("..")
        a, b = (_value(action, quantity, v.strip(), str(text)) for v in (lo, hi))
        if QUANTITIES[quantity].unit != "count" or b < a:
            raise ConfigError(f"--budget {text!r}: a range LOW..HIGH is for counts, "
                              f"low <= high (e.g. remove-blocks:1..4)")
        items = [str(n) for n in range(int(a), int(b) + 1)]
    else:
        items = [v.strip() for v in values.split(",")]
    out: list[Budget] = []
    for item in items:
        if not item:
            raise ConfigError(f"--budget {text!r}: an empty value in the list")
        if ":" in item:
            raise ConfigError(f"--budget {text!r}: one kind per list ({kind}:...), got "
                              f"{item!r}")
        b = Budget(action, quantity, _value(action, quantity, item, str(text)))
        if b in out:
            raise ConfigError(f"--budget {text!r}: {b} is listed twice")
        out.append(b)
    return out


def parse_budget_span(text: str) -> tuple[Budget, Budget]:
    """A range of fractions, ``remove-units:0.1..0.6`` (low < high), as two budgets."""
    kind, sep, values = str(text).strip().partition(":")
    lo, dots, hi = values.partition("..")
    if not sep or not dots:
        raise ConfigError(f"--budget takes a range KIND:LOW..HIGH here (e.g. "
                          f"remove-units:0.1..0.6), got {text!r}")
    action, quantity = _kind(kind.strip(), str(text))
    a, b = (Budget(action, quantity, _value(action, quantity, v.strip(), str(text)))
            for v in (lo, hi))
    if not a.value < b.value:
        raise ConfigError(f"--budget {text!r}: LOW must be below HIGH")
    return a, b


def budget_fields(cls) -> dict[str, str]:
    """``{field name: kind}`` of the fields of config class ``cls`` that a budget sets
    (metadata ``budget``; a field overridden without metadata keeps its base's)."""
    out = {}
    for f in dataclasses.fields(cls):
        kind = field_metadata(cls, f).get("budget")
        if kind:
            out[f.name] = kind
    return out


def accepted_kinds(cls) -> list[str]:
    """The kinds ``--budget`` takes for ``cls``, as ``remove-blocks:N`` /
    ``keep-params:F`` (a fraction also the other way round)."""
    out: list[str] = []
    spans = _spans(cls)
    for kind in dict.fromkeys(budget_fields(cls).values()):
        action, _, quantity = kind.partition("-")
        unit = QUANTITIES[quantity].unit
        if kind in spans:
            out.append(f"{kind}:LOW..HIGH")
            continue
        out.append(f"{kind}:{'N' if unit == 'count' else 'F'}")
        if unit != "count":
            other = "remove" if action == "keep" else "keep"
            out.append(f"{other}-{quantity}:F")
    return out


def _spans(cls) -> dict[str, tuple[str, str]]:
    """``{kind: (low field, high field)}`` of the ranges ``cls`` trains over (metadata
    ``span="low"`` / ``"high"`` beside ``budget``)."""
    ends: dict[str, dict[str, str]] = {}
    for f in dataclasses.fields(cls):
        meta = field_metadata(cls, f)
        if meta.get("budget") and meta.get("span") in ("low", "high"):
            ends.setdefault(meta["budget"], {})[meta["span"]] = f.name
    return {k: (v["low"], v["high"]) for k, v in ends.items() if len(v) == 2}


def budget_options(cls, budgets, label: str) -> dict:
    """``{field: value}`` setting ``budgets`` (a :class:`Budget`, a ``KIND:VALUE`` string,
    a list of them or ``None``) on config class ``cls``. A config that trains over a range
    (fields marked ``span``) takes ``KIND:LOW..HIGH``. A budget ``cls`` does not count, two
    budgets for one field, or a count where the field takes a fraction is a one-line
    :class:`ConfigError` naming what ``label`` accepts."""
    if budgets is None:
        return {}
    if isinstance(budgets, (str, Budget)):
        budgets = [budgets]
    spans = _spans(cls)
    took = ", ".join(accepted_kinds(cls)) or "no budget"
    out: dict = {}
    for b in budgets:
        check_given(b)
        if isinstance(b, str) and ":" not in b:
            first = accepted_kinds(cls)[0].partition(":")[0] if took != "no budget" else "KIND"
            raise ConfigError(f"{label} takes --budget {took}; got {b!r} (say what it counts, "
                              f"e.g. {first}:{b.strip()})")
        if isinstance(b, str) and ".." in b:
            lo, hi = parse_budget_span(b)
            ends = spans.get(f"{lo.action}-{lo.quantity}") or \
                spans.get(f"{'keep' if lo.action == 'remove' else 'remove'}-{lo.quantity}")
            if ends is None:
                raise ConfigError(f"{label} takes --budget {took}; a range {b} is for "
                                  f"methods trained over a range of budgets")
            action = next(k for k, v in spans.items() if v == ends).partition("-")[0]
            lo, hi = sorted((lo.to(action).value, hi.to(action).value))
            out.update({ends[0]: lo, ends[1]: hi})
            continue
        b = b if isinstance(b, Budget) else parse_budget(b)
        name = _field_for(cls, b, spans)
        if name is None:
            raise ConfigError(f"{label} takes --budget {took}; got {b}")
        action = budget_fields(cls)[name].partition("-")[0]
        if name in out:
            raise ConfigError(f"{label}: --budget given twice for {b.quantity} "
                              f"({b} and an earlier one); give one")
        out[name] = b.to(action).value
    return out


def _field_for(cls, b: Budget, spans: dict) -> str | None:
    """The field of ``cls`` that budget ``b`` sets (a field of a range is set by a range)."""
    in_span = {name for ends in spans.values() for name in ends}
    for name, kind in budget_fields(cls).items():
        if kind.partition("-")[2] == b.quantity and name not in in_span:
            return name
    return None
