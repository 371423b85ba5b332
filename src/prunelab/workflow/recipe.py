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
stage and the field (:class:`~prunelab.errors.ConfigError`). :func:`recipe_from_checkpoint`
turns a saved checkpoint's manifest back into the recipe that produced it. Running is in
:mod:`prunelab.workflow.run`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError
from prunelab.plugins import import_plugin, is_file_spec, source_digest
from prunelab.registry import check_range, to_dict
from prunelab.workflow.fields import typed
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
        import yaml

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
    """A checked :class:`Recipe` from a parsed YAML mapping (``base``: the folder relative
    plugin paths are read from)."""
    if not isinstance(raw, dict):
        raise ConfigError("a recipe is a YAML mapping with model, data, seed and stages")
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
    """A checked recipe from a YAML file path, a YAML string or a dict."""
    import yaml

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
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"recipe is not valid YAML{at}: "
                          f"{getattr(exc, 'problem', None) or type(exc).__name__}") from None
    return parse_recipe(raw, base)


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


def model_digest(recipe: Recipe) -> str:
    """What the dense model depends on: spec, dtype, and for a local folder its files'
    names, sizes and modification times."""
    parts: dict[str, Any] = {"model": recipe.model, "dtype": recipe.dtype}
    path = Path(recipe.model)
    if path.exists():
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        parts["files"] = [(str(f.relative_to(path)) if path.is_dir() else f.name,
                           f.stat().st_size, int(f.stat().st_mtime))
                          for f in files if f.is_file()]
    return digest(parts)


def stage_hashes(recipe: Recipe) -> dict[str, str]:
    """Content hash of each stage: its options, the top-level fields it reads and the
    hash of the model it starts from (so a change upstream reruns everything below).
    A report stage also depends on every earlier stage."""
    top = recipe.top()
    if recipe.plugins:  # a plugin's code is part of what its stages compute
        top["plugins"] = [[p, source_digest(p)] for p in recipe.plugins]
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


def recipe_from_checkpoint(folder: str | Path) -> Recipe:
    """The recipe that produced the checkpoint ``folder`` (from its ``manifest.json``).

    A checkpoint written by a recipe keeps that recipe (``manifest["recipe"]``); one
    written by ``prunelab prune ...`` / ``prunelab heal`` / the API is rebuilt from the
    manifest's operations (:mod:`prunelab.workflow.from_checkpoint`: registered prune
    configs, heal configs with their data, chains through source checkpoints)."""
    from prunelab.workflow.from_checkpoint import read_manifest, rebuild

    man = read_manifest(folder)
    if isinstance(man.get("recipe"), dict):
        return parse_recipe(man["recipe"])
    return parse_recipe(rebuild(man, folder))
