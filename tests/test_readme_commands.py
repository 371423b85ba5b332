"""Every `prunelab ...` command shown in the README and the docs names a real command and only
options that command takes (the examples cannot drift from the CLI)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from prunelab.cli.apps import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GLOBAL = {"--quiet", "--verbose"}


def _commands(path: Path) -> list[str]:
    """`prunelab ...` lines inside the file's fenced code blocks (continuations joined)."""
    lines, inside, out = path.read_text().splitlines(), False, []
    buf = ""
    for line in lines:
        if line.startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        text = buf + line.strip()
        if text.endswith("\\"):
            buf = text[:-1] + " "
            continue
        buf = ""
        if text.startswith("prunelab "):
            out.append(text.split("#")[0].strip())
    return out


def _resolve(words: list[str]):
    group = typer.main.get_command(app)
    cmd, i = group, 0
    while hasattr(cmd, "commands") and i < len(words) and words[i] in cmd.commands:
        cmd = cmd.commands[words[i]]
        i += 1
    return cmd, i


CASES = [(p.name, c) for p in DOCS for c in _commands(p)]


def test_the_docs_show_commands():
    assert len(CASES) >= 20


@pytest.mark.parametrize("where,command", CASES, ids=[f"{w}:{c[:60]}" for w, c in CASES])
def test_documented_commands_use_real_options(where, command):
    words = [w for w in shlex.split(command)[1:] if w not in GLOBAL]
    cmd, used = _resolve(words)
    assert used > 0 and not hasattr(cmd, "commands"), f"{where}: no command in {command!r}"
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    flags = {w.split("=")[0] for w in words[used:] if re.match(r"^--?[a-zA-Z]", w)}
    unknown = sorted(flags - known)
    assert not unknown, f"{where}: {unknown} not options of `prunelab {' '.join(words[:used])}`"
