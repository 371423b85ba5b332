"""Everything a recipe can be checked for without the model's weights (``prunelab run
--check``, and ``prunelab run`` before its first stage).

The model spec (an embedded name, a checkpoint folder with ``config.json``, a ``.gguf``
file or a hub id ``owner/name``); ``dtype`` and ``device``; every data spec the stages
read (its form, its file, and -- for a local checkpoint whose tokenizer loads -- that it
holds the windows asked for); every window length against the model's positions
(``config.json``); downstream task names; ``from_probe`` files (an earlier probe stage's
``points/ID/probes/NAME.json``, or an existing file). Stage references, ids and output
collisions are checked when the recipe is parsed (:mod:`prunelab.workflow.recipe`).

Every error is one line naming the recipe field, prefixed by the stage when a stage
reads it: ``stage 2 (prune 'depth6'): seqlen 4096 is beyond the model's 2048 positions``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError, DataError, PrunelabError
from prunelab.models.embedded import EMBEDDED
from prunelab.workflow.stages import MODEL_STAGES

_TEXT_KINDS = ("text", "jsonl", "wiki-vital", "wikitext2", "c4")
_OTHER_KINDS = ("images", "lfw", "speech")  # vision and speech models' own specs
_SPLITS = {"wiki-vital": ("calib", "test"), "wikitext2": ("test", "calib", "validation"),
           "c4": ("test", "calib")}
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx",
                  "max_sequence_length")
#: command-line flags -> the recipe fields that say the same (messages of the layers below
#: speak the command line's language)
_FLAGS = {"--seqlen": "seqlen", "--samples": "samples", "--seed": "seed",
          "--batch-size": "batch_size", "--data": "data", "--calib": "data", "--test": "test",
          "--dtype": "dtype", "--device": "device", "--tasks": "tasks",
          "--limit": "limit", "--from-probe": "from_probe"}


def unflag(message: str) -> str:
    """``message`` with the command-line flags it names spelled as recipe fields."""
    return re.sub(r"--[a-z][a-z-]*", lambda m: _FLAGS.get(m.group(0), m.group(0)), message)


def stage_label(index: int, st) -> str:
    """``stage 2 (prune 'depth6')``; ``stage 2 (prune)`` when the id is the default."""
    if st.id == f"{st.kind}-{index}":
        return f"stage {index} ({st.kind})"
    return f"stage {index} ({st.kind} {st.id!r})"


def check_recipe(recipe, out: Path | None = None) -> None:
    """Raise a one-line :class:`ConfigError` for the first problem of ``recipe`` that
    shows without its weights (module docstring); ``out``: the run folder, where a
    relative ``from_probe`` may already lie."""
    config = _model_config(recipe.model)
    _check_dtype_device(recipe.dtype, recipe.device)
    positions = _positions(config)
    counter = _WindowCounter(recipe, config)
    for name in ("data", "test"):
        _check_spec(getattr(recipe, name), name)
    _check_blocks(recipe, _blocks(config))
    for i, st in enumerate(recipe.stages):
        label = stage_label(i, st)
        try:
            _check_stage(recipe, st, i, positions, counter, out)
        except PrunelabError as exc:
            raise ConfigError(f"{label}: {unflag(str(exc))}") from None


def _reads(recipe, st) -> list[tuple[str, str, int, int | None, int | None]]:
    """``(field, data spec, seqlen, samples, seed)`` of every window set the stage reads."""
    o = st.options
    r = recipe
    if st.kind in ("probe", "prune"):
        c = o.calib
        return [("calib", c.data or r.data, c.seqlen or r.seqlen, c.samples or r.samples,
                 r.seed)]
    if st.kind == "heal":
        out = [("data", o.data or r.data, o.config.seqlen, o.train_samples, o.config.seed)]
        ev = o.eval_data if o.eval_data is not None else r.test
        if ev.lower() != "none":
            out.append(("eval_data", ev, o.config.seqlen, o.eval_samples, o.config.seed))
        return out
    if st.kind == "evaluate":
        return [("data", o.data or r.test, o.seqlen, o.samples, r.seed)]
    return []


def _check_stage(recipe, st, index: int, positions: int | None, counter, out) -> None:
    for field, spec, seqlen, samples, seed in _reads(recipe, st):
        where = field if field != "calib" or st.options.calib.data else "data (the recipe's)"
        _check_spec(spec, where)
        own = _own_seqlen(recipe, st, field)
        if positions is not None and seqlen > positions:
            raise ConfigError(f"{own} {seqlen} is beyond the model's {positions} positions")
        counter.check(spec, seqlen, samples, seed, f"{field} windows",
                      {"data": "train_samples", "eval_data": "eval_samples"}.get(field)
                      if st.kind == "heal" else None)
    if st.kind == "evaluate":
        if st.options.tasks:
            from prunelab.eval.tasks import resolve_tasks

            try:
                resolve_tasks(list(st.options.tasks))
            except PrunelabError as exc:
                raise ConfigError(f"tasks: {unflag(str(exc))}") from None
    if st.kind == "prune":
        _check_from_probe(recipe, st, index, out)
    if st.kind == "export":
        _check_export(recipe, st)


def _check_export(recipe, st) -> None:
    """llama-cpp-python where the stage needs it (quantized types, scoring inside
    llama.cpp), and a model family GGUF export writes."""
    from prunelab.checkpoint.gguf_export import ARCHES, QUANT_TYPES
    from prunelab.models.gguf_llama import require_llama_cpp

    o = st.options
    if o.llamacpp or o.outtype in QUANT_TYPES:
        require_llama_cpp()
    config = _model_config(recipe.model) or {}
    kind = config.get("model_type")
    if isinstance(kind, str) and kind not in ARCHES:
        raise ConfigError(f"GGUF export writes {', '.join(ARCHES)} models; the recipe's "
                          f"model is {kind}")


def _own_seqlen(recipe, st, field: str) -> str:
    if st.kind == "heal":
        return "seqlen"
    if st.kind == "evaluate":
        return "seqlen"
    return "calib seqlen" if st.options.calib.seqlen else "seqlen (the recipe's)"


def _check_from_probe(recipe, st, index: int, out: Path | None) -> None:
    path = getattr(st.options.method, "from_probe", None)
    if not path:
        return
    p = Path(path).expanduser()
    if p.is_absolute():
        if not p.is_file():
            raise ConfigError(f"from_probe {path} does not exist")
        return
    if out is not None and (out / p).is_file():
        return
    parts = p.parts
    if len(parts) == 4 and parts[0] == "points" and parts[2] == "probes" \
            and p.suffix == ".json":
        from prunelab.probes import PROBES

        for earlier in recipe.stages[:index]:
            if earlier.kind == "probe" and earlier.id == parts[1] and p.stem in [
                    PROBES.name_of(x) for x in earlier.options.probes]:
                return
    raise ConfigError(f"from_probe {path} is not written by an earlier probe stage "
                      "(points/ID/probes/NAME.json) and is no file")


# ---------------------------------------------------------------- model, dtype, device

def _model_config(spec: str) -> dict | None:
    """The model's ``config.json`` (a local folder), None when not at hand; refuses a
    spec that is no model."""
    if spec in EMBEDDED:
        return None
    path = Path(spec).expanduser()
    looks_local = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or path.exists()
    if looks_local:
        if not path.exists():
            raise ConfigError(f"model: {spec!r} does not exist")
        if path.is_file():
            if path.suffix != ".gguf":
                raise ConfigError(f"model: {spec!r} is a file but not a .gguf model")
            return None
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ConfigError(f"model: {spec!r} has no config.json (not a checkpoint folder)")
        try:
            data = json.loads(cfg.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"model: {cfg} is not valid JSON ({type(exc).__name__})") \
                from None
        if not isinstance(data, dict):
            raise ConfigError(f"model: {cfg} is not a JSON object")
        return data
    parts = spec.split("/")
    if len(parts) == 2 and all(re.fullmatch(r"[A-Za-z0-9][\w.-]*", x) for x in parts):
        return None  # a hub id: checked when it is fetched
    raise ConfigError(f"model: {spec!r} is neither an embedded model "
                      f"({', '.join(EMBEDDED)}), a checkpoint folder, a .gguf file nor a "
                      "hub id (owner/name)")


def _check_dtype_device(dtype: str, device: str) -> None:
    from prunelab.models.loading import DTYPES

    if dtype not in (*DTYPES, "auto"):
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
    name = device.lower()
    if name in ("cpu", "auto"):
        return
    if not re.fullmatch(r"cuda(:\d+)?", name):
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"device {device}: CUDA is not available on this machine")
    if ":" in name and int(name.split(":")[1]) >= torch.cuda.device_count():
        raise ConfigError(f"device {device}: this machine has {torch.cuda.device_count()} "
                          "CUDA devices")


def _positions(config: dict | None) -> int | None:
    if not config:
        return None
    for cfg in (config, config.get("text_config") or {}):
        if not isinstance(cfg, dict):
            continue
        for key in _POSITION_KEYS:
            v = cfg.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _blocks(config: dict | None) -> int | None:
    """The model's block count from its ``config.json`` (``None`` when not at hand)."""
    for cfg in (config or {}, (config or {}).get("text_config") or {}):
        if not isinstance(cfg, dict):
            continue
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            v = cfg.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _removes(st) -> tuple[int | None, list[int]]:
    """``(blocks a stage removes, the 0-based blocks it names)``; ``(None, [])`` when it
    cannot be told before it runs (a parameter target, a method that may drop blocks)."""
    if st.kind == "heal":
        cfg = st.options.config
        if getattr(cfg, "prune", None) == "cascadeflow":
            return (getattr(cfg, "remove", None) or 1), []
        return 0, []
    m = st.options.method
    name = getattr(m, "registry_name", None)
    if name == "depth":
        named = [*m.blocks, *(b for b, _ in m.sublayers)]
        if m.remove is not None:
            return m.remove, named
        return (len(set(m.blocks)) if m.blocks else None), named
    return (None if name == "gates" else 0), []  # gates delete blocks left without branches


def _check_blocks(recipe, blocks: int | None) -> None:
    """No stage removes every block of the model it starts from, nor names a block that
    model lacks (counted from ``config.json`` down the stages' chain)."""
    if blocks is None:
        return
    left: dict[str, int | None] = {"dense": blocks}
    inputs = recipe.inputs()
    for i, st in enumerate(recipe.stages):
        have = left.get(inputs[st.id])
        if st.kind not in MODEL_STAGES:
            continue
        removed, named = _removes(st)
        if have is not None:
            label = stage_label(i, st)
            bad = [b for b in named if not 0 <= b < have]
            if bad:
                raise ConfigError(f"{label}: block {bad[0]} does not exist (the model it "
                                  f"starts from has {have} blocks, 0..{have - 1})")
            if removed is not None and removed >= have:
                raise ConfigError(f"{label}: removing {removed} blocks would leave none of "
                                  f"the {have} the model it starts from has")
        left[st.id] = None if have is None or removed is None else have - removed


# ---------------------------------------------------------------- data

def _check_spec(spec: str, field: str) -> None:
    """The form of a data spec, and the file of ``text:`` / ``jsonl:`` (hub data is
    checked when it is fetched)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{field}: empty data spec")
    kind, _, rest = spec.strip().partition(":")
    head = spec.partition("@")[0]
    if kind in ("text", "jsonl"):
        path = Path(rest.split(":")[0] if kind == "jsonl" else rest).expanduser()
        if not rest or not path.exists():
            raise ConfigError(f"{field}: data spec {spec!r}: {path} does not exist")
        if not (path.is_file() or path.is_dir()):
            raise ConfigError(f"{field}: data spec {spec!r}: {path} is not a file or folder")
        return
    if kind in _SPLITS:
        split = head.partition(":")[2]
        if split and split not in _SPLITS[kind]:
            raise ConfigError(f"{field}: data spec {spec!r}: {kind} has the splits "
                              f"{', '.join(_SPLITS[kind])}")
        if kind == "wiki-vital" and "@" in spec:
            raise ConfigError(f"{field}: data spec {spec!r}: wiki-vital takes no @DIR")
        return
    if kind in _OTHER_KINDS or Path(spec).expanduser().exists():
        return
    from prunelab.data.sources import _FORMS_SHORT

    raise ConfigError(f"{field}: unknown data spec {spec!r}; use one of: {_FORMS_SHORT}")


class _WindowCounter:
    """Counts the windows of a text spec with the model's tokenizer (a local checkpoint
    of a text model only: nothing is downloaded or converted for a check)."""

    def __init__(self, recipe, config: dict | None):
        self.tokenizer: Any = None
        if config is None or "text_config" in config:
            return
        try:
            import transformers

            self.tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(Path(recipe.model).expanduser()), trust_remote_code=False)
        except Exception:  # noqa: BLE001 -- no tokenizer at hand: counted when it runs
            self.tokenizer = None

    def check(self, spec: str, seqlen: int, samples: int | None, seed: int,
              field: str, samples_field: str | None = None) -> None:
        kind = spec.partition(":")[0]
        if self.tokenizer is None or kind not in ("text", "jsonl", "wiki-vital"):
            return
        from prunelab.data import make_batches
        try:
            make_batches(self.tokenizer, spec, seqlen=seqlen, samples=samples, seed=seed)
        except (DataError, ConfigError) as exc:
            msg = unflag(str(exc))
            if samples_field:  # the stage's own name for the window count
                msg = re.sub(r"\bsamples\b", samples_field, msg)
            raise ConfigError(f"{field}: {msg}") from None
