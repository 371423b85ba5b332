"""Typed recipe fields: a YAML value is checked against the type hint of the dataclass
field it sets, as the command line checks a flag (a recipe is parsed into the same typed
configs as the CLI).

``bool`` takes only ``true`` / ``false`` (the string ``"false"`` is an error, never
truthy); ``int`` an integer (not a boolean); ``float`` a number (a YAML integer is read
as a float); ``str`` a string; ``Literal[...]`` one of its values; a tuple / list field
a list, each item of the item type it declares (``tuple[str, ...]``: strings);
``X | None`` also ``null``. Fields whose type is none of these
(nested configs, ``Any``) are left to the config's own checks.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from prunelab.errors import ConfigError

_SIMPLE = (bool, int, float, str)


def _hints(cls: type) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: left to the config's own checks
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _accepts(tp: Any, value: Any) -> tuple[bool, Any, str | None]:
    """``(ok, value as the field takes it, expected)``; ``expected`` None: not checked."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return True, None, "null"
        rest = [a for a in args if a is not type(None)]
        words = []
        for a in rest:
            ok, v, what = _accepts(a, value)
            if what is None:  # a part that is not checked: leave the value alone
                return True, value, None
            if ok:
                return True, v, what
            words.append(what)
        if type(None) in args:
            words.append("null")
        return False, value, " or ".join(words)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        ok = any(value == c and type(value) is type(c) for c in choices)
        return ok, value, "one of " + ", ".join(map(str, choices))
    if tp is bool:
        return isinstance(value, bool), value, "true or false"
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value, "an integer"
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value, "a number"
        return True, float(value), "a number"
    if tp is str:
        return isinstance(value, str), value, "a string"
    if tp in (tuple, list) or origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False, value, "a list"
        kinds = {a for a in typing.get_args(tp) if a is not Ellipsis}
        if len(kinds) != 1:  # a bare or mixed tuple: the items are the config's business
            return True, tuple(value), "a list"
        items = []
        for item in value:
            ok, v, what = _accepts(next(iter(kinds)), item)
            if what is None:
                return True, tuple(value), "a list"
            if not ok:
                return False, value, f"a list of {_plural(what)}"
            items.append(v)
        return True, tuple(items), "a list"
    return True, value, None


def _plural(what: str) -> str:
    """``a string`` -> ``strings``, ``an integer`` -> ``integers``."""
    for article in ("a ", "an "):
        if what.startswith(article) and " " not in what[len(article):]:
            return what[len(article):] + "s"
    return f"values ({what})"


def typed(cls: type, opts: dict, skip: tuple[str, ...] = ()) -> dict:
    """``opts`` with each value checked against ``cls``'s field type (floats from YAML
    integers); a :class:`ConfigError` ``FIELD must be EXPECTED, got VALUE`` otherwise.
    Keys that are not fields of ``cls`` and ``skip`` are returned unchanged."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    regs = getattr(cls, "_registries", None) or {}
    out = dict(opts)
    for key, value in opts.items():
        if key in skip or key not in names:
            continue
        if key in regs and isinstance(value, dict) and isinstance(value.get("name"), str) \
                and value["name"] in regs[key]:  # a nested piece: {name: NAME, fields}
            try:
                out[key] = typed(regs[key].get(value["name"]), value, skip=("name",))
            except ConfigError as exc:
                raise ConfigError(f"{key} {value['name']!r}: {exc}") from None
            continue
        if key not in hints:
            continue
        ok, v, what = _accepts(hints[key], value)
        if not ok:
            raise ConfigError(f"{key} must be {what}, got {value!r}")
        out[key] = v
    return out
