"""What every command shares: the console, global flags, model-loading options, the
output guard (path checks, one writer, the line printed on Ctrl-C) and small parsers."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import typing
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console

from prunelab.budget import check_given
from prunelab.errors import ConfigError

out = Console(highlight=False)
#: process-wide CLI state: --verbose, and what Ctrl-C reports as saved
state: dict = {"verbose": False, "on_interrupt": None}

ModelOpt = typer.Option("smollm2-135m", "--model", "-m",
                        help="smollm2-135m | minilm-l6 | gemma3-270m | dinov2-small | "
                        "whisper-tiny-en | whisper-base | qwen2.5-coder-0.5b | "
                        "qwen2.5-coder-1.5b | DIR | FILE.gguf | hub id")
DtypeOpt = typer.Option("auto", help="float32 (CPU default), bfloat16 (CUDA default), float16")
DeviceOpt = typer.Option("cpu", help="cpu, cuda[:N] or auto")
RemoteOpt = typer.Option(False, "--trust-remote-code",
                         help="allow model code from the checkpoint (and the reference)")
PickleOpt = typer.Option(False, "--allow-pickle", help="load weights stored only as a "
                         "pickle (pytorch_model.bin; a pickle can run code)")
MissingOpt = typer.Option(False, "--allow-missing-weights", help="load a checkpoint that "
                          "lacks weights or holds unexpected / mis-shaped ones (they stay "
                          "random)")
OffloadOpt = typer.Option(False, "--offload", help="keep the weights on the CPU; calibration "
                          "moves one block at a time to --device")
StreamOpt = typer.Option(False, "--stream", help="layer-wise loading from disk: blocks are "
                         "read from the safetensors shards one at a time (memory ~ one block)")
BatchOpt = typer.Option(8, help="windows per block call")
CalibDtypeOpt = typer.Option("float32", help="float32 | bfloat16: the dtype of the blocks' "
                             "matmuls during calibration (statistics, masks and updates stay "
                             "float32; the saved model keeps its dtype)")
StackOpt = typer.Option(None, "--stack", help="Whisper: encoder (default) or decoder, the "
                        "stack probes and pruning act on")
RayOpt = typer.Option(None, "--ray", help="run the points as Ray tasks: 'auto' (a local "
                      "Ray instance) or HOST:PORT of a Ray cluster (shared --out folder)")
CpusOpt = typer.Option(1.0, "--cpus-per-point", help="with --ray: CPUs per point")
GpusOpt = typer.Option(0.0, "--gpus-per-point", help="with --ray: GPUs per point")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The calibration windows of a command that prunes with data: the one place their
    options (``--data``, ``--samples``, ``--seqlen``, ``--seed``, ``--batch-size``) are
    written; :func:`calibration_options` generates them from these fields (a command
    changes a default or a help line, never spells an option again)."""

    data: str = dataclasses.field(default="wiki-vital:calib",
                                  metadata={"help": "calibration data spec"})
    samples: int = dataclasses.field(default=32, metadata={"help": "calibration windows"})
    seqlen: int = dataclasses.field(default=256, metadata={"help": "window length in tokens"})
    seed: int = dataclasses.field(default=0, metadata={"help": "window sampling seed"})
    batch_size: int = dataclasses.field(default=8, metadata={"help": "windows per block call"})


def calibration_options(**overrides):
    """Decorator of a command function that takes ``calib: Calibration``: the command gets
    one option per field of :class:`Calibration` (flag ``--field-name``), in place of the
    ``calib`` parameter, and receives their values as one :class:`Calibration`.
    ``overrides``: ``FIELD=default`` or ``FIELD=(default, help)`` for this command."""
    fields = {f.name: f for f in dataclasses.fields(Calibration)}
    types = typing.get_type_hints(Calibration)
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"calibration_options: no calibration field {unknown[0]!r}")

    def option(name: str):
        f = fields[name]
        default, text = f.default, f.metadata["help"]
        given = overrides.get(name, default)
        default, text = given if isinstance(given, tuple) else (given, text)
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                 annotation=types[name],
                                 default=typer.Option(default, "--" + name.replace("_", "-"),
                                                      help=text))

    def wrap(fn):
        sig = inspect.signature(fn, eval_str=True)
        if "calib" not in sig.parameters:
            raise TypeError(f"{fn.__name__} takes no calib: Calibration parameter")
        params = []
        for p in sig.parameters.values():
            if p.name == "calib":
                params += [option(n) for n in fields]
            else:
                params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else p)

        @functools.wraps(fn)
        def command(*args, **kwargs):
            calib = Calibration(**{n: kwargs.pop(n) for n in fields})
            return fn(*args, calib=calib, **kwargs)

        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params
                                   if p.annotation is not inspect.Parameter.empty}
        del command.__wrapped__  # typer reads the signature above, not the function's
        return command
    return wrap


def given_budget(value):
    """Click callback of ``--budget``: an empty value (``--budget "$UNSET"``) is an error,
    never the default."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        check_given(item)
    return value


def BudgetOpt(kinds: str, default: str | None = None):  # noqa: N802 - an option factory
    """The ``--budget KIND:VALUE`` option (:mod:`prunelab.budget`); ``kinds`` lists what
    the command takes, e.g. ``remove-blocks:N | keep-params:F``."""
    return typer.Option(default, "--budget", metavar="KIND:VALUE",
                        help=f"how much to remove: {kinds}", callback=given_budget)


def budget_fields(cls: type, text: str | list | None, label: str) -> dict:
    """The config fields of ``cls`` a ``--budget`` sets (``{}`` when not given; an empty
    one is an error)."""
    if text is None or text == []:
        return {}
    from prunelab.budget import budget_options

    return budget_options(cls, text, label)


def runtime_budgets(items: list[str] | None, command: str,
                    mass: bool = True) -> tuple[float | None, float | None]:
    """``(press ratio, routing mass)`` of the ``--budget`` items of a command that runs a
    model (``eval``, ``generate``): ``remove-cache:F`` (the press; ``keep-cache:F`` the
    other way) and, where ``mass``, ``keep-mass:F`` (a PrunePath checkpoint); each once."""
    from prunelab.budget import parse_budget

    takes = "remove-cache:F (with --press)" + (" and keep-mass:F (PrunePath checkpoints)"
                                               if mass else "")
    got: dict[str, float] = {}
    for item in items or ():
        if ":" not in item:
            raise ConfigError(f"{command} takes --budget {takes}; got {item!r} (say what it "
                              f"counts, e.g. remove-cache:{item.strip()})")
        b = parse_budget(item)
        if b.quantity not in ("cache", "mass") or (b.quantity == "mass" and not mass):
            raise ConfigError(f"{command} takes --budget {takes}; got {b}")
        if b.quantity in got:
            raise ConfigError(f"{command}: --budget given twice for {b.quantity}; give one")
        got[b.quantity] = b.to("remove" if b.quantity == "cache" else "keep").value
    return got.get("cache"), got.get("mass")


@dataclasses.dataclass(frozen=True)
class LoadArgs:
    """How to load ``model`` (the options every model-reading command takes)."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    allow_missing_weights: bool = False
    offload: bool = False
    stream: bool = False
    stack: str | None = None
    calib_dtype: str | None = None

    def load(self):
        from prunelab import api

        return api.load(self.model, dtype=self.dtype, device=self.device,
                        trust_remote_code=self.trust_remote_code, offload=self.offload,
                        allow_pickle=self.allow_pickle,
                        allow_missing_weights=self.allow_missing_weights, stream=self.stream,
                        stack=self.stack, calib_dtype=self.calib_dtype)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@contextlib.contextmanager
def writing(path: Path | None, kind: str | None, overwrite: bool,
            on_interrupt: str | None = None,
            inputs: dict | None = None) -> Iterator[None]:
    """Guard a command that writes ``path``: refuse an unusable or existing path before any
    work (``kind`` "file" / "checkpoint"; ``None`` for a resumable folder), refuse an
    output that is, lies inside or holds one of the command's ``inputs`` (flag -> path or
    spec; with or without ``--overwrite``), hold the one-writer lock for the whole
    command, and say on Ctrl-C what was kept."""
    if path is None:
        state["on_interrupt"] = "nothing was written"
        yield
        return
    from prunelab.io.files import check_output_path
    from prunelab.io.lock import output_lock

    if kind is None:
        check_output_path(path, inputs=inputs)
    else:
        check_output_path(path, kind=kind, overwrite=overwrite, inputs=inputs)
    state["on_interrupt"] = on_interrupt or f"nothing was written ({path} unchanged)"
    with output_lock(path):
        yield


def data_paths(*specs: str | None) -> list[str]:
    """The files and folders data specs read (``text:PATH``, ``jsonl:PATH[:FIELD]``,
    ``KIND@DIR``), for the output guard's ``inputs``; named sets give nothing."""
    found: list[str] = []
    for spec in specs:
        if not isinstance(spec, str):
            continue
        kind, _, rest = spec.strip().partition(":")
        if kind in ("text", "jsonl") and rest:
            found.append(rest)
            if kind == "jsonl" and ":" in rest:
                found.append(rest.rpartition(":")[0])
        elif "@" in spec:
            found.append(spec.partition("@")[2])
    return found


def check_positive(name: str, value: int | None, low: int = 1) -> None:
    from prunelab.registry import check_range

    if value is not None:
        check_range(name, value, low, None, integer=True)


def parse_blocks(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"--blocks takes 0-based indices like 3,5,9, got {text!r}") from exc


def parse_list(text: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


def parse_pairs(text: str | None) -> list[tuple[int, int]]:
    if not text:
        return []
    pairs = []
    for item in text.split(","):
        parts = item.strip().split("-")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"--pairs takes i-j,i-j,... (0-based), got {item.strip()!r}")
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


def parse_settings(items: list[str] | None, cls: type) -> dict:
    """``--set KEY=VALUE`` items as keyword arguments of the config class ``cls``: keys
    must be its fields (else one error naming the valid ones); values are parsed as JSON
    when they parse (numbers, true/false, null, lists), else kept as strings."""
    from prunelab.registry import strict_kwargs

    opts: dict = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    strict_kwargs(cls, opts)
    hints = typing.get_type_hints(cls)
    for key, value in opts.items():
        if isinstance(value, list):
            opts[key] = tuple(value)
        elif isinstance(value, int) and not isinstance(value, bool) and \
                hints.get(key) in (float, float | None):
            opts[key] = float(value)
    return opts


def settings_over(given: dict, items: list[str] | None, cls: type) -> dict:
    """``given`` (the options set by flags and ``--budget``) plus the ``--set KEY=VALUE``
    items (:func:`parse_settings`); a key set both ways is a one-line error naming the
    flag, never silently overridden."""
    settings = parse_settings(items, cls)
    both = [k for k in settings if k in given]
    if both:
        f = next((f for f in dataclasses.fields(cls) if f.name == both[0]), None)
        meta = f.metadata if f is not None else {}
        flag = (f"--budget {meta['budget']}:..." if meta.get("budget") else
                "--" + (meta.get("cli") or meta.get("flag", "").lstrip("-") or both[0])
                .replace("_", "-"))
        raise ConfigError(f"--set {both[0]}=... repeats {flag} (given as well); give it once")
    return {**given, **settings}


def field_help(cls: type) -> str:
    """``name (default)`` of each field of ``cls`` with its help metadata, for --help."""
    parts = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_"):
            continue
        default = f.default if f.default is not dataclasses.MISSING else "..."
        text = f.metadata.get("help", "")
        parts.append(f"{f.name}={default!r}" + (f" ({text})" if text else ""))
    return "; ".join(parts)
