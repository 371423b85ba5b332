"""`prunelab heal`, `probe --probe gradient-flow` and `prune width --score rep-lie` end to end
on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from tiny_models import SAMPLE_TEXT, cli_here, cli_inproc, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_heal")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _common(tiny_dir):
    return ["--data", f"text:{tiny_dir / 'text.txt'}", "--seqlen", "16"]


def _zeros(path) -> int:
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    return sum(int((m.weight == 0).sum()) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "layers" in name)


def test_heal_keeps_the_sparsity_and_records_the_run(tiny_dir):
    sparse = tiny_dir / "wanda50"
    res = cli_inproc("--quiet", "prune", "sparsity", "--model", str(tiny_dir / "model"), "--method",
                     "wanda", "--budget", "remove-weights:0.5", "--samples", "4", "--batch-size",
                     "2", *_common(tiny_dir), "--out", str(sparse))
    assert res.returncode == 0, res.stderr
    healed = tiny_dir / "healed"
    res = cli_inproc("--quiet", "heal", "--model", str(sparse), "--teacher",
                     str(tiny_dir / "model"),
                     "--loss", "kd", "--steps", "4", "--batch-size", "2", "--eval-every", "2",
                     "--eval-data", f"text:{tiny_dir / 'text.txt'}", "--eval-samples", "2",
                     "--lr", "1e-3", *_common(tiny_dir), "--out", str(healed))
    assert res.returncode == 0, res.stderr
    assert "held-out perplexity before -> after" in res.stdout
    assert not (tiny_dir / "healed.heal-state").exists()  # removed after the save
    man = json.loads((healed / "manifest.json").read_text())
    rec = man["healing"]
    assert rec["loss"] == "kd" and rec["steps"] == 4 and rec["mode"] == "lora"
    assert rec["zeros_before"] == rec["zeros_after"]
    assert _zeros(healed) == _zeros(sparse)  # plain transformers, the zeros kept
    assert man["operations"][-1]["operation"] == "heal"
    assert man["metrics"]["held_out_after_perplexity"] > 0
    again = cli_inproc("heal", "--model", str(sparse), "--steps", "2", *_common(tiny_dir),
                       "--out", str(healed))
    assert again.returncode == 2 and "exists" in again.stderr


def test_heal_option_errors_are_one_line(tiny_dir, capsys):
    for bad in (["--loss", "bogus"], ["--steps", "0"], ["--lr", "nan"],
                ["--loss", "kd", "--steps", "2"]):  # kd without a teacher
        res = cli_here(capsys, "heal", "--model", str(tiny_dir / "model"), *_common(tiny_dir),
                       *bad, "--out", str(tiny_dir / "bad"))
        assert res.returncode == 2, (bad, res.stderr)
        assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr


def test_eval_data_none_turns_early_stopping_off_unless_patience_is_asked_for(tiny_dir):
    out = tiny_dir / "no-eval"
    res = cli_inproc("--quiet", "heal", "--model", str(tiny_dir / "model"), "--steps", "2",
                     "--batch-size", "2", "--eval-data", "none", *_common(tiny_dir),
                     "--out", str(out))
    assert res.returncode == 0, res.stderr
    rec = json.loads((out / "manifest.json").read_text())["healing"]
    assert rec["steps"] == 2 and rec["config"]["patience"] == 0
    res = cli_inproc("heal", "--model", str(tiny_dir / "model"), "--steps", "2", "--batch-size",
                     "2", "--eval-data", "none", "--patience", "2", *_common(tiny_dir),
                     "--out", str(tiny_dir / "no-eval-2"))
    assert res.returncode == 2 and res.stderr.startswith("error: ")
    assert "needs evaluation data" in res.stderr and res.stderr.count("\n") == 1


def test_gradient_flow_probe_and_rep_lie_width_score(tiny_dir):
    out = tiny_dir / "flow"
    res = cli_inproc("--quiet", "probe", "--model", str(tiny_dir / "model"), "--probe",
                     "gradient-flow", "--steps", "2", "--measure", "residual", "--samples", "4",
                     *_common(tiny_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    got = json.loads((out / "gradient-flow.json").read_text())
    assert got["config"]["steps"] == 2 and got["config"]["measure"] == "residual"
    assert len(got["scores"]) == 4
    width = tiny_dir / "replie"
    res = cli_inproc("--quiet", "prune", "width", "--model", str(tiny_dir / "model"), "--unit",
                     "ffn", "--score", "rep-lie", "--rep-lie-steps", "2", "--budget",
                     "remove-units:0.25", "--samples", "4", *_common(tiny_dir), "--out", str(width))
    assert res.returncode == 0, res.stderr
    cfg = json.loads((width / "config.json").read_text())
    assert cfg["intermediate_size"] == 32  # 48 x 0.75 = 36: nearest multiple of 8, ties even


def test_the_probe_summary_shows_the_gradient_fan_in(tiny_dir):
    out = tiny_dir / "flow-summary"
    res = cli_inproc("--quiet", "probe", "--model", str(tiny_dir / "model"), "--probe",
                     "gradient-flow,block-influence,leave-one-out", "--steps", "2", "--samples",
                     "4", *_common(tiny_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    summary = (out / "summary.md").read_text()
    assert "## Gradient fan-in (CascadeFlow)" in summary
    assert "Spearman with block-influence" in summary and "Spearman with leave-one-out" in summary
