"""Registries of pluggable pieces, one per kind (pruning methods, depth selections and
recoveries, width scores, allocations, presses, probes, pruners, task metrics), and
``import_submodules``, the one way a package finds its pieces.

Every piece is registered the same way, with the decorator ``@REGISTRY.register(key,
**meta)`` of its kind's :class:`Registry`:

* a config registry (the default) holds frozen dataclasses by name;
* ``Registry(kind, configs=False)`` holds any object (a function, a class) by name;
* ``Registry(kind, by_type=True)`` holds handlers by config *type*:
  :meth:`Registry.for_config` returns the one registered for the nearest base class.

A piece is a frozen dataclass registered under a name with :meth:`Registry.register`.
Configs are strict: an option a config does not take is a :class:`ConfigError` naming the
key and the valid ones (never silently dropped). A registered config round-trips through
:func:`to_dict` / :meth:`Registry.from_dict`; nested registered configs are written as
dicts carrying their ``name``.

Registration is open: a user registers a new piece from outside the package, e.g.::

    @SPARSITY_METHODS.register("my-method")
    @dataclass(frozen=True)
    class MyMethod(SparsityMethod): ...

but never silently over another: a key already taken (a built-in's name, another plugin's)
is a one-line :class:`ConfigError` naming both pieces and where they come from, unless the
new piece asks with ``register(key, replace=True)``, which is then printed as a warning.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import pkgutil
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from prunelab import log
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
    """Key -> registered piece, for one kind of piece (``kind`` names it in errors).

    ``configs`` (default): pieces are dataclasses registered by name (each gets
    ``registry_name``); ``configs=False``: any object by name. ``by_type``: keys are config
    types, looked up along the MRO by :meth:`for_config`; ``instantiate`` registers an
    instance of the decorated class (a handler with no state of its own); ``missing``
    makes the one-line message of a failed :meth:`for_config` from the config's class.
    A taken key is refused (see the module docstring).
    """

    def __init__(self, kind: str, *, configs: bool = True, by_type: bool = False,
                 instantiate: bool = False, missing: Callable[[type], str] | None = None):
        self.kind = kind
        self.configs = configs and not by_type
        self.by_type = by_type
        self.instantiate = instantiate
        self._missing = missing
        self._classes: dict[Any, Any] = {}
        self._meta: dict[Any, dict] = {}

    def register(self, key: Any, *, replace: bool = False, **meta) -> Callable[[Any], Any]:
        """Decorator: register the decorated piece under ``key`` (a name, or a config type
        for a ``by_type`` registry); ``meta`` is free per-kind data (read back with
        :meth:`meta`). A config gets ``registry_name``; returns the piece unchanged. A key
        taken by another piece is a :class:`ConfigError` naming both, unless ``replace``
        (printed as a warning; the key keeps its place in the listing order)."""
        if self.by_type and not isinstance(key, type):
            raise TypeError(f"a {self.kind} is registered for a config type, got {key!r}")

        def wrap(obj: Any) -> Any:
            if self.configs and not dataclasses.is_dataclass(obj):
                raise TypeError(f"{obj.__name__}: a registered {self.kind} must be a "
                                "dataclass")
            old = self._classes.get(key)
            if old is not None and not _same_piece(old, obj):
                label = key.__name__ if isinstance(key, type) else repr(key)
                if not replace:
                    raise ConfigError(
                        f"{self.kind} {label} is already registered by {source_of(old)}; "
                        f"{source_of(obj)} cannot take it (give it another name, or "
                        f"register({label}, replace=True) to replace it on purpose)")
                log.warn(f"{self.kind} {label} of {source_of(old)} is replaced by "
                         f"{source_of(obj)} (register(..., replace=True))")
            if self.configs:
                obj.registry_name = key
            self._classes[key] = obj() if self.instantiate else obj
            self._meta[key] = dict(meta)
            return obj
        return wrap

    def unregister(self, key: Any) -> None:
        self._classes.pop(key, None)
        self._meta.pop(key, None)

    def names(self) -> list:
        """The keys, in registration order."""
        return list(self._classes)

    def __contains__(self, key: object) -> bool:
        return key in self._classes

    def __iter__(self) -> Iterator:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def get(self, name: Any) -> Any:
        if name not in self._classes:
            raise ConfigError(f"unknown {self.kind} {name!r}; available: "
                              f"{', '.join(map(str, self._classes)) or '(none)'}")
        return self._classes[name]

    def meta(self, name: Any) -> dict:
        self.get(name)
        return self._meta[name]

    def for_config(self, config: Any) -> Any:
        """The piece registered for ``type(config)`` (or ``config`` itself when it is a
        class) or its nearest base class (``by_type`` registries)."""
        cls = config if isinstance(config, type) else type(config)
        for base in cls.__mro__:
            if base in self._classes:
                return self._classes[base]
        if self._missing is not None:
            raise ConfigError(self._missing(cls))
        raise ConfigError(f"no {self.kind} for {cls.__name__}; registered for: "
                          f"{', '.join(c.__name__ for c in self._classes) or '(none)'}")

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
        _check_bools(cls, d, f"{self.kind} {name!r}")
        return cls(**{k: _decode(v, cls, k) for k, v in d.items()})


def _check_bools(cls, given: dict, what: str) -> None:
    """A field declared ``bool`` takes ``true`` / ``false`` only: YAML's ``"false"`` is a
    non-empty string, so taking it as truthy would silently do the opposite."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls)} \
        if dataclasses.is_dataclass(cls) else {}
    for key, value in given.items():
        if kinds.get(key) in (bool, "bool") and not isinstance(value, bool):
            raise ConfigError(f"{what}: {key} must be true or false, got {value!r}")


def _piece_type(obj: Any) -> Any:
    """A class or function as it is; an instance (``instantiate``) by its class."""
    return obj if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) \
        else type(obj)


def _same_piece(old: Any, new: Any) -> bool:
    """The same object, or the same class or function defined again by the same module
    (a module reloaded): not a collision."""
    a, b = _piece_type(old), _piece_type(new)
    if a is b or old is new:
        return True
    return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == \
        (getattr(b, "__module__", None), getattr(b, "__qualname__", None))


def source_of(obj: Any) -> str:
    """Where a registered piece comes from: ``module.Name`` for an importable module
    (prunelab's own pieces), ``FILE (Name)`` for a plugin file."""
    piece = _piece_type(obj)
    module = getattr(piece, "__module__", None) or "?"
    name = getattr(piece, "__qualname__", None) or type(piece).__name__
    if module.startswith("prunelab_plugin_"):  # a --plugin file: its path says more
        path = getattr(sys.modules.get(module), "__file__", None)
        if path:
            return f"{path} ({name})"
    return f"{module}.{name}"


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


_REGISTERS = re.compile(r"^@[A-Za-z_][\w.]*\.register\(", re.MULTILINE)


def _registers(path: str) -> bool:
    """True when the module (or any module of the package) at ``path`` registers a piece:
    a line starting with ``@<REGISTRY>.register(``."""
    if os.path.isdir(path):
        return any(_registers(os.path.join(root, f))
                   for root, _, files in os.walk(path) for f in files if f.endswith(".py"))
    with open(path, encoding="utf-8") as fh:
        return bool(_REGISTERS.search(fh.read()))


def import_submodules(package_name: str, first: tuple[str, ...] = ()) -> list[str]:
    """Import the submodules of ``package_name`` that register pieces, so that importing a
    package registers everything in it: a new piece is one new file.

    The modules (or subpackages) named in ``first`` are imported first, in that order (the
    order a registry lists its pieces in: ``--help``, docs, error messages); then every
    other submodule or subpackage whose source has a line starting with
    ``@<REGISTRY>.register(``, by name. A subpackage registers its own modules the same way
    from its ``__init__``. Returns the imported submodule names, in import order.
    """
    package = importlib.import_module(package_name)
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        base = os.path.join(info.module_finder.path, info.name)
        found[info.name] = base if info.ispkg else base + ".py"
    missing = [name for name in first if name not in found]
    if missing:
        raise ImportError(f"{package_name} has no submodule {missing[0]!r}")
    order = list(first) + sorted(n for n in found if n not in first and _registers(found[n]))
    for name in order:
        importlib.import_module(f"{package_name}.{name}")
    return order
