"""``prunelab eval --tasks`` end to end on a tiny checkpoint and a tiny JSONL task, and its
errors (exit 2, one line)."""

from __future__ import annotations

import json

import pytest

import prunelab
from prunelab.eval.tasks import evaluate_tasks

from tiny_models import cli_here, cli_inproc, save_tiny_checkpoint


def cli(*args):
    """``prunelab ARGS`` in this process, 160 columns wide (the task table in one line)."""
    return cli_inproc(*args, columns=160)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_tasks")
    save_tiny_checkpoint("llama", root / "model")
    rows = [{"context": f"Q: {i} plus one?\nA:", "choices": [str(i + 1), str(i + 2), "no"],
             "gold": 0, "id": f"q{i}"} for i in range(6)]
    (root / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_eval_tasks_jsonl_end_to_end(root):
    out = root / "eval.json"
    res = cli("--quiet", "eval", "--model", str(root / "model"), "--data",
              "text:" + str(root / "qa.jsonl"), "--seqlen", "32", "--samples", "1",
              "--tasks", str(root / "qa.jsonl"), "--limit", "5", "--json", str(out))
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())["tasks"]["qa"]
    assert got["n"] == 5 and "qa" in res.stdout
    for key in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
        assert isinstance(got[key], float)
    api = evaluate_tasks(prunelab.load(str(root / "model")), str(root / "qa.jsonl"), limit=5)
    assert (got["acc"], got["acc_norm"]) == (api["qa"]["acc"], api["qa"]["acc_norm"])


def test_eval_tasks_errors_are_one_line(root, tmp_path, capsys):
    # unknown task names: tests/eval/test_tasks.py::test_unknown_task_lists_known_ones
    save_tiny_checkpoint("bert", tmp_path / "enc")
    res = cli_here(capsys, "eval", "--model", str(tmp_path / "enc"), "--tasks",
                   str(root / "qa.jsonl"))
    assert res.returncode == 2 and "encoder" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "c", "choices": ["a", "b"], "gold": 5}\n')
    res = cli_here(capsys, "eval", "--model", str(root / "model"), "--tasks", str(bad),
                   "--seqlen", "32")
    assert res.returncode == 2 and f"{bad}:1" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_eval_tasks_without_samples_scores_a_few_perplexity_windows(root):
    """``--tasks`` without ``--samples``: perplexity on 16 windows, not the whole --data."""
    text = root / "long.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = root / "few.json"
    res = cli("--quiet", "eval", "--model", str(root / "model"), "--data", f"text:{text}",
              "--seqlen", "16", "--tasks", str(root / "qa.jsonl"), "--limit", "2",
              "--json", str(out), "--overwrite")
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    windows = got.get("windows") or got.get("data", {}).get("samples")
    assert windows == 16, got.keys()
