"""Write docs/layout.md from the source tree and the floors of .importlinter.

Usage: python scripts/layout.py [--check]
--check: exit 1 when docs/layout.md differs from what would be written (tests run the same
comparison on the module lists)."""

from __future__ import annotations

import ast
import configparser
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "prunelab"
OUT = ROOT / "docs" / "layout.md"

INTRO = """# Layout

The source reads bottom to top, one floor at a time. A module imports only from its own
package or from a lower floor; siblings on one floor do not import each other; one method
family never imports another (what two families share lives in `pruning/base.py`,
`options.py`, `allocation.py`, `linears.py`). Imports inside functions count like any other.
The rules are the `import-linter` contracts of [`.importlinter`](../.importlinter), checked
by `tests/test_layers.py` in CI; where a lower floor needs something from above, the upper
one registers it (a checkpoint hook, a prune-while-tuning controller, a method's own
`check_streamable`).

The root package `prunelab` exposes the public names lazily (PEP 562): `import prunelab`
and `import prunelab.cli` load neither torch nor transformers. Imports go at the top of the
file: ruff's `PLC0415` refuses an import inside a function except in the files
`pyproject.toml` lists (the CLI, the torch-free workflow drivers and reports, modules around
an optional dependency) and where a single import carries `# noqa: PLC0415` with its
reason. No two modules import each other.

This page is written by `python scripts/layout.py` from the tree and the module docstrings;
`tests/test_layout.py` fails when a module is missing from it or listed but gone.

## Where new things live

- A new method: one file in its family (a config dataclass plus its maths, registered);
  its options reach the CLI and recipes from the config's field metadata.
- A new family: one folder under `pruning/`, registered, importing only lower floors, and
  added to the `families` contract.
- A new export format or runtime: a writer in `checkpoint/`, the stage in `workflow/`.
- Tests mirror the tree: `tests/<package>/test_*.py`; tiny shared models in
  `tests/tiny_models.py` and `tests/tiny_media.py`.
"""


def floors() -> list[list[str]]:
    """The floors of the ``floors`` contract, bottom first, as package names."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    layers = [ln.strip() for ln in cfg["importlinter:contract:floors"]["layers"].splitlines()
              if ln.strip()]
    out = []
    for layer in reversed(layers):
        parts = [p.strip().removeprefix("prunelab.") for p in
                 layer.replace(":", "|").split("|")]
        out.append(parts)
    return out


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split())
    cut = min((text.index(s) for s in (". ", ": ", "; ") if s in text), default=len(text))
    text = text[:cut].rstrip(".:;")
    if len(text) > 120:
        text = text[:117].rsplit(" ", 1)[0] + " ..."
    return text.replace("|", "\\|")


def package_rows(pkg: Path, prefix: str) -> list[tuple[str, str, str]]:
    """(package path, module file, summary) for ``pkg`` and its sub-packages."""
    rows = [(prefix, "__init__.py", summary(pkg / "__init__.py"))] \
        if (pkg / "__init__.py").exists() and summary(pkg / "__init__.py") else []
    rows += [(prefix, f.name, summary(f)) for f in sorted(pkg.glob("*.py"))
             if f.name != "__init__.py"]
    for sub in sorted(p for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        rows += package_rows(sub, f"{prefix}{sub.name}/")
    return rows


def render() -> str:
    lines = [INTRO, "## Floors, bottom to top", ""]
    for level, names in enumerate(floors()):
        title = " / ".join(f"`{n}`" for n in names)
        lines += [f"### {level}. {title}", "", "| package | module | what it is |",
                  "|---|---|---|"]
        for name in names:
            path = SRC / name
            if path.is_dir():
                rows = package_rows(path, f"{name}/")
            else:
                rows = [("", f"{name}.py", summary(path.with_suffix(".py")))]
            lines += [f"| {p or '(core)'} | `{m}` | {s} |" for p, m, s in rows]
        lines.append("")
    top = [f.name for f in sorted(SRC.glob("*.py")) if f.stem in ("__init__", "__main__")]
    lines += ["### Root", "", "| package | module | what it is |", "|---|---|---|"]
    lines += [f"| (root) | `{m}` | {summary(SRC / m)} |" for m in top]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        return 0 if OUT.read_text() == text else 1
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
