"""`prunelab prune gates` and `prunelab probe --bootstrap` end to end on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab

from tiny_models import SAMPLE_TEXT, cli_inproc, save_tiny_checkpoint, tiny_tokens

IDS = tiny_tokens(2, 12, seed=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_conditional")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def test_prune_gates_removes_sublayers_and_reloads(tiny_dir):
    out = tiny_dir / "gated"
    res = cli_inproc("--quiet", "prune", "gates", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--budget", "remove-compute:0.3", "--rounds", "2",
                     "--set", "steps=50", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "sublayer compute skipped" in res.stdout and "removed sublayers" in res.stdout
    man = json.loads((out / "manifest.json").read_text())
    rep = man["report"]
    assert rep["achieved"] >= 0.3 and rep["removed_sublayers"]
    assert rep["flops_per_token_after"] < rep["flops_per_token_before"]
    op = man["operations"][-1]
    assert op["config"]["budget"] == 0.3 and op["config"]["rounds"] == 2
    info = cli_inproc("info", "--model", str(out), "--trust-remote-code", "--json",
                      str(tiny_dir / "gated-info.json"))
    assert info.returncode == 0, info.stderr
    blocks = json.loads((tiny_dir / "gated-info.json").read_text())["block_details"]
    removed = sum(b[p] == "removed" for b in blocks for p in ("attention", "mlp"))
    assert removed == len(rep["removed_sublayers"]) - 2 * len(rep["deleted_blocks"])
    remote = rep["needs_remote_code"]
    again = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote).eval()
    ours = prunelab.load(str(out), trust_remote_code=remote)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS, use_cache=False).logits,
                                   ours.model(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)


def test_probe_bootstrap_prints_the_ranking_stability(tiny_dir):
    out = tiny_dir / "probes"
    res = cli_inproc("--quiet", "probe", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "6", "--seqlen", "16",
                     "--probe", "leave-one-out", "--bootstrap", "50", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "ranking stability" in res.stdout and "at 6 windows" in res.stdout
    got = json.loads((out / "leave-one-out.json").read_text())
    assert got["reliability"]["bootstrap"] == 50
    assert all(s["ci_low"] <= s["value"] <= s["ci_high"] for s in got["scores"])
    summary = (out / "summary.md").read_text()
    assert "Ranking stability" in summary


def test_prune_moe_then_eval_at_another_mass(tiny_dir):
    out = tiny_dir / "moe"
    res = cli_inproc("--quiet", "prune", "moe", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--experts", "4", "--budget", "keep-mass:0.9", "--set",
                     "router_steps=20", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "experts per token" in res.stdout and "prunelab_moe_mass" in res.stdout
    man = json.loads((out / "manifest.json").read_text())
    assert man["operations"][-1]["config"]["experts"] == 4
    config = json.loads((out / "config.json").read_text())
    assert config["prunelab_moe_mass"] == 0.9 and config["model_type"] == "prunelab_moe_llama"
    figures = {}
    for mass in ("1.0", "0.5"):
        js = tiny_dir / f"moe-eval-{mass}.json"
        res = cli_inproc("eval", "--model", str(out), "--trust-remote-code", "--data",
                         f"text:{tiny_dir / 'text.txt'}", "--seqlen", "16", "--samples", "2",
                         "--budget", f"keep-mass:{mass}", "--json", str(js))
        assert res.returncode == 0, res.stderr
        assert "PrunePath experts per token" in res.stdout
        figures[mass] = json.loads(js.read_text())
    assert figures["1.0"]["moe"]["experts_per_token"] == 4.0
    assert figures["0.5"]["moe"]["experts_per_token"] < 4.0
    assert figures["0.5"]["moe"]["ffn_flops_ratio"] < figures["1.0"]["moe"]["ffn_flops_ratio"]


def test_prune_depth_sleb_over_sublayers_with_recovery_in_the_loop(tiny_dir):
    out = tiny_dir / "sleb-sub"
    res = cli_inproc("--quiet", "prune", "depth", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--budget", "remove-blocks:1", "--strategy", "sleb",
                     "--sleb-score", "kl", "--granularity", "sublayer", "--recovery", "ghost",
                     "--recovery-in-loop", "--out", str(out))
    assert res.returncode == 0, res.stderr
    man = json.loads((out / "manifest.json").read_text())
    rep = man["report"]
    assert rep["removed_sublayers"] and "removed sub-blocks" in res.stdout
    cfg = man["operations"][-1]["config"]
    assert cfg["granularity"] == "sublayer" and cfg["recovery_in_loop"] is True
    assert rep["selection"]["block_evaluations"] > 0
    again = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ours = prunelab.load(str(out), trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS, use_cache=False).logits,
                                   ours.model(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)


def test_prune_depth_sleb_resumes_a_search(tiny_dir):
    out = tiny_dir / "sleb-resume"
    res = cli_inproc("--quiet", "prune", "depth", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--budget", "remove-blocks:2", "--strategy", "sleb",
                     "--sleb-score", "kl", "--sleb-resume", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "manifest.json").read_text())["report"]
    assert 1 in rep["removed_blocks"] and len(rep["removed_blocks"]) == 2
    assert rep["selection"]["resumed_from"] == [1]
    assert len(rep["selection"]["steps"]) == 1
    res = cli_inproc("prune", "depth", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
                     "--budget", "remove-blocks:2", "--strategy", "sleb", "--sleb-resume", "1",
                     "--recovery", "ghost", "--recovery-in-loop", "--out", str(tiny_dir / "x"))
    assert res.returncode == 2 and res.stderr.startswith("error: --sleb-resume cannot")
    assert "Traceback" not in res.stderr


def test_prune_depth_reports_the_selection_stability(tiny_dir):
    out = tiny_dir / "stable"
    res = cli_inproc("--quiet", "prune", "depth", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "6", "--seqlen", "16",
                     "--batch-size", "2", "--budget", "remove-blocks:1", "--probe", "leave-one-out",
                     "--bootstrap", "40", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "selection stability" in res.stdout and "of 40 resamples" in res.stdout
    man = json.loads((out / "manifest.json").read_text())
    stab = man["report"]["selection"]["selection_stability"]
    assert 0.0 <= stab["share_same"] <= 1.0 and len(stab["inclusion"]) == 4


def test_probe_head_attribution_from_the_cli(tiny_dir):
    out = tiny_dir / "heads"
    res = cli_inproc("--quiet", "probe", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "2", "--seqlen", "16",
                     "--probe", "stable-rank,head-ablation,induction", "--ablation", "mean",
                     "--induction-length", "8", "--induction-sequences", "2", "--top-k", "2",
                     "--out", str(out))
    assert res.returncode == 0, res.stderr
    ablation = json.loads((out / "head-ablation.json").read_text())
    assert ablation["kind"] == "head" and ablation["config"]["ablation"] == "mean"
    assert len(ablation["scores"]) == 4 * 4  # 4 blocks x 4 query heads
    induction = json.loads((out / "induction.json").read_text())
    assert induction["config"]["top_k"] == 2 and induction["config"]["length"] == 8
    assert (out / "stable-rank.png").exists()
    bad = cli_inproc("probe", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--seqlen", "16", "--probe", "stable-rank",
                     "--ablation", "mean", "--out", str(tiny_dir / "bad"))
    assert bad.returncode == 2 and "ablation" in bad.stderr
