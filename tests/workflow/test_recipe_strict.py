"""Recipes read strictly (issue 52): a key given twice is refused (top level and inside a
stage), an alias bomb anywhere is refused at once before it is expanded (a recursive alias
too; ordinary anchors and merge keys still work), every relative input path is read from
the recipe's folder, ``run --check`` refuses removing every block and wrongly typed list
items, and a stage is not reused after its input weights changed in place with the same
size and time."""

from __future__ import annotations

import os
import time

import pytest

from prunelab.errors import ConfigError
from prunelab.workflow.recipe import load_recipe, stage_hashes
from prunelab.workflow.recipe_yaml import load_yaml
from prunelab.workflow.run import run_recipe

from tiny_models import SAMPLE_TEXT, cli_inproc, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict")
    save_tiny_checkpoint("llama", root / "model")  # 4 blocks
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _top(tiny) -> str:
    return (f"model: {tiny / 'model'}\ndata: text:{tiny / 'text.txt'}\n"
            f"test: text:{tiny / 'text.txt'}\nsamples: 2\nseqlen: 16\nbatch_size: 2\n")


def _check(recipe_text: str, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(recipe_text)
    return cli_inproc("run", str(recipe), "--out", str(tmp_path / "out"), "--check")


def _one_line(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


# ------------------------------------------------------------------ duplicate keys

@pytest.mark.parametrize("text, line, first", [
    ("model: a\nmodel: b\nstages: [{evaluate: {}}]\n", 2, 1),
    ("model: a\nstages:\n  - prune:\n      method: wanda\n      budget: remove-weights:0.5\n"
     "      budget: remove-weights:0.7\n", 6, 5),
    ("model: a\nstages:\n  - prune: {method: wanda, budget: 'remove-weights:0.5', "
     "budget: 'remove-weights:0.7'}\n", 3, 3),
])
def test_a_key_given_twice_is_refused(text, line, first, tmp_path):
    key = "model" if text.count("model:") == 2 else "budget"
    with pytest.raises(ConfigError, match=rf"^recipe: key '{key}' at line {line} repeats the "
                                          rf"one at line {first}; give it once$"):
        load_recipe(text)
    assert _one_line(_check(text, tmp_path)).startswith(f"error: recipe: key '{key}'")


# ------------------------------------------------------------------ aliases

def _bomb(levels: int = 9) -> str:
    """``&l0`` ten strings, each next level ten aliases of the one before: 10**levels."""
    parts = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        parts.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]")
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize("where", ["model", "tasks", "unknown"])
def test_an_alias_bomb_is_refused_at_once(where, tiny, tmp_path):
    if where == "model":
        text = f"model: {_bomb()}\nstages: [{{evaluate: {{}}}}]\n"
    elif where == "tasks":
        text = _top(tiny) + f"stages:\n  - evaluate: {{tasks: {_bomb()}}}\n"
    else:
        text = _top(tiny) + f"bogus: {_bomb()}\nstages: [{{evaluate: {{}}}}]\n"
    start = time.perf_counter()
    line = _one_line(_check(text, tmp_path))
    assert time.perf_counter() - start < 20
    assert "expands to more than 100,000 values through its aliases (an alias bomb?)" in line


def test_ordinary_aliases_merge_keys_and_recursion():
    assert load_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}
    got = load_yaml("base: &b {samples: 2, seqlen: 16}\nev: {<<: *b, seqlen: 32}\n")
    assert got["ev"] == {"samples": 2, "seqlen": 32}  # an explicit key over a merged one
    with pytest.raises(ConfigError, match="recursive alias"):
        load_yaml("model: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="is not valid YAML at line 3"):
        load_yaml("a: 1\nb: [\n")


# ------------------------------------------------------------------ one path rule

def test_relative_paths_are_read_from_the_recipe_folder(tiny, tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    save_tiny_checkpoint("llama", sub / "m")
    (sub / "t.txt").write_text(SAMPLE_TEXT)
    (sub / "task.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "gold": 0}\n')
    (sub / "r.yaml").write_text("model: m\ndata: text:t.txt\ntest: jsonl:task.jsonl:context\n"
                                "stages:\n  - prune: {method: wanda, calib: {data: text:t.txt}}\n"
                                "  - evaluate: {data: text:./t.txt, tasks: [task.jsonl]}\n")
    monkeypatch.chdir(tmp_path)  # the working folder holds neither m nor t.txt
    r = load_recipe(sub / "r.yaml")
    assert r.model == str(sub / "m") and r.data == f"text:{sub / 't.txt'}"
    assert r.test == f"jsonl:{sub / 'task.jsonl'}:context"
    assert r.stages[0].options.calib.data == f"text:{sub / 't.txt'}"
    assert r.stages[1].options.data == f"text:{sub / 't.txt'}"
    assert r.stages[1].options.tasks == (str(sub / "task.jsonl"),)
    # a recipe given as text keeps the working folder; embedded names and hub ids stay
    assert load_recipe("model: m\nstages: [{evaluate: {}}]\n").model == "m"
    (sub / "h.yaml").write_text("model: owner/name\nstages: [{evaluate: {}}]\n")
    assert load_recipe(sub / "h.yaml").model == "owner/name"
    (sub / "e.yaml").write_text("model: smollm2-135m\nstages: [{evaluate: {}}]\n")
    assert load_recipe(sub / "e.yaml").model == "smollm2-135m"
    # only in the working folder: not read from there
    save_tiny_checkpoint("llama", tmp_path / "here")
    (sub / "w.yaml").write_text("model: here\nstages: [{evaluate: {}}]\n")
    line = _one_line(cli_inproc("run", str(sub / "w.yaml"), "--out", str(tmp_path / "o"),
                                "--check"))
    assert line == f"error: model: {str(sub / 'here')!r} does not exist"


# ------------------------------------------------------------------ run --check

@pytest.mark.parametrize("stages, words", [
    ("  - prune: {method: depth, remove: 4}\n",
     "stage 0 (prune): removing 4 blocks would leave none of the 4"),
    ("  - prune: {method: depth, remove: 2}\n  - prune: {method: depth, remove: 2}\n",
     "stage 1 (prune): removing 2 blocks would leave none of the 2"),
    ("  - prune: {method: depth, blocks: [1, 7]}\n",
     "stage 0 (prune): block 7 does not exist (the model it starts from has 4 blocks, 0..3)"),
    ("  - prune: {method: depth, blocks: [0, 1, 2, 3]}\n", "would leave none of the 4"),
    ("  - heal: {prune: cascadeflow, remove: 4, steps: 1}\n", "would leave none of the 4"),
    ("  - prune: {method: wanda, targets: [1, 2]}\n",
     "stage 0 (prune): targets must be a list of strings, got [1, 2]"),
    ("  - prune: {method: wanda, ignore: 'mlp.*'}\n", "ignore must be a list"),
    ("  - prune: {method: svd-llm, targets: [true]}\n", "targets must be a list of strings"),
    ("  - evaluate: {tasks: [3]}\n", "tasks must be a list of task names, got [3]"),
])
def test_check_refuses(stages, words, tiny, tmp_path):
    line = _one_line(_check(_top(tiny) + "stages:\n" + stages, tmp_path))
    assert words in line, line


def test_check_accepts_what_leaves_a_block(tiny, tmp_path):
    res = _check(_top(tiny) + "stages:\n  - prune: {method: depth, remove: 3}\n"
                 "  - prune: {method: wanda, from: dense, targets: ['mlp.*']}\n"
                 "  - prune: {method: depth, remove: 3}\n", tmp_path)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------ reuse

def test_weights_changed_in_place_rerun_the_stage(tmp_path):
    save_tiny_checkpoint("llama", tmp_path / "model")
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT * 3)
    recipe = (f"model: {tmp_path / 'model'}\ndata: text:{tmp_path / 't.txt'}\n"
              f"test: text:{tmp_path / 't.txt'}\nsamples: 2\nseqlen: 16\nbatch_size: 2\n"
              "stages:\n  - evaluate: {samples: 2, seqlen: 16, reference: false}\n")
    out = tmp_path / "out"
    first = run_recipe(recipe, out)
    assert [s["status"] for s in first["stages"]] == ["ran"]
    assert [s["status"] for s in run_recipe(recipe, out)["stages"]] == ["reused"]
    weights = tmp_path / "model" / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # the last weights, same size
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert stage_hashes(load_recipe(recipe)) != {s["id"]: s["hash"] for s in first["stages"]}
    assert [s["status"] for s in run_recipe(recipe, out)["stages"]] == ["ran"]
    # a data file edited in place too
    text = tmp_path / "t.txt"
    st = text.stat()
    text.write_text(SAMPLE_TEXT.upper() * 3)
    os.utime(text, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [s["status"] for s in run_recipe(recipe, out)["stages"]] == ["ran"]
