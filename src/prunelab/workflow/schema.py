"""The recipe schema as markdown, generated from the config dataclasses themselves (the
recipe's top level, each stage kind, every registered pruning method, probe, press and
nested piece), so the documentation cannot drift from the code.

``python -m prunelab.workflow.schema docs/workflow.md`` rewrites the part of the page
between ``<!-- schema:begin -->`` and ``<!-- schema:end -->``; a test checks that the
page holds exactly :func:`render_schema`'s text.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from prunelab.registry import field_metadata, to_dict
from prunelab.workflow.recipe import Recipe
from prunelab.workflow.stages import STAGE_KINDS, Calib, HealStage

BEGIN, END = "<!-- schema:begin -->", "<!-- schema:end -->"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = to_dict(value)
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value!r}`".replace("|", "\\|")


def _type(f: dataclasses.Field) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return f"`{t}`".replace("|", "\\|")


def fields_table(cls: type, skip: tuple = ()) -> str:
    """A markdown table of ``cls``'s user-facing fields: name, type, default, help."""
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if not f.init or f.name.startswith("_") or f.name in skip:
            continue
        meta = field_metadata(cls, f)
        text = " ".join(str(meta.get("help", "")).split()).replace("|", "\\|")
        if meta.get("budget"):
            text += f" (set by `budget: {meta['budget']}:VALUE`)"
        rows.append(f"| `{f.name}` | {_type(f)} | {_default(f)} | {text} |")
    return "\n".join(rows) + "\n"


def _first_line(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    return " ".join(doc.split("\n\n")[0].split())


def _registry_section(title: str, registry, level: str = "####") -> list[str]:
    """One entry per built-in registration (classes defined inside prunelab; methods a user
    or a test registers from outside are left out, so the page does not depend on what else
    the process imported)."""
    out = [f"### {title}\n"]
    for name in registry.names():
        cls = registry.get(name)
        if not getattr(cls, "__module__", "").startswith("prunelab."):
            continue
        out.append(f"{level} `{name}`\n\n{_first_line(cls)}\n\n" + fields_table(cls))
    return out


def render_schema() -> str:
    """The generated schema (markdown)."""
    from prunelab.inference import PRESSES
    from prunelab.probes import PROBES
    from prunelab.pruning import (
        ALLOCATIONS,
        METHODS,
        RECOVERIES,
        STRATEGIES,
        WIDTH_ALLOCATIONS,
        WIDTH_SCORES,
    )
    from prunelab.train.config import HealConfig
    parts = ["## Recipe schema (generated)\n",
             "Top level of a recipe (`stages` is the list below):\n", fields_table(Recipe),
             "Every stage is a one-key mapping `{KIND: options}`; besides its options it "
             "takes `id` (unique name; default `KIND-INDEX`, 0-based) and `from` (`dense` "
             "or an earlier stage's id; default: the model the previous stage left).\n"]
    for kind, cls in STAGE_KINDS.items():
        parts.append(f"### `{kind}`\n\n{_first_line(cls)}\n")
        if kind == "prune":
            parts.append("Options: `method` (a name below) plus that method's fields, and "
                         "`calib`. `budget: KIND:VALUE` (the `--budget` of the command line, "
                         "e.g. `remove-blocks:6`) sets the field the tables below mark with "
                         "its kind; giving that field too is an error.\n")
        elif kind == "heal":
            parts.append(fields_table(HealStage, skip=("config",)))
            parts.append("plus every field of `HealConfig` (and `budget: KIND:VALUE` for the "
                         "fields marked with a kind):\n\n" + fields_table(HealConfig))
            continue
        parts.append(fields_table(cls, skip=("method",)))
    parts.append("### `calib` (probe and prune stages)\n\n" + fields_table(Calib))
    parts += _registry_section("Pruning methods (`prune: {method: NAME, ...}`)", METHODS)
    parts += _registry_section("Depth strategies (`select: {name: NAME, ...}`)", STRATEGIES)
    parts += _registry_section("Depth recoveries (`recovery: NAME` or `{name: NAME, ...}`)",
                               RECOVERIES)
    parts += _registry_section("Sparsity allocations (`allocation: {name: NAME, ...}`)",
                               ALLOCATIONS)
    parts += _registry_section("Width scores (`score: {name: NAME, ...}`)", WIDTH_SCORES)
    parts += _registry_section("Width allocations (`allocation: {name: NAME, ...}`)",
                               WIDTH_ALLOCATIONS)
    parts += _registry_section("Probes (`probes: [NAME, {name: NAME, ...}]`)", PROBES)
    parts += _registry_section("Presses (`evaluate: {press: {name: NAME, ...}}`)", PRESSES)
    return "\n".join(parts)


def doc_section(text: str) -> str | None:
    """The generated part of a page (between the markers), or None."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def update_doc(path: str | Path) -> None:
    """Rewrite the generated part of ``path`` (the markers are added at the end when
    missing)."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{render_schema().strip(chr(10))}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    update_doc(sys.argv[1] if len(sys.argv) > 1 else "docs/workflow.md")
