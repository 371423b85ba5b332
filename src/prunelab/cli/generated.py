"""Command-line options generated from the registered configs' fields.

A command declared with ``cls=generated_command("strategies", "recoveries")`` gets one
option per flat option of those registries (from the catalog, :mod:`prunelab.cli.catalog`;
see :mod:`prunelab.pruning.options` for the flat names): a field added to a registered
config, or a method registered by a plugin, shows up in ``--help`` and is accepted on the
command line with no change here. The options are added when click first asks the command
for its parameters (parsing or help), so importing the CLI reads no catalog; placeholders
such as ``{strategies}`` in a hand-written option's help are filled then too.

The command function reads the values with :func:`values` (``ctx: typer.Context``):
``{flat name: value}``, ``None`` for an option not given (a switch: ``True`` / ``False``
when given), tuples for list fields.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import typer
import typer.core

from prunelab import interrupts
from prunelab.cli import catalog as _catalog
from prunelab.cli.common import state
from prunelab.errors import ConfigError

_PREFIX = "gen__"
_META = "prunelab.generated"
#: the registry kinds, as the option that picks the piece names them in errors and panels
CHOICE = {"strategies": "--strategy", "recoveries": "--recovery", "width_scores": "--score",
          "width_allocations": "--allocation", "sparsity_methods": "--method",
          "sparsity_allocations": "--allocation", "factor_methods": "--method",
          "probes": "--probe", "presses": "--press"}
_TYPES = {"int": int, "float": float, "str": str, "tuple": str}


@dataclasses.dataclass
class GenOption:
    """One generated option: its flat name, flag, kind (``bool`` / ``int`` / ``float`` /
    ``str`` / ``tuple``), the pieces owning it (``(kind, name) -> field``) and their
    defaults, the help of its first owner, a switch's value when given; ``aliases``: more
    spellings of the flag (metadata ``"aliases"``); ``toggle``: a ``--x/--no-x`` pair,
    ``None`` when neither is given (metadata ``"toggle"``)."""

    flat: str
    flag: str
    kind: str
    help: str
    owners: dict = dataclasses.field(default_factory=dict)
    defaults: list = dataclasses.field(default_factory=list)
    choices: list | None = None
    range: list | None = None
    switch_value: bool | None = None
    aliases: list = dataclasses.field(default_factory=list)
    toggle: bool = False
    partial: bool = False  # owned by some of its kind's pieces only: --help names them

    def owned_by(self, kind: str, name: str) -> str | None:
        return self.owners.get((kind, name))


def gen_options(cat: dict, kinds: tuple[str, ...], skip=(), prefix: str = ""
                ) -> list[GenOption]:
    """The options of the pieces of ``kinds`` (fields of kind ``other`` are left to
    ``--set``; a field whose metadata names a ``budget`` kind is set by ``--budget``; the
    flat names in ``skip`` are the command's own business, e.g. set by a hand-written
    option under another name); ``prefix`` goes in front of every flag (``press-``:
    ``--press-window``)."""
    out: dict[str, GenOption] = {}
    for kind in kinds:
        for e in cat["kinds"].get(kind, []):
            for f in e["fields"]:
                if f["kind"] == "other" or f.get("budget") or f["flat"] in skip:
                    continue
                opt = out.get(f["flat"])
                if opt is None:
                    opt = out[f["flat"]] = GenOption(
                        f["flat"], "--" + prefix + f["flag"].lstrip("-"), f["kind"], f["help"],
                        choices=f["choices"], range=f["range"],
                        aliases=list(f.get("aliases") or ()),
                        toggle=bool(f.get("toggle")) and f["kind"] == "bool")
                    if f["kind"] == "bool" and not opt.toggle:  # --x True, --no-x False
                        opt.switch_value = not (f["negate"] or f["default"] is True)
                        if not opt.switch_value and not f["negate"]:
                            opt.flag = "--no-" + opt.flag.lstrip("-")
                opt.owners[(kind, e["name"])] = f["name"]
                opt.defaults.append(f["default"])
        pieces = {e["name"] for e in cat["kinds"].get(kind, [])}
        for opt in out.values():
            mine = {n for k, n in opt.owners if k == kind}
            opt.partial = opt.partial or (len(pieces) > 1 and bool(mine) and mine != pieces)
    return list(out.values())


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _help(opt: GenOption) -> str:
    """The field's help, its default(s) added (``(default dense for wanda; modified
    otherwise)`` where the pieces differ), escaped for rich markup."""
    text = opt.help or opt.flat.replace("_", " ")
    names = [n for _, n in opt.owners]
    if opt.partial and not any(n in text for n in names):
        text = f"{' / '.join(names)}: {text}"  # whose option it is (help names no owner)
    shown = [d for d in opt.defaults if d not in (None, "", [])]
    if opt.kind != "bool" and "default" not in text and shown:
        if len(shown) == len(opt.defaults) and all(d == shown[0] for d in shown):
            text += f" (default {_show(shown[0])})"
        elif len(shown) == len(opt.defaults):
            common = max(map(_show, shown), key=[_show(d) for d in shown].count)
            rare = [f"{_show(d)} for {name}" for (_, name), d
                    in zip(opt.owners, opt.defaults, strict=True) if _show(d) != common]
            text += f" (default {'; '.join(rare)}; {common} otherwise)"
    if getattr(typer.core, "DEFAULT_MARKUP_MODE", None) is not None:
        text = text.replace("[", "\\[")
    return text


def _checker(opt: GenOption):
    """Choices / range check of a value (click's usage error, exit 2)."""
    if not opt.choices and not opt.range:
        return None

    def check(value):
        if value is None:
            return value
        if opt.choices and value not in opt.choices:
            raise typer.BadParameter(f"must be one of {', '.join(map(str, opt.choices))}")
        if opt.range:
            lo, hi = opt.range
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise typer.BadParameter(f"must be in [{lo}, {hi}]")
        return value

    return check


def _click_params(opts: list[GenOption], panels: dict[str, str]) -> list:
    """Click parameters of ``opts``, built by typer from a synthetic signature (so they
    match the typer version in use)."""
    params = []
    for opt in opts:
        panel = panels.get(next(iter(opt.owners))[0])
        if opt.toggle:
            ann = Optional[bool]
            option = typer.Option(None, f"{opt.flag}/--no-{opt.flag.lstrip('-')}",
                                  help=_help(opt), rich_help_panel=panel, show_default=False)
        elif opt.kind == "bool":
            ann = bool
            option = typer.Option(False, opt.flag, *opt.aliases, help=_help(opt),
                                  rich_help_panel=panel)
        else:
            ann = Optional[_TYPES[opt.kind]]
            option = typer.Option(None, opt.flag, *opt.aliases, help=_help(opt),
                                  rich_help_panel=panel, show_default=False,
                                  callback=_checker(opt))
        params.append(inspect.Parameter(_PREFIX + opt.flat, inspect.Parameter.KEYWORD_ONLY,
                                        default=option, annotation=ann))

    def stub(**kwargs):  # pragma: no cover - never called
        return kwargs

    stub.__signature__ = inspect.Signature(params)
    tmp = typer.Typer(add_completion=False)
    tmp.command()(stub)
    return list(typer.main.get_command(tmp).params)


def fill_help(text: str, cat: dict) -> str:
    """``text`` with the catalog placeholders (``{strategies}``, ``{recovery_names}``,
    ``{width_scores}``, ``{sparsity_methods}``, ``{probes}``, ...) filled in."""
    kinds = cat["kinds"]

    def described(kind: str) -> str:
        return " | ".join(f"{e['name']} ({e['doc']})" if e["doc"] else e["name"]
                          for e in kinds[kind])

    def plain(kind: str, sep: str = " | ") -> str:
        return sep.join(e["name"] for e in kinds[kind])

    def by_unit() -> str:
        return "; ".join(f"{u}: " + " | ".join(e["name"] for e in kinds["width_scores"]
                                               if u in e.get("units", ()))
                         for u in ("heads", "ffn", "joint"))

    fills = {"{strategies}": lambda: described("strategies"),
             "{recoveries}": lambda: described("recoveries"),
             "{recovery_names}": lambda: plain("recoveries"),
             "{width_scores}": by_unit,
             "{width_allocations}": lambda: described("width_allocations"),
             "{sparsity_methods}": lambda: plain("sparsity_methods"),
             "{sparsity_allocations}": lambda: plain("sparsity_allocations"),
             "{probes}": lambda: plain("probes", ", "),
             "{presses}": lambda: plain("presses", ", "),
             "{factor_methods}": lambda: described("factor_methods")}
    for key, fill in fills.items():
        if key in text:
            text = text.replace(key, fill())
    return text


class GeneratedCommand(typer.core.TyperCommand):
    """A typer command whose registry options and catalog-filled help are added lazily
    (see the module docstring); subclasses set :attr:`kinds`. ``params`` includes the
    generated options (the first read prepares them), so code that inspects a command's
    parameters sees them as if declared by hand."""

    kinds: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()
    prefix: str = ""
    _gen: list[GenOption] = []
    _all: list | None = None

    @property
    def params(self) -> list:
        if self._all is None:
            self._all = [*self._base, *self._generate()]
        return self._all

    @params.setter
    def params(self, value: list) -> None:
        self._base, self._all = list(value), None

    def _generate(self) -> list:
        needs_help = any("{" in (getattr(p, "help", None) or "") for p in self._base)
        if not self.kinds and not needs_help:
            return []
        with interrupts.deferred():  # imports torch, transformers and every registry
            cat = _catalog.get(live=None if state.get("help") else True)
        for p in self._base:
            if "{" in (getattr(p, "help", None) or ""):
                p.help = fill_help(p.help, cat)
        taken = {o for p in self._base for o in (*p.opts, *p.secondary_opts)}
        self._gen = [o for o in gen_options(cat, self.kinds, self.skip, self.prefix)
                     if o.flag not in taken and not taken.intersection(o.aliases)
                     and not (o.toggle and "--no-" + o.flag.lstrip("-") in taken)]
        panels = {k: f"{CHOICE.get(k, k)} options" for k in self.kinds}
        return _click_params(self._gen, panels)

    def parse_args(self, ctx, args):
        _refuse_repeats(self, ctx, args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        got = {k[len(_PREFIX):]: ctx.params.pop(k) for k in list(ctx.params)
               if k.startswith(_PREFIX)}
        ctx.meta[_META] = (self._gen, got)
        interrupts.check()  # a Ctrl-C that library code swallowed while the options were read
        return super().invoke(ctx)


def _refuse_repeats(command, ctx, args: list[str]) -> None:
    """An option that takes one value, given twice (``--budget a --budget b``, ``--x
    --no-x``), is a usage error naming it: never the last one silently."""
    if "--help" in args:
        return
    try:
        _, _, order = command.make_parser(ctx).parse_args(args=list(args))
    except Exception:  # noqa: BLE001 - the real parse reports it
        return
    seen: set = set()
    for param in order:
        if getattr(param, "multiple", False) or getattr(param, "count", False) or \
                not getattr(param, "opts", None) or param.param_type_name != "option":
            continue
        if param.name in seen:
            raise ConfigError(f"{param.opts[0]} is given twice; give it once")
        seen.add(param.name)


def generated_command(*kinds: str, skip: tuple[str, ...] = (), prefix: str = "") -> type:
    """A :class:`GeneratedCommand` class generating the options of ``kinds`` (but not the
    flat names in ``skip``; ``prefix`` before every flag)."""
    return type("GeneratedCommand_" + "_".join(kinds), (GeneratedCommand,),
                {"kinds": tuple(kinds), "skip": tuple(skip), "prefix": prefix})


@dataclasses.dataclass
class Values:
    """The generated options of one invocation."""

    options: list[GenOption]
    given: dict[str, Any]

    def flat(self) -> dict[str, Any]:
        """``{flat name: value}``: ``None`` when not given; switches ``True`` / ``False``
        when given; lists parsed from ``a,b,c`` into tuples."""
        out = {}
        for opt in self.options:
            raw = self.given.get(opt.flat)
            if opt.toggle:
                out[opt.flat] = raw
            elif opt.kind == "bool":
                out[opt.flat] = opt.switch_value if raw else None
            elif opt.kind == "tuple":
                items = tuple(p.strip() for p in (raw or "").split(",") if p.strip())
                out[opt.flat] = items or None
            else:
                out[opt.flat] = raw
        return out

    def piece(self, kind: str, name: str, label: str) -> dict[str, Any]:
        """``{field: value}`` of the given options owned by the piece ``name`` of
        ``kind``; a given option owned only by other pieces of ``kind`` is an error
        (``--owl-m does not apply to --allocation uniform``)."""
        flat = self.flat()
        out = {}
        for opt in self.options:
            value = flat[opt.flat]
            if value is None or not any(k == kind for k, _ in opt.owners):
                continue
            field = opt.owned_by(kind, name)
            if field is None:
                raise ConfigError(f"{opt.flag} does not apply to {label}")
            out[field] = value
        return out


    def given_flags(self) -> list[str]:
        """The flags of the generated options given on the command line."""
        flat = self.flat()
        return [o.flag for o in self.options if flat[o.flat] is not None]

    def routed(self, kind: str, names) -> dict[str, Any]:
        """``{field: value}`` of the given options of ``kind`` for several pieces used
        together (the probes of one run): each option under its field name in the first of
        ``names`` that owns it, else in its first owner, so that the receiver's own routing
        reports an option none of ``names`` takes."""
        flat = self.flat()
        out = {}
        for opt in self.options:
            value = flat[opt.flat]
            owners = [n for k, n in opt.owners if k == kind]
            if value is None or not owners:
                continue
            name = next((n for n in names if n in owners), owners[0])
            out[opt.owned_by(kind, name)] = value
        return out


def values(ctx) -> Values:
    """The generated options' values of the running command."""
    gen, got = ctx.meta.get(_META, ([], {}))
    return Values(gen, got)
