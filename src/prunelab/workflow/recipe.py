"""Recipes: a study written as YAML -- the model, the data and the seed at the top, then a
list of stages (:mod:`prunelab.workflow.stages`) -- parsed and checked before anything runs.

::

    model: smollm2-135m
    data: wiki-vital:calib          # calibration data
    test: wiki-vital:test           # held-out data of the evaluate stages
    seed: 0
    stages:
      - probe: {probes: [block-influence]}
      - prune: {method: depth, remove: 6, recovery: foldable}
      - prune: {method: wanda, sparsity: 0.5}
      - heal: {loss: kd, steps: 20}
      - evaluate: {speed: true}
      - save: {path: model}

:func:`load_recipe` reads a file, a YAML string or a dict; an error is one line naming the
stage and the field (:class:`~prunelab.errors.ConfigError`).
:func:`~prunelab.workflow.from_checkpoint.recipe_from_checkpoint`
turns a saved checkpoint's manifest back into the recipe that produced it. Running is in
:mod:`prunelab.workflow.run`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from prunelab.errors import ConfigError
from prunelab.plugins import import_plugin, is_file_spec, source_digest
from prunelab.registry import check_range, to_dict
from prunelab.workflow.fields import typed
from prunelab.workflow.recipe_yaml import load_yaml, resolve_paths
from prunelab.workflow.stages import MODEL_STAGES, parse_stage, save_path

FORMAT = "prunelab-recipe/1"


def _opt(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class Recipe:
    """The top of a recipe plus its parsed stages (``stages`` in order)."""

    model: str = _opt(None, "model spec (required): smollm2-135m | DIR | FILE.gguf | hub id")
    data: str = _opt("wiki-vital:calib", "calibration data spec")
    test: str = _opt("wiki-vital:test", "held-out data spec (evaluate stages)")
    seed: int = _opt(0, "window sampling and method seed")
    samples: int = _opt(32, "calibration windows (a stage's calib may override)")
    seqlen: int = _opt(256, "calibration window length in tokens")
    batch_size: int = _opt(8, "windows per block call")
    dtype: str = _opt("float32", "float32 | bfloat16 | float16 | auto")
    device: str = _opt("cpu", "cpu | cuda[:N] | auto")
    trust_remote_code: bool = _opt(False, "allow model code from the checkpoint")
    plugins: tuple = _opt((), "Python files (relative to the recipe's folder) or module names "
                          "imported before the stages are read: they register your own "
                          "methods, probes, recoveries, scores")
    stages: tuple = _opt((), "the stages, in order")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model: a recipe needs a model spec (model: smollm2-135m)")
        for name in ("data", "test", "dtype", "device"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        check_range("seed", self.seed, 0, 2**31 - 1, integer=True)
        check_range("samples", self.samples, 1, None, integer=True)
        check_range("seqlen", self.seqlen, 2, None, integer=True)
        check_range("batch_size", self.batch_size, 1, None, integer=True)

    # ------------------------------------------------------------------ views
    def top(self) -> dict:
        """The top-level fields (everything but the stages; ``plugins`` only when given, so
        that a recipe without plugins hashes as it always did)."""
        return {k: v for k, v in to_dict(self).items()
                if k != "stages" and not (k == "plugins" and not v)}

    def to_dict(self) -> dict:
        return {**self.top(), "stages": [s.to_dict() for s in self.stages]}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None,
                              width=100)

    def inputs(self) -> dict[str, str]:
        """Stage id -> the model it starts from (``dense`` or a stage id)."""
        return resolve_sources(self.stages)


_TOP = {f for f in Recipe.__dataclass_fields__}


def _plugins(raw: Any, base: Path | None) -> tuple[str, ...]:
    """The recipe's ``plugins`` (files resolved against ``base``, the recipe's folder, else
    the working folder), each imported so that what it registers can be parsed below."""
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(p, str) and p for p in items):
        raise ConfigError(f"plugins: a list of Python files or module names, got {raw!r}")
    out = []
    for item in items:
        spec = item
        if is_file_spec(item):
            path = Path(item).expanduser()
            spec = str((path if path.is_absolute() else (base or Path.cwd()) / path).resolve())
        import_plugin(spec)
        out.append(spec)
    return tuple(dict.fromkeys(out))


def parse_recipe(raw: Any, base: Path | None = None) -> Recipe:
    """A checked :class:`Recipe` from a parsed YAML mapping (``base``: the folder every
    relative path it reads is read from, :func:`resolve_paths`; ``None``: the working
    folder)."""
    if not isinstance(raw, dict):
        raise ConfigError("a recipe is a YAML mapping with model, data, seed and stages")
    raw = resolve_paths(raw, base)
    unknown = [k for k in raw if k not in _TOP]
    if unknown:
        raise ConfigError(f"recipe has no top-level key {unknown[0]!r}; valid keys: "
                          f"{', '.join(sorted(_TOP))}")
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise ConfigError("stages: a recipe needs a non-empty list of stages")
    plugins = _plugins(raw.get("plugins"), base)
    stages = tuple(parse_stage(i, s) for i, s in enumerate(stages_raw))
    top = typed(Recipe, {k: v for k, v in raw.items() if k not in ("stages", "plugins")})
    try:
        recipe = Recipe(**top, plugins=plugins, stages=stages)
    except TypeError as exc:
        raise ConfigError(f"recipe: {str(exc).splitlines()[0]}") from None
    resolve_sources(stages)
    check_save_paths(stages)
    return recipe


def check_save_paths(stages) -> None:
    """Two save stages may not write one folder, nor one inside the other's; an export
    stage's file may not be another's, nor lie inside a save stage's folder."""
    seen: dict[str, tuple[int, Any]] = {}
    for i, st in enumerate(stages):
        if st.kind not in ("save", "export"):
            continue
        path = save_path(st.options.path)
        for other, (j, ost) in seen.items():
            if path == other or path.startswith(other + "/") or other.startswith(path + "/"):
                both = "save" if st.kind == ost.kind == "save" else "path"
                how = (f"the same {'folder' if both == 'save' else 'path'}" if path == other
                       else f"nested {'folders' if both == 'save' else 'paths'}")
                raise ConfigError(f"stage {i} ({st.kind} {st.id!r}): path {st.options.path!r}"
                                  f" and stage {j} ({ost.kind} {ost.id!r}) path "
                                  f"{ost.options.path!r} are {how}; give each its own")
        seen[path] = (i, st)


def load_recipe(source: str | Path | dict) -> Recipe:
    """A checked recipe from a YAML file path, a YAML string or a dict (read strictly:
    :func:`~prunelab.workflow.recipe_yaml.load_yaml`; a file's relative paths are read
    from its folder: :func:`~prunelab.workflow.recipe_yaml.resolve_paths`)."""
    if isinstance(source, dict):
        return parse_recipe(source)
    text = str(source)
    path, base = Path(text), None
    if "\n" not in text and (path.suffix in (".yaml", ".yml") or path.exists()):
        if not path.is_file():
            raise ConfigError(f"recipe {text} does not exist")
        try:
            text, base = path.read_bytes().decode("utf-8"), path.resolve().parent
        except UnicodeDecodeError as exc:
            raise ConfigError(f"recipe {text} is not UTF-8 text (byte {exc.start})") from None
        except OSError as exc:
            raise ConfigError(f"recipe {text} cannot be read: {exc.strerror}") from None
    return parse_recipe(load_yaml(text), base)


def resolve_sources(stages) -> dict[str, str]:
    """Each stage's input model: its ``from`` (``dense`` or an EARLIER stage id), else the
    model the previous stage left; duplicate ids and forward references are errors."""
    seen: dict[str, str] = {}  # stage id -> model id it leaves
    current = "dense"
    out: dict[str, str] = {}
    for i, st in enumerate(stages):
        if st.id in seen:
            raise ConfigError(f"stage {i} ({st.kind}): id {st.id!r} is used twice")
        src = current
        if st.source is not None:
            if st.source != "dense" and st.source not in seen:
                raise ConfigError(f"stage {i} ({st.kind}): from {st.source!r} is neither "
                                  "dense nor the id of an earlier stage")
            src = "dense" if st.source == "dense" else seen[st.source]
        out[st.id] = src
        current = st.id if st.kind in MODEL_STAGES else src
        seen[st.id] = current
    return out


def digest(obj: Any) -> str:
    """sha256 of the canonical JSON of ``obj`` (16 hex digits)."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


#: local input files up to this total size are hashed (sha256) for the stage hashes;
#: beyond, their names, sizes and modification times stand in, and a reuse says so
HASH_LIMIT = 4 << 30


def _files(path: Path) -> list[tuple[str, Path]]:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return [(str(f.relative_to(path)) if path.is_dir() else f.name, f)
            for f in files if f.is_file()]


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def _file_parts(path: Path) -> list:
    """``[name, size, sha256]`` of each file under ``path`` (``[name, size, mtime_ns]``
    past :data:`HASH_LIMIT` in all)."""
    files = _files(path)
    hashed = sum(f.stat().st_size for _, f in files) <= HASH_LIMIT
    return [[name, f.stat().st_size, _sha256(f) if hashed else f.stat().st_mtime_ns]
            for name, f in files]


def model_digest(recipe: Recipe) -> str:
    """What the dense model depends on: spec, dtype, and for a local folder or file its
    files' names, sizes and contents (sha256; past :data:`HASH_LIMIT`, modification
    times: :func:`unhashed_inputs`), so weights changed in place are seen."""
    parts: dict[str, Any] = {"model": recipe.model, "dtype": recipe.dtype}
    path = Path(recipe.model)
    if path.exists():
        parts["files"] = _file_parts(path)
    return digest(parts)


def _data_files(recipe: Recipe) -> list[Path]:
    """The local files of the ``text:`` / ``jsonl:`` data specs anywhere in ``recipe``."""
    found: list[Path] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, str) and value.startswith(("text:", "jsonl:")):
            rest = value.partition(":")[2]
            for cand in (rest, rest.rpartition(":")[0]):
                if cand and Path(cand).is_file():
                    found.append(Path(cand))
                    break
    walk(recipe.to_dict())
    return sorted(set(found))


def unhashed_inputs(recipe: Recipe) -> str | None:
    """What the stage hashes compare by size and time only (inputs past
    :data:`HASH_LIMIT`), in words; ``None`` when every local input is hashed."""
    path = Path(recipe.model)
    if path.exists() and sum(f.stat().st_size for _, f in _files(path)) > HASH_LIMIT:
        return (f"the model's files ({recipe.model}) were compared by name, size and time, "
                f"not by content (over {HASH_LIMIT >> 30} GiB)")
    return None


def stage_hashes(recipe: Recipe) -> dict[str, str]:
    """Content hash of each stage: its options, the top-level fields it reads and the
    hash of the model it starts from (so a change upstream reruns everything below).
    A report stage also depends on every earlier stage."""
    top = recipe.top()
    if recipe.plugins:  # a plugin's code is part of what its stages compute
        top["plugins"] = [[p, source_digest(p)] for p in recipe.plugins]
    data = _data_files(recipe)
    if data:  # the contents of local data files, not only their names
        top["data_files"] = [[str(f), *_file_parts(f)[0][1:]] for f in data]
    models = {"dense": model_digest(recipe)}
    out: dict[str, str] = {}
    inputs = recipe.inputs()
    for st in recipe.stages:
        body = {"kind": st.kind, "options": st.to_dict(with_source=False), "top": top,
                "input": models[inputs[st.id]]}
        if st.kind == "report" or (st.kind == "prune" and getattr(
                st.options.method, "from_probe", None)):  # reads earlier stages' files
            body["earlier"] = dict(out)
        out[st.id] = digest(body)
        if st.kind in MODEL_STAGES:
            models[st.id] = out[st.id]
    return out


# ---------------------------------------------------------------- from a checkpoint

def chain_recipe(recipe: Recipe, stage_id: str, save_path: str = "model",
                 overrides: dict | None = None) -> dict:
    """The recipe reproducing the model ``stage_id`` (or ``dense``) leaves: its
    model-producing ancestors in order (``overrides``: id -> the stage as it ran), then
    a save stage."""
    by_id = {s.id: s for s in recipe.stages}
    by_id.update(overrides or {})
    inputs = recipe.inputs()
    chain = []
    node = stage_id
    while node != "dense":
        st = by_id[node]
        if st.kind in MODEL_STAGES:
            chain.append(st)
            node = inputs[st.id]
        else:
            node = inputs[st.id]
    stages = [s.to_dict(with_source=False) for s in reversed(chain)]
    return {**recipe.top(), "stages": [*stages, {"save": {"path": save_path}}]}
