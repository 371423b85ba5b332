"""The stages of a recipe and their typed options.

A recipe stage is a one-key mapping ``{KIND: {options}}``. Every kind's options are a
frozen dataclass validated at construction; the method-bearing kinds reuse the configs of
the Python API unchanged: a ``prune`` stage's method is a :data:`prunelab.pruning.METHODS`
config (``method: wanda`` plus that config's fields), a ``probe`` stage's probes are
:data:`prunelab.probes.PROBES` configs, a ``heal`` stage's fields are those of
:class:`prunelab.heal.HealConfig`, an ``evaluate`` stage's ``press`` is a
:data:`prunelab.inference.PRESSES` config. Keys shared by every stage: ``id`` (a unique
name; default ``KIND-INDEX``, 0-based) and ``from`` (the model it starts from: ``dense``,
or the id of an earlier stage; default the model the previous stage left).

:func:`parse_stage` turns one YAML stage into a :class:`Stage`, raising
:class:`~prunelab.errors.ConfigError` with one line naming the stage and the field.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from prunelab.budget import budget_options
from prunelab.errors import ConfigError
from prunelab.registry import check_range, strict_kwargs, to_dict
from prunelab.workflow.fields import typed

_ID = re.compile(r"^[A-Za-z0-9._+-]{1,60}$")
#: stages whose output is a new model (a checkpoint under ``OUT/points/<id>/model``)
MODEL_STAGES = ("prune", "heal")
#: what a run writes in its folder beside the save stages' checkpoints (a save path may
#: not be one of these, nor lie under ``points``)
RUN_OWN = ("points", "run.json", "leaderboard.md", "leaderboard.csv", "leaderboard.json",
           "report.html", "quality_vs_params.png", "speed_vs_params.png", "budget_curves.png",
           "plots", "probes", "served.md")


def _opt(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class Calib:
    """Calibration windows of a probe / prune stage (``None``: the recipe's top level)."""

    data: str | None = _opt(None, "calibration data spec")
    samples: int | None = _opt(None, "calibration windows")
    seqlen: int | None = _opt(None, "window length in tokens")
    batch_size: int | None = _opt(None, "windows per block call")

    def __post_init__(self) -> None:
        for name, low in (("samples", 1), ("seqlen", 2), ("batch_size", 1)):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), low, None, integer=True)


@dataclass(frozen=True)
class ProbeStage:
    """Run redundancy probes on the current model; results (JSON, CSV, PNG) in the stage
    folder. ``probes``: names or ``{name: NAME, OPTION: VALUE}`` (a PROBES config)."""

    probes: tuple = _opt(("block-influence",), "probe names or {name, options} mappings")
    calib: Calib = _opt(Calib(), "calibration windows (default: the recipe's)")


@dataclass(frozen=True)
class PruneStage:
    """Prune the current model in place with a registered method (``method: NAME`` and
    that method config's fields)."""

    method: Any = _opt(None, "a METHODS config: its name plus its fields")
    calib: Calib = _opt(Calib(), "calibration windows (default: the recipe's)")


@dataclass(frozen=True)
class HealStage:
    """Fine-tune the current model (every :class:`~prunelab.heal.HealConfig` field) on
    ``data`` (default: the recipe's data), early-stopped on ``eval_data`` (default: the
    recipe's test)."""

    config: Any = _opt(None, "the HealConfig fields")
    teacher: str = _opt("dense", "dense (the recipe's model; used by the kd / hidden / mix "
                        "losses) or none")
    train_samples: int | None = _opt(None, "training windows (default: all)")
    eval_samples: int | None = _opt(16, "held-out windows for early stopping")
    data: str | None = _opt(None, "training data spec (default: the recipe's data)")
    eval_data: str | None = _opt(None, "held-out data spec (default: the recipe's test; "
                                 "none: no held-out evaluation)")

    def __post_init__(self) -> None:
        if self.teacher not in ("dense", "none"):
            raise ConfigError(f"teacher must be dense or none, got {self.teacher!r}")
        for name in ("data", "eval_data"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a data spec, got {getattr(self, name)!r}")
        for name in ("train_samples", "eval_samples"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), 1, None, integer=True)


@dataclass(frozen=True)
class EvaluateStage:
    """Perplexity of the current model on held-out windows; KL and top-1 agreement to the
    dense model; speed, downstream tasks and an inference-time press on request."""

    data: str | None = _opt(None, "held-out data spec (default: the recipe's test)")
    samples: int | None = _opt(16, "held-out windows")
    seqlen: int = _opt(256, "window length in tokens")
    batch_size: int = _opt(4, "windows per forward")
    reference: bool = _opt(True, "KL and top-1 agreement to the dense model")
    speed: bool = _opt(False, "prefill / decode tokens per second and peak memory")
    speed_rounds: int = _opt(3, "speed: rounds interleaved with the dense model (ratios to "
                             "it taken within a round; median and range reported)")
    tasks: tuple[str, ...] = _opt((), "downstream tasks (needs api.evaluate(tasks=...))")
    limit: int | None = _opt(None, "items per downstream task")
    press: Any = _opt(None, "a PRESSES config: {name: snapkv, ratio: 0.5, ...}")
    press_context: float = _opt(0.5, "press: share of each window that is the prompt")
    press_continuation: int | None = _opt(None, "press: the last N tokens of each window are "
                                          "the continuation (instead of press_context)")

    def __post_init__(self) -> None:
        if self.samples is not None:
            check_range("samples", self.samples, 1, None, integer=True)
        check_range("seqlen", self.seqlen, 2, None, integer=True)
        check_range("batch_size", self.batch_size, 1, None, integer=True)
        check_range("speed_rounds", self.speed_rounds, 1, 100, integer=True)
        if self.limit is not None:
            check_range("limit", self.limit, 1, None, integer=True)
        check_range("press_context", self.press_context, 0.0, 1.0)
        if self.press_continuation is not None:
            check_range("press_continuation", self.press_continuation, 2, None, integer=True)
        if self.press is not None:
            cont = self.continuation()
            if not 2 <= cont <= self.seqlen - 2:
                what = (f"press_continuation {self.press_continuation}"
                        if self.press_continuation is not None
                        else f"press_context {self.press_context:g}")
                raise ConfigError(f"{what} leaves {self.seqlen - cont} of the {self.seqlen} "
                                  "tokens of a window as the pressed prompt and "
                                  f"{cont} as the continuation: each needs at least 2")

    def continuation(self) -> int:
        """Tokens at the end of each window scored on the press' cache."""
        if self.press_continuation is not None:
            return self.press_continuation
        return self.seqlen - int(self.seqlen * self.press_context)


@dataclass(frozen=True)
class SaveStage:
    """Save the current model as a checkpoint (folder under OUT) with its manifest; the
    manifest keeps the recipe that reproduces it (``prunelab recipe --from``)."""

    path: str = _opt("model", "checkpoint folder, relative to --out")

    def __post_init__(self) -> None:
        if save_path(self.path) is None:
            raise ConfigError(f"path must be a folder inside the run folder (not the run "
                              f"folder itself, nor {', '.join(RUN_OWN[:2])}, ... of its "
                              f"own), got {self.path!r}")


def save_path(path: Any) -> str | None:
    """``path`` normalised (``a/./b/`` -> ``a/b``), or None when it is not a folder
    strictly inside the run folder or is one of the run's own names (:data:`RUN_OWN`)."""
    if not isinstance(path, str) or not path or "\\" in path or path.startswith(("/", "~")) \
            or ".." in path.split("/"):
        return None
    norm = posixpath.normpath(path)
    parts = norm.split("/")
    if norm in (".", "") or ".." in parts or parts[0] in RUN_OWN \
            or any(p.startswith(".") for p in parts):
        return None
    return norm


@dataclass(frozen=True)
class ExportStage:
    """Write the current model as one GGUF file for llama.cpp (``docs/serving.md``) and,
    with ``llamacpp``, score that file inside llama.cpp (``llama-cpp-python``): the
    perplexity of held-out windows (the recipe's test data) from llama.cpp's own logits
    beside prunelab's forward of the same windows, and with ``speed`` prompt (512 tokens)
    and generation (128 tokens) tokens per second. The report stage lists every export."""

    path: str = _opt("model.gguf", "GGUF file to write, relative to --out (ends in .gguf)")
    outtype: str = _opt("f16", "f32 | f16 | bf16 | q8_0 | q6_k | q4_k_m (quantized by "
                        "llama.cpp's own quantizer)")
    llamacpp: bool = _opt(True, "score the file inside llama.cpp (needs llama-cpp-python)")
    samples: int = _opt(4, "held-out windows scored by both")
    seqlen: int = _opt(256, "window length in tokens")
    speed: bool = _opt(True, "llama.cpp prompt / generation tokens per second")
    threads: int | None = _opt(None, "llama.cpp threads (default: every core)")

    def __post_init__(self) -> None:
        from prunelab.checkpoint.gguf_export import OUT_TYPES, QUANT_TYPES

        norm = save_path(self.path)
        if norm is None or not norm.endswith(".gguf") or norm == ".gguf":
            raise ConfigError(f"path must be a .gguf file inside the run folder (not "
                              f"{', '.join(RUN_OWN[:2])}, ... of its own), got {self.path!r}")
        if self.outtype not in OUT_TYPES and self.outtype not in QUANT_TYPES:
            raise ConfigError(f"outtype must be one of "
                              f"{' | '.join([*OUT_TYPES, *QUANT_TYPES])}, got {self.outtype!r}")
        check_range("samples", self.samples, 1, None, integer=True)
        check_range("seqlen", self.seqlen, 2, None, integer=True)
        if self.threads is not None:
            check_range("threads", self.threads, 1, None, integer=True)
        if self.speed and not self.llamacpp:
            raise ConfigError("speed is measured inside llama.cpp: it needs llamacpp: true")


@dataclass(frozen=True)
class ReportStage:
    """Leaderboard of every evaluation (markdown + CSV), plots, and the HTML report."""

    title: str = _opt("prunelab run", "the report's title")


STAGE_KINDS: dict[str, type] = {"probe": ProbeStage, "prune": PruneStage,
                                "heal": HealStage, "evaluate": EvaluateStage,
                                "save": SaveStage, "export": ExportStage,
                                "report": ReportStage}


@dataclass(frozen=True)
class Stage:
    """One parsed stage: its ``kind``, ``id``, input model (``source``) and options."""

    kind: str
    id: str
    source: str | None
    options: Any

    def to_dict(self, with_source: bool = True) -> dict:
        body = stage_options_dict(self)
        head = {"id": self.id}
        if with_source and self.source is not None:
            head["from"] = self.source
        return {self.kind: {**head, **body}}


def stage_options_dict(stage: Stage) -> dict:
    """The YAML options of a stage (the method / heal config flattened in)."""
    o = stage.options
    if stage.kind == "prune":
        d = to_dict(o.method)
        d["method"] = d.pop("name")
        return {"method": d.pop("method"), **d, **_calib_dict(o.calib)}
    if stage.kind == "heal":
        d = to_dict(o.config)
        data = {k: getattr(o, k) for k in ("data", "eval_data") if getattr(o, k) is not None}
        return {**d, "teacher": o.teacher, "train_samples": o.train_samples,
                "eval_samples": o.eval_samples, **data}
    if stage.kind == "probe":
        return {"probes": [to_dict(p) for p in o.probes], **_calib_dict(o.calib)}
    d = to_dict(o)
    if stage.kind == "evaluate":
        if o.press is not None:
            d["press"] = to_dict(o.press)
        # one way of splitting the windows is written, so that the YAML reads back
        d.pop("press_context" if o.press_continuation is not None else "press_continuation",
              None)
    return d


def _calib_dict(c: Calib) -> dict:
    d = {k: v for k, v in to_dict(c).items() if v is not None}
    return {"calib": d} if d else {}


def parse_stage(index: int, raw: Any) -> Stage:
    """A :class:`Stage` from the YAML item ``raw`` (0-based ``index``), or a one-line
    :class:`ConfigError` ``stage INDEX (KIND): ...``."""
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ConfigError(f"stage {index}: a stage is a one-key mapping {{KIND: options}} "
                          f"with KIND one of {', '.join(STAGE_KINDS)}, got {raw!r}")
    kind, opts = next(iter(raw.items()))
    if kind not in STAGE_KINDS:
        raise ConfigError(f"stage {index}: unknown stage kind {kind!r}; valid kinds: "
                          f"{', '.join(STAGE_KINDS)}")
    opts = {} if opts is None else opts
    if not isinstance(opts, dict):
        raise ConfigError(f"stage {index} ({kind}): options must be a mapping, got {opts!r}")
    opts = dict(opts)
    sid = opts.pop("id", f"{kind}-{index}")
    source = opts.pop("from", None)
    label = f"stage {index} ({kind} {sid!r})" if "id" in raw[kind] else \
        f"stage {index} ({kind})"
    try:
        if not isinstance(sid, str) or not _ID.match(sid) or sid == "dense" \
                or sid.startswith("."):
            raise ConfigError(f"id must be 1-60 letters, digits or . _ + - not starting "
                              f"with '.', and not 'dense', got {sid!r}")
        if source is not None and not isinstance(source, str):
            raise ConfigError(f"from must be a stage id or dense, got {source!r}")
        return Stage(kind, sid, source, _BUILDERS[kind](opts))
    except ConfigError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{label}: {str(exc).splitlines()[0]}") from None


def _calib(opts: dict) -> Calib:
    raw = opts.pop("calib", None) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"calib must be a mapping, got {raw!r}")
    strict_kwargs(Calib, raw, "calib")
    try:
        return Calib(**typed(Calib, raw))
    except ConfigError as exc:
        raise ConfigError(f"calib: {exc}") from None


def _build_probe(opts: dict) -> ProbeStage:
    from prunelab.probes import PROBES

    calib = _calib(opts)
    probes = opts.pop("probes", ProbeStage.probes)
    strict_kwargs(ProbeStage, opts, "probe")
    if isinstance(probes, (str, dict)):
        probes = [probes]
    if not isinstance(probes, (list, tuple)) or not probes:
        raise ConfigError(f"probes must name at least one probe, got {probes!r}")
    return ProbeStage(tuple(PROBES.from_dict(_typed_piece(PROBES, p, "probes"))
                            for p in probes), calib)


def _typed_piece(registry, piece: Any, label: str) -> Any:
    """A ``{name: NAME, FIELD: VALUE}`` mapping with its fields typed against the
    registered config NAME (a bare name unchanged)."""
    if not isinstance(piece, dict) or not isinstance(piece.get("name"), str):
        return piece  # the registry's own one-line error
    cls = registry.get(piece["name"])
    try:
        return typed(cls, piece, skip=("name",))
    except ConfigError as exc:
        raise ConfigError(f"{label} {piece['name']!r}: {exc}") from None


def _build_prune(opts: dict) -> PruneStage:
    from prunelab.pruning import METHODS

    calib = _calib(opts)
    name = opts.pop("method", None)
    if not isinstance(name, str):
        raise ConfigError(f"method must name a pruning method ({', '.join(METHODS.names())})"
                          f", got {name!r}")
    cls = METHODS.get(name)
    if "budget" in opts and not _own_budget_field(cls, opts["budget"]):
        opts.update(_budget(cls, opts.pop("budget"), f"method {name}", opts))
    strict_kwargs(cls, opts, f"method {name!r}")
    return PruneStage(METHODS.from_dict({"name": name, **typed(cls, opts)}), calib)


def _own_budget_field(cls: type, value: Any) -> bool:
    """A method whose config has a field named ``budget`` (gates: the compute skipped) takes
    ``budget: 0.2`` as that field; ``budget: KIND:VALUE`` is the vocabulary's."""
    names = {f.name for f in dataclasses.fields(cls)}
    return "budget" in names and not (isinstance(value, str) and ":" in value)


def _budget(cls: type, budget: Any, label: str, opts: dict) -> dict:
    """The fields ``budget: KIND:VALUE`` sets on ``cls`` (as ``--budget`` does); a field
    also given by its own name is an error (one figure, said once)."""
    if not isinstance(budget, str):
        raise ConfigError(f"budget must be a string KIND:VALUE (e.g. remove-blocks:6), "
                          f"got {budget!r}")
    fields = budget_options(cls, budget, label)
    both = sorted(set(fields) & set(opts))
    if both:
        raise ConfigError(f"budget {budget!r} and {both[0]}: give the figure once")
    return fields


def _build_heal(opts: dict) -> HealStage:
    from prunelab.train.config import HealConfig

    own = typed(HealStage, {k: opts.pop(k) for k in ("teacher", "train_samples",
                                                     "eval_samples", "data", "eval_data")
                            if k in opts})
    budget = opts.pop("budget", None)
    if budget is not None:
        opts.update(_budget(HealConfig, budget, "heal", opts))
    strict_kwargs(HealConfig, opts, "heal")
    cfg = HealConfig(**typed(HealConfig, opts))  # YAML writes 1 for 1.0: read as a float
    if own.get("teacher") == "dense" and not cfg.needs_teacher:
        raise ConfigError(f"heal: teacher: dense is used by loss kd, hidden and mix only "
                          f"(this stage's loss is {cfg.loss})")
    return HealStage(cfg, **own)


def _build_evaluate(opts: dict) -> EvaluateStage:
    from prunelab.inference import PRESSES

    strict_kwargs(EvaluateStage, opts, "evaluate")
    if "press_context" in opts and "press_continuation" in opts:
        raise ConfigError("evaluate: give press_context or press_continuation, not both "
                          "(both set where each window is split)")
    if opts.get("press") is not None:
        opts["press"] = PRESSES.from_dict(_typed_piece(PRESSES, opts["press"], "press"))
    if "tasks" in opts:
        tasks = opts["tasks"]
        if isinstance(tasks, str):
            tasks = tasks.split(",")
        if not isinstance(tasks, (list, tuple)) or not all(
                isinstance(t, str) and t.strip() for t in tasks):
            raise ConfigError(f"tasks must be a list of task names, got {opts['tasks']!r}")
        opts["tasks"] = tuple(t.strip() for t in tasks)
    return EvaluateStage(**typed(EvaluateStage, opts, skip=("press", "tasks")))


def _simple(cls: type, kind: str):
    def build(opts: dict):
        strict_kwargs(cls, opts, kind)
        return cls(**typed(cls, opts))
    return build


_BUILDERS = {"probe": _build_probe, "prune": _build_prune, "heal": _build_heal,
             "evaluate": _build_evaluate, "save": _simple(SaveStage, "save"),
             "export": _simple(ExportStage, "export"),
             "report": _simple(ReportStage, "report")}
