"""`prunelab prune gates` and `prunelab probe --bootstrap` end to end on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from test_cli import cli

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint, tiny_tokens

IDS = tiny_tokens(2, 12, seed=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_conditional")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def test_prune_gates_removes_sublayers_and_reloads(tiny_dir):
    out = tiny_dir / "gated"
    res = cli("--quiet", "prune", "gates", "--model", str(tiny_dir / "model"), "--data",
              f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
              "--batch-size", "2", "--budget", "0.3", "--rounds", "2", "--set", "steps=50",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "sublayer compute skipped" in res.stdout and "removed sublayers" in res.stdout
    man = json.loads((out / "manifest.json").read_text())
    rep = man["report"]
    assert rep["achieved"] >= 0.3 and rep["removed_sublayers"]
    assert rep["flops_per_token_after"] < rep["flops_per_token_before"]
    op = man["operations"][-1]
    assert op["config"]["budget"] == 0.3 and op["config"]["rounds"] == 2
    remote = rep["needs_remote_code"]
    again = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote).eval()
    ours = prunelab.load(str(out), trust_remote_code=remote)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS, use_cache=False).logits,
                                   ours.model(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)


def test_probe_bootstrap_prints_the_ranking_stability(tiny_dir):
    out = tiny_dir / "probes"
    res = cli("--quiet", "probe", "--model", str(tiny_dir / "model"), "--data",
              f"text:{tiny_dir / 'text.txt'}", "--samples", "6", "--seqlen", "16",
              "--probe", "leave-one-out", "--bootstrap", "50", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "ranking stability" in res.stdout and "at 6 windows" in res.stdout
    got = json.loads((out / "leave-one-out.json").read_text())
    assert got["reliability"]["bootstrap"] == 50
    assert all(s["ci_low"] <= s["value"] <= s["ci_high"] for s in got["scores"])
    summary = (out / "summary.md").read_text()
    assert "Ranking stability" in summary
