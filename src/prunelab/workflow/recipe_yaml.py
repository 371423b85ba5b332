"""Reading a recipe's YAML strictly, and its paths by one rule.

:func:`load_yaml` (PyYAML's safe loader, checked on the composed node graph before any
value is built): a key given twice in one mapping (``budget:`` twice in a stage) is an
error, never last-wins; aliases that would expand to more than :data:`MAX_NODES` values
(an alias bomb, anywhere: ``model:``, ``evaluate: {tasks: ...}``) or refer to
themselves are refused before anything is expanded. Anchors and aliases of ordinary size,
and merge keys (``<<: *base``), stay allowed.

:func:`resolve_paths`: every relative path a recipe reads (the model folder or ``.gguf``
file, ``text:`` / ``jsonl:`` / ``KIND@DIR`` data specs, task files and folders, plugin
files) is read from the recipe file's folder, never from the working folder; what a run
writes (``save`` / ``export`` paths, ``from_probe``) is relative to the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from prunelab.errors import ConfigError
from prunelab.models.embedded import EMBEDDED

#: the most values a recipe's YAML may hold once its aliases are expanded
MAX_NODES = 100_000
_MERGE = "tag:yaml.org,2002:merge"


def load_yaml(text: str, what: str = "recipe") -> Any:
    """The value of YAML ``text`` (see the module docstring for what is refused); errors
    are one-line :class:`ConfigError` naming the line."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(f"{what} is not valid YAML{at}: "
                              f"{getattr(exc, 'problem', None) or type(exc).__name__}") \
                from None
        if node is None:
            return None
        _check_nodes(node, what)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _line(node) -> int:
    return node.start_mark.line + 1


def _check_nodes(root, what: str) -> None:
    """Duplicate keys, self-referring aliases and the expanded size, on the node graph
    (each node visited once: an alias is a shared node, so a bomb costs nothing here)."""
    size: dict[int, int] = {}
    state: dict[int, str] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            total = 1 + sum(size[id(c)] for c in children)
            if total > MAX_NODES:
                raise ConfigError(f"{what}: the value at line {_line(node)} expands to more "
                                  f"than {MAX_NODES:,} values through its aliases (an alias "
                                  "bomb?); write it out or use fewer aliases")
            size[key], state[key] = total, "done"
            continue
        if state.get(key) == "done":
            continue
        if state.get(key) == "open":
            raise ConfigError(f"{what}: the alias at line {_line(node)} refers to a value "
                              "that contains it (a recursive alias)")
        state[key] = "open"
        if isinstance(node, yaml.MappingNode):
            _check_keys(node, what)
        stack.append((node, True))
        for child in children:
            if state.get(id(child)) == "open":
                raise ConfigError(f"{what}: the alias at line {_line(child)} refers to a "
                                  "value that contains it (a recursive alias)")
            if state.get(id(child)) != "done":
                stack.append((child, False))


def _children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_keys(node, what: str) -> None:
    seen: dict[Any, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE:
            continue
        name = (key.tag, key.value)
        if name in seen:
            raise ConfigError(f"{what}: key {key.value!r} at line {_line(key)} repeats the "
                              f"one at line {seen[name]}; give it once")
        seen[name] = _line(key)


# ---------------------------------------------------------------------------- paths

def _local(path: str, base: Path) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def resolve_model(spec: Any, base: Path) -> Any:
    """The model spec read from ``base``: a path (relative, ``./``, ``~``, a ``.gguf``,
    or one that exists from ``base`` or from the working folder) becomes ``base``'s;
    embedded names and hub ids (``owner/name`` that is no path here) are kept."""
    if not isinstance(spec, str) or not spec or spec in EMBEDDED:
        return spec
    path = Path(spec).expanduser()
    looks_local = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") \
        or (base / path).exists() or path.exists()
    return _local(spec, base) if looks_local else spec


def resolve_spec(spec: Any, base: Path) -> Any:
    """A data spec whose file or folder is read from ``base`` (``text:PATH``,
    ``jsonl:PATH[:FIELD]``, ``KIND@DIR``); named data sets are kept."""
    if not isinstance(spec, str):
        return spec
    kind, sep, rest = spec.partition(":")
    if "@" in spec and not (sep and kind in ("text", "jsonl")):
        head, _, folder = spec.partition("@")
        return f"{head}@{_local(folder, base)}" if folder else spec
    if not sep or not rest or kind not in ("text", "jsonl"):
        return spec
    if kind == "jsonl":
        path, colon, field = rest.partition(":")
        if colon and not (base / path).exists() and (base / rest).exists():
            path, colon, field = rest, "", ""
        return f"jsonl:{_local(path, base)}" + (f":{field}" if colon else "")
    return f"text:{_local(rest, base)}"


def _resolve_task(item: Any, base: Path) -> Any:
    if not isinstance(item, str):
        return item
    p = Path(item).expanduser()
    if item.endswith(".jsonl") or "/" in item or (base / p).exists():
        return _local(item, base)
    return item


def resolve_paths(raw: Any, base: Path | None) -> Any:
    """``raw`` (a recipe mapping as read) with every path it reads resolved against
    ``base`` (the recipe file's folder; ``None``: a recipe given as text or a dict,
    whose paths stay relative to the working folder)."""
    if base is None or not isinstance(raw, dict):
        return raw
    out = dict(raw)
    if "model" in out:
        out["model"] = resolve_model(out["model"], base)
    for name in ("data", "test"):
        if name in out:
            out[name] = resolve_spec(out[name], base)
    if isinstance(out.get("stages"), list):
        out["stages"] = [_resolve_stage(s, base) for s in out["stages"]]
    return out


def _resolve_stage(stage: Any, base: Path) -> Any:
    if not isinstance(stage, dict):
        return stage
    out = dict(stage)
    for kind, opts in stage.items():
        if not isinstance(opts, dict):
            continue
        opts = dict(opts)
        for name in ("data", "eval_data"):
            if name in opts:
                opts[name] = resolve_spec(opts[name], base)
        if isinstance(opts.get("calib"), dict) and "data" in opts["calib"]:
            opts["calib"] = {**opts["calib"], "data": resolve_spec(opts["calib"]["data"], base)}
        if kind == "evaluate" and isinstance(opts.get("tasks"), list):
            opts["tasks"] = [_resolve_task(t, base) for t in opts["tasks"]]
        elif kind == "evaluate" and isinstance(opts.get("tasks"), str):
            opts["tasks"] = ",".join(_resolve_task(t.strip(), base)
                                     for t in opts["tasks"].split(","))
        out[kind] = opts
    return out
