"""Registries of typed configs: one per kind of pluggable piece (sparsity methods, depth
selections and recoveries, width scores, allocations, probes, pruners).

A piece is a frozen dataclass registered under a name with :meth:`Registry.register`.
Configs are strict: an option a config does not take is a :class:`ConfigError` naming the
key and the valid ones (never silently dropped). A registered config round-trips through
:func:`to_dict` / :meth:`Registry.from_dict`; nested registered configs are written as
dicts carrying their ``name``.

Registration is open: a user registers a new piece from outside the package, e.g.::

    @SPARSITY_METHODS.register("my-method")
    @dataclass(frozen=True)
    class MyMethod(SparsityMethod): ...
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

from prunelab.errors import ConfigError


def check_range(name: str, value, low=None, high=None, integer: bool = False) -> None:
    """Raise :class:`ConfigError` naming the field, its value and the accepted range when
    ``value`` is outside ``[low, high]``, not a number, nan or infinite (``integer``: must
    be an ``int``, not a ``bool``)."""
    if integer and (not isinstance(value, int) or isinstance(value, bool)):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    lo = "-inf" if low is None else low
    hi = "inf" if high is None else high
    if not math.isfinite(value) or (low is not None and value < low) \
            or (high is not None and value > high):
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {value!r}")


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def field_metadata(cls, f: dataclasses.Field) -> dict:
    """``f``'s metadata on ``cls``; a field a subclass overrides without ``help`` keeps the
    metadata of the nearest base that declares it."""
    meta = dict(f.metadata)
    for base in cls.__mro__[1:]:
        if "help" in meta or not dataclasses.is_dataclass(base):
            break
        inherited = {g.name: g for g in dataclasses.fields(base)}.get(f.name)
        meta = {**(dict(inherited.metadata) if inherited else {}), **meta}
    return meta


def strict_kwargs(cls, options: dict, what: str | None = None) -> None:
    """Raise :class:`ConfigError` if ``options`` has a key ``cls`` does not take."""
    valid = _fields(cls)
    unknown = [k for k in options if k not in valid]
    if unknown:
        label = what or getattr(cls, "registry_name", cls.__name__)
        raise ConfigError(f"{label} has no option {unknown[0]!r}; valid options: "
                          f"{', '.join(valid) or '(none)'}")


class Registry:
    """Name -> config class, for one kind of piece (``kind`` names it in errors)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type] = {}
        self._meta: dict[str, dict] = {}

    def register(self, name: str, **meta) -> Callable[[type], type]:
        """Class decorator: register ``cls`` as ``name``; ``meta`` is free per-kind data
        (read back with :meth:`meta`). Sets ``cls.registry_name``."""
        def wrap(cls: type) -> type:
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__}: a registered {self.kind} must be a "
                                "dataclass")
            cls.registry_name = name
            self._classes[name] = cls
            self._meta[name] = dict(meta)
            return cls
        return wrap

    def unregister(self, name: str) -> None:
        self._classes.pop(name, None)
        self._meta.pop(name, None)

    def names(self) -> list[str]:
        return list(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def get(self, name: str) -> type:
        if name not in self._classes:
            raise ConfigError(f"unknown {self.kind} {name!r}; available: "
                              f"{', '.join(self._classes) or '(none)'}")
        return self._classes[name]

    def meta(self, name: str) -> dict:
        self.get(name)
        return self._meta[name]

    def name_of(self, obj: Any) -> str:
        """The registered name of a config instance or class."""
        cls = obj if isinstance(obj, type) else type(obj)
        for name, c in self._classes.items():
            if c is cls:
                return name
        raise ConfigError(f"{cls.__name__} is not a registered {self.kind}")

    def make(self, name_or_config: Any, **options) -> Any:
        """A config from a name and options (strict), or a config instance unchanged
        (then ``options`` must be empty)."""
        if not isinstance(name_or_config, str):
            if options:
                raise ConfigError(f"options {sorted(options)} given with a ready "
                                  f"{self.kind} config")
            self.name_of(name_or_config)
            return name_or_config
        cls = self.get(name_or_config)
        strict_kwargs(cls, options, f"{self.kind} {name_or_config!r}")
        return cls(**options)

    def from_dict(self, d: dict | str) -> Any:
        """Rebuild a config from :func:`to_dict` output (``{"name": ..., **fields}``) or a
        bare name; unknown keys are an error."""
        if isinstance(d, str):
            return self.make(d)
        if not isinstance(d, dict) or "name" not in d:
            raise ConfigError(f"a {self.kind} is a name or a dict with a 'name', got {d!r}")
        d = dict(d)
        name = d.pop("name")
        cls = self.get(name)
        strict_kwargs(cls, d, f"{self.kind} {name!r}")
        return cls(**{k: _decode(v, cls, k) for k, v in d.items()})


def _decode(value: Any, cls: type, field_name: str) -> Any:
    """Nested registered configs come back through the registry their class names in
    ``_registries`` (a class attribute mapping field name -> Registry)."""
    regs = getattr(cls, "_registries", {}) or {}
    if field_name in regs and isinstance(value, (dict, str)):
        return regs[field_name].from_dict(value)
    if isinstance(value, list):
        return tuple(value)
    return value


def to_dict(config: Any) -> dict:
    """``{"name": registered name, **fields}``; nested dataclasses recursively; tuples as
    lists (JSON / YAML friendly)."""
    out: dict[str, Any] = {}
    name = getattr(config, "registry_name", None)
    if name is not None:
        out["name"] = name
    for f in dataclasses.fields(config):
        if not f.init or f.name.startswith("_"):
            continue
        out[f.name] = _encode(getattr(config, f.name))
    return out


def _encode(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_dict(value)
    if isinstance(value, (tuple, list)):
        return [_encode(v) for v in value]
    return value
