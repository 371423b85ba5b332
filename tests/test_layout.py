"""docs/layout.md matches the tree: every module of src/prunelab is listed under its package
and every listed module exists (rewrite the page with `python scripts/layout.py`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "prunelab"


def _listed() -> set[str]:
    rows = re.findall(r"^\| ([^|]+?) \| `([^`]+)` \|", (ROOT / "docs" / "layout.md").read_text(),
                      re.M)
    out = set()
    for pkg, module in rows:
        pkg = "" if pkg.startswith("(") else pkg
        out.add(pkg + module)
    return out


def _tree() -> set[str]:
    files = {str(f.relative_to(SRC)) for f in SRC.rglob("*.py") if "__pycache__" not in f.parts}
    # a package's __init__ is listed only when it says what the package is
    listed = _listed()
    return {f for f in files if not f.endswith("__init__.py") or f in listed
            or f == "__init__.py"}


def test_layout_lists_every_module_and_only_those():
    listed, tree = _listed(), _tree()
    assert not tree - listed, f"modules missing from docs/layout.md: {sorted(tree - listed)}"
    assert not listed - tree, f"listed but not in the tree: {sorted(listed - tree)}"


def test_layout_floors_follow_the_contract():
    """The page's floors are the layers of .importlinter, bottom first."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    layers = [ln.strip() for ln in cfg["importlinter:contract:floors"]["layers"].splitlines()
              if ln.strip()]
    heads = re.findall(r"^### \d+\. (.+)$", (ROOT / "docs" / "layout.md").read_text(), re.M)
    want = [" / ".join(f"`{p.strip().removeprefix('prunelab.')}`"
                       for p in layer.replace(":", "|").split("|")) for layer in reversed(layers)]
    assert heads == want


def test_sources_and_docs_cite_methods_not_issue_numbers():
    """A module docstring or a doc page names a method's paper (or says it has none), never
    an issue number of this project's tracker, which a reader cannot follow."""
    import re

    root = Path(__file__).resolve().parent.parent
    cites = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    found = [f"{p.relative_to(root)}:{i}" for top in ("src", "docs")
             for p in sorted((root / top).rglob("*")) if p.suffix in (".py", ".md")
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if cites.search(line)]
    assert not found, found
