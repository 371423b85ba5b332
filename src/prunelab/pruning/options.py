"""Flat command-line options <-> nested registered configs.

A command line is flat (``--strategy beam --beam-width 3 --recovery lra --rank 8``) while a
config nests one registered piece per choice (``Depth(select=Beam(width=3),
recovery=Lra(rank=8))``). Each field of a registered piece names its flat option in its
dataclass metadata (``metadata={"cli": "beam_width", "help": "..."}``, or a ``"flag"`` such
as ``"--owl-m"``; default: the field name, see :func:`option_name`) and carries a one-line
``help``. :func:`piece_from_flat` builds the chosen piece from
the flat options that belong to it and refuses those that belong to another piece of the
same registry; :func:`flat_options` lists every flat option of a registry for a CLI
generator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from prunelab.errors import ConfigError
from prunelab.registry import Registry


def piece_fields(cls: type) -> list[dataclasses.Field]:
    """The user-facing fields of a registered piece (init fields not starting with ``_``)."""
    return [f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def option_name(name: str, metadata) -> str:
    """The flat option name of a field called ``name`` with ``metadata``: its ``"cli"``
    entry, else its ``"flag"`` without the dashes (``"--owl-m"`` -> ``owl_m``), else the
    field name."""
    if metadata.get("cli"):
        return metadata["cli"]
    if metadata.get("flag"):
        return metadata["flag"].lstrip("-").replace("-", "_")
    return name


def flag_of(f: dataclasses.Field) -> str:
    """The flat option name of a piece field (``beam_width`` for ``Beam.width``)."""
    return option_name(f.name, f.metadata)


def _given(f: dataclasses.Field, value: Any) -> bool:
    """``None`` means "not given"; so does ``False`` for a switch that is off by default."""
    return value is not None and not (value is False and f.default is False)


@dataclass(frozen=True)
class FlatOption:
    """One flat option of a registry: its name, the pieces that take it (registered name
    -> field name), its default (of the first piece), type and help."""

    flag: str
    owners: dict
    default: Any
    type: Any
    help: str


def flat_options(registry: Registry) -> dict[str, FlatOption]:
    """Every flat option of ``registry``'s pieces, by flag (for a CLI generator)."""
    out: dict[str, FlatOption] = {}
    for name in registry:
        for f in piece_fields(registry.get(name)):
            flag = flag_of(f)
            if flag in out:
                out[flag].owners[name] = f.name
                continue
            default = f.default if f.default is not dataclasses.MISSING else None
            out[flag] = FlatOption(flag, {name: f.name}, default, f.type,
                                   f.metadata.get("help", ""))
    return out


def cli_flag(flag: str) -> str:
    return "--" + flag.replace("_", "-")


def piece_from_flat(registry: Registry, name: str | None, flat: dict, choice: str
                    ) -> tuple[Any, set[str]]:
    """The ``registry`` piece ``name`` (``None``: no piece) with the options of ``flat``
    that belong to it; returns it and the flat names this registry owns (so the caller
    knows which of ``flat`` are left for itself). A given option that belongs only to
    other pieces is a :class:`ConfigError` (``--rank applies to --recovery lra only``);
    ``choice`` is the option that picks the piece (``--recovery``)."""
    options = flat_options(registry)
    own = {} if name is None else {flag_of(f): f.name for f in piece_fields(registry.get(name))}
    kwargs = {}
    for flag, value in flat.items():
        if flag not in options:
            continue
        cls_field = next(f for f in piece_fields(registry.get(next(iter(
            options[flag].owners)))) if flag_of(f) == flag)
        if not _given(cls_field, value):
            continue
        if flag not in own:
            owners = " or ".join(options[flag].owners)
            raise ConfigError(f"{cli_flag(flag)} applies to {choice} {owners} only")
        kwargs[own[flag]] = value
    piece = None if name is None else registry.make(name, **kwargs)
    return piece, set(options)
