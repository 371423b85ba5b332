"""Every `prunelab ...` command shown in README.md and docs/*.md is checked against the CLI, so
a documented command cannot silently rot.

The commands are the lines of the fenced code blocks that start with ``prunelab `` (a ``$ ``
prompt dropped, backslash continuations joined, ``# comments`` cut; an optional part shown
as ``[--flag VALUE]`` is checked with it). In the default run, fast:

- every command parses: the command exists, and every option, its value's type and the
  required options are accepted by click, exactly as on the command line;
- every ``--budget KIND:VALUE`` is a valid budget;
- every command on a text model passes every check that runs before the model is loaded
  (conflicting options, budget kinds of that command and method, option values): run
  through :func:`prunelab.cli.cli_main` with ``--model`` pointing at a missing folder, the
  one error it may give is that folder's absence.

Marked ``slow``: each command on a text model runs for real, in the order of its page, on the
embedded models with small samples (``--samples 2 --seqlen 32``, a few steps, grids cut to two
points; outputs under a temporary folder, where later commands of the page find them).
Commands that need a GPU, a network, a cluster or files a user supplies are in :data:`SKIP`
with the reason. The slow run takes the front door (:data:`FRONT`: README.md,
real-models.md, serving.md); every page runs with ``PRUNELAB_DOCS_RUN=all`` (the first 29
commands, README.md to factorization.md, took 20 minutes on two shared cores, so all pages
would overrun the slow tier's budget). ``PRUNELAB_DOCS_TIMES=FILE``
appends each command's seconds to FILE.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import time
from pathlib import Path

import pytest
import typer

from prunelab.budget import parse_budget, parse_budget_list, parse_budget_span
from prunelab.cli import cli_main
from prunelab.cli.apps import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GLOBAL = {"--quiet", "--verbose", "-q", "-v"}
MODEL_FLAGS = ("--model",)
TEXT_MODELS = {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
MISSING = "missing-docs-model"

#: (page, start of the command) -> why it is not run; parsing is still checked
SKIP = {
    ("inference.md", "prunelab generate --model smollm2-135m --prompt @long.txt"):
        "reads long.txt, a file the user supplies",
    ("scale.md", "prunelab prune width --model ./ckpt"): "./ckpt: the user's checkpoint",
    ("scale.md", "prunelab prune depth --model ./ckpt"): "./ckpt: the user's checkpoint",
    ("scale.md", "prunelab probe --model ./ckpt"): "./ckpt: the user's checkpoint",
    ("scale.md", "prunelab prune sparsity --model qwen2.5-coder-1.5b"):
        "qwen2.5-coder-1.5b is installed only on request (1.1 GB)",
    ("speech.md", "prunelab eval --model ./pruned"): "./pruned, ./my_clips: the user's files",
    ("tasks.md", "prunelab eval --model ./pruned"): "./pruned, my_tasks/: the user's files",
    ("report.md", "prunelab sweep depth --model smollm2-135m --probes block-influence,inter"):
        "--ray auto starts a Ray cluster",
}


def _commands(path: Path) -> list[tuple[int, str]]:
    """``(line, command)`` of the ``prunelab ...`` lines in the file's fenced code blocks."""
    out, inside, buf, start = [], False, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("```"):
            inside, buf = not inside, ""
            continue
        if not inside:
            continue
        text = line.strip()
        if not buf:
            start = number
            text = text.removeprefix("$ ")
        text = buf + text
        if text.endswith("\\"):
            buf = text[:-1].rstrip() + " "
            continue
        buf = ""
        if text.startswith("prunelab "):
            out.append((start, " ".join(shlex.split(text, comments=True))))
    return out


CASES = [(p.name, n, c) for p in DOCS for n, c in _commands(p)]
IDS = [f"{w}:{n}" for w, n, _ in CASES]


def _words(command: str) -> list[str]:
    """The command's words after ``prunelab`` and its global options, optional parts kept."""
    return _split_globals(command)[1]


def _split_globals(command: str) -> tuple[list[str], list[str]]:
    """(global options, the rest): ``--plugin FILE`` (a repository path made absolute) and
    the global flags before the command."""
    words = shlex.split(command.replace("[", " ").replace("]", " "))[1:]
    head = []
    while words and words[0].startswith("-"):
        if words[0] in GLOBAL:
            words = words[1:]
            continue
        value = words[1]
        head += [words[0], str(ROOT / value) if (ROOT / value).exists() else value]
        words = words[2:]
    return head, words


def _resolve(words: list[str]):
    cmd, i = typer.main.get_command(app), 0
    while hasattr(cmd, "commands") and i < len(words) and words[i] in cmd.commands:
        cmd = cmd.commands[words[i]]
        i += 1
    return cmd, i


def _values(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag] + \
        [w.split("=", 1)[1] for w in words if w.startswith(flag + "=")]


@contextlib.contextmanager
def _plugins_forgotten():
    """A ``--plugin`` of a documented command registers its methods for this process only
    while the command runs (the other tests see the built-in registry)."""
    from prunelab.cli import plugins
    from prunelab.pruning import METHODS

    before = set(METHODS.names())
    try:
        yield
    finally:
        for name in set(METHODS.names()) - before:
            METHODS.unregister(name)
        plugins._loaded.clear()
        plugins.set_cli(None)


def _skip_reason(where: str, command: str) -> str | None:
    for (page, start), why in SKIP.items():
        if page == where and command.startswith(start):
            return why
    return None


def test_the_docs_show_commands():
    assert len(CASES) >= 100
    assert {w for w, _, _ in CASES} >= {"README.md", "factorization.md", "workflow.md"}
    for (page, start) in SKIP:  # no stale entry
        assert any(w == page and c.startswith(start) for w, _, c in CASES), (page, start)


def test_continuations_comments_and_prompts_are_joined(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```bash\n$ prunelab eval --model m \\\n   --samples 2  # a note\n"
                    "echo no\n```\nprunelab outside --a-block\n```\nprunelab info\n```\n")
    assert _commands(page) == [(3, "prunelab eval --model m --samples 2"),
                               (9, "prunelab info")]


@pytest.mark.parametrize("where,line,command", CASES, ids=IDS)
def test_documented_command_parses(where, line, command):
    """The command, its options, their value types and the required ones, as click sees
    them (nothing runs)."""
    head, words = _split_globals(command)
    cmd, used = _resolve(words)
    assert used > 0 and not hasattr(cmd, "commands"), f"{where}:{line}: no command {command!r}"
    if "--plugin" in head:
        pytest.skip("a plugin's methods and options exist once it is loaded: checked by "
                    "test_documented_command_passes_the_checks_before_the_model")
    try:
        ctx = cmd.make_context(" ".join(["prunelab", *words[:used]]), words[used:])
    except Exception as exc:  # click's usage errors: the message says what is wrong
        shown = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        pytest.fail(f"{where}:{line}: {command!r}: {type(exc).__name__}: {shown}")
    ctx.close()
    for value in _values(words, "--budget"):
        if ".." in value:
            parse_budget_span(value)
        elif "," in value:
            parse_budget_list(value)
        else:
            parse_budget(value)


def _text_model_cases() -> list[tuple[str, int, str]]:
    """The commands whose ``--model`` is a text decoder: an embedded one, or an output of an
    earlier command of the same page made from one."""
    out, made = [], {}
    for where, line, command in CASES:
        words = _words(command)
        model = (_values(words, "--model") or [None])[0]
        text = model in TEXT_MODELS or made.get((where, model), False)
        for dest in _values(words, "--out"):
            made[(where, dest.rstrip("/"))] = text
        if text and _skip_reason(where, command) is None:
            out.append((where, line, command))
    return out


TEXT_CASES = _text_model_cases()


def test_the_text_commands_are_most_of_them():
    assert len(TEXT_CASES) >= 50
    assert set(FRONT) <= {w for w, _, _ in TEXT_CASES}  # every front page runs something


@pytest.mark.parametrize("where,line,command", TEXT_CASES,
                         ids=[f"{w}:{n}" for w, n, _ in TEXT_CASES])
def test_documented_command_passes_the_checks_before_the_model(where, line, command, tmp_path,
                                                               capsys):
    """Every check that runs before the model is loaded passes: the one error is the
    missing model folder this test substitutes."""
    head, words = _split_globals(command)
    argv = []
    for i, w in enumerate(words):
        argv.append(str(tmp_path / MISSING) if i and words[i - 1] in MODEL_FLAGS else w)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with _plugins_forgotten():
            code = cli_main(["--quiet", *head, *argv])
    finally:
        os.chdir(cwd)
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, f"{where}:{line}: {command}\n{cap.err}"
    assert MISSING in lines[0] and "does not exist" in lines[0], \
        f"{where}:{line}: {command}\n  {lines[0]}"
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    assert not left, f"{where}:{line}: a failed command left {left}"


# --------------------------------------------------------------------------- run for real

#: option -> the small value a run uses
SMALL = {"--samples": "2", "--seqlen": "32", "--test-samples": "2", "--test-seqlen": "32",
         "--steps": "2", "--tokens": "256", "--limit": "2", "--max-new-tokens": "4",
         "--train-samples": "4", "--search-windows": "2",
         "--eval-samples": "2", "--bootstrap": "0", "--prune-every": "1", "--every": "1",
         "--eval-every": "1", "--press-continuation": "8"}
#: commands that take --samples / --seqlen but were shown without them
SIZED = ("probe", "prune", "sweep", "compare", "heal", "eval")
#: commands that run one point per budget / probe: a run keeps two of each
GRIDS = ("sweep", "compare")
#: ``prunelab front`` with --model: one grid point with a two-step heal, two types, one
#: speed round (a target is asked of what was built: the loosest one)
FRONT_SMALL = {"--grid": "depth:1+heal", "--types": "f16,q8_0", "--grid-types": "q8_0",
               "--samples": "2", "--seqlen": "32", "--windows": "2", "--test-seqlen": "32",
               "--rounds": "1", "--prompt": "16", "--gen": "4", "--heal-set": "steps=2"}


def _small_front(words: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(words):
        if words[i] in FRONT_SMALL or words[i] == "--target":
            i += 2
            continue
        out.append(words[i])
        i += 1
    if "--model" in out:
        for flag, value in FRONT_SMALL.items():
            out += [flag, value]
    if "--target" in words:
        out += ["--target", "ppl:1000000"]
    return out


def _fewer_blocks(value: str) -> str:
    """``remove-blocks:N`` -> at most 2 blocks (a search scores every block per step)."""
    kind, _, n = value.partition(":")
    return f"{kind}:{min(int(n), 2)}" if kind == "remove-blocks" and n.isdigit() else value


def _two_points(flag: str, value: str) -> str:
    """A grid's ``--budget`` (``K:1..6`` -> ``K:1..2``, ``K:2,4,6`` -> ``K:2,4``) or
    ``--probes`` list cut to its first two points: the same code runs, on fewer points."""
    if flag == "--probes":
        return ",".join(value.split(",")[:2])
    kind, _, values = value.partition(":")
    lo, dots, hi = values.partition("..")
    if dots and lo.isdigit() and hi.isdigit():
        return f"{kind}:{lo}..{min(int(hi), int(lo) + 1)}"
    return f"{kind}:{','.join(values.split(',')[:2])}" if "," in values else value


def _small(words: list[str], where_dir: Path) -> list[str]:
    if words and words[0] == "front":
        return _small_front(words)
    out, i = [], 0
    while i < len(words):
        w = words[i]
        if w in SMALL and i + 1 < len(words):
            # pruning while healing needs more steps than events (one event per step here)
            out += [w, "8" if w == "--steps" and "--prune" in words else SMALL[w]]
            i += 2
            continue
        if words[0] in GRIDS and w in ("--budget", "--probes") and i + 1 < len(words):
            out += [w, _two_points(w, words[i + 1])]
            i += 2
            continue
        if w == "--budget" and "sleb" in words and i + 1 < len(words):
            out += [w, _fewer_blocks(words[i + 1])]  # a search costs blocks x steps
            i += 2
            continue
        out.append(w)
        i += 1
    cmd, used = _resolve(out)
    known = {o for p in cmd.params for o in p.opts}
    for flag in ("--samples", "--seqlen", "--test-samples", "--test-seqlen"):
        if flag in known and flag not in out and out[0] in SIZED:
            out += [flag, SMALL[flag]]
    if "--batch-size" in known and "--batch-size" not in out and out[0] in SIZED:
        out += ["--batch-size", "1"]  # two windows still make two batches (held-out splits)
    if out[0] == "run":
        out = [str(ROOT / w) if w.startswith("recipes/") else w for w in out]
    return out


#: the pages whose commands the slow run executes (all of them with PRUNELAB_DOCS_RUN=all)
FRONT = ("README.md", "real-models.md", "serving.md")


def _page_runs():
    pages: dict[str, list[tuple[int, str]]] = {}
    for where, line, command in TEXT_CASES:
        pages.setdefault(where, []).append((line, command))
    every = os.environ.get("PRUNELAB_DOCS_RUN") == "all"
    return sorted((w, c) for w, c in pages.items() if every or w in FRONT)


def _needs_llama_cpp(words: list[str]) -> bool:
    """A GGUF export quantized by llama.cpp's own quantizer (needs llama-cpp-python)."""
    from prunelab.checkpoint.gguf_export import QUANT_TYPES

    return "--outtype" in words[:-1] and words[words.index("--outtype") + 1] in QUANT_TYPES


@pytest.mark.slow
@pytest.mark.parametrize("where,commands", _page_runs(), ids=[w for w, _ in _page_runs()])
def test_documented_commands_run(where, commands, tmp_path, capsys):
    """The page's text-model commands, in order, for real with small samples."""
    failures = []
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for line, command in commands:
            head, words = _split_globals(command)
            if _needs_llama_cpp(words) and importlib.util.find_spec("llama_cpp") is None:
                continue  # scripts/test.sh builds it; "llama.cpp checks skip" without it
            start = time.perf_counter()
            with _plugins_forgotten():
                code = cli_main(["--quiet", *head, *_small(words, tmp_path)])
            cap = capsys.readouterr()
            if os.environ.get("PRUNELAB_DOCS_TIMES"):  # a file: where the slow tier's time goes
                with open(os.environ["PRUNELAB_DOCS_TIMES"], "a", encoding="utf-8") as log:
                    log.write(f"{time.perf_counter() - start:7.1f} s  exit {code}  "
                              f"{where}:{line}\n")
            if code != 0:
                failures.append(f"{where}:{line}: {command}\n  {cap.err.strip()[-400:]}")
    finally:
        os.chdir(cwd)
    assert not failures, "\n".join(failures)


def test_small_values_replace_the_documented_ones(tmp_path):
    got = _small(_words("prunelab heal --model m --steps 200 --tokens 200000 --out o"),
                 tmp_path)
    assert got[got.index("--steps") + 1] == "2" and got[got.index("--tokens") + 1] == "256"
    assert got[-4:] == ["--samples", "2", "--seqlen", "32"] or "--seqlen" in got
    assert re.search("recipes", " ".join(_small(["run", "recipes/demo.yaml"], tmp_path)))
    got = _small(_words("prunelab sweep depth --probes a,b,c --budget remove-blocks:1..6 "
                        "--out o"), tmp_path)
    assert got[got.index("--probes") + 1] == "a,b"
    assert got[got.index("--budget") + 1] == "remove-blocks:1..2"
    got = _small(_words("prunelab compare --methods depth --budget remove-blocks:2,4,6"),
                 tmp_path)
    assert got[got.index("--budget") + 1] == "remove-blocks:2,4"
    got = _small(_words("prunelab prune depth --strategy sleb --budget remove-blocks:8"),
                 tmp_path)
    assert got[got.index("--budget") + 1] == "remove-blocks:2"
    got = _small(_words("prunelab compare --budget keep-params:0.8"), tmp_path)
    assert got[got.index("--budget") + 1] == "keep-params:0.8"
