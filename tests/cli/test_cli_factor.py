"""`prunelab prune factor` end to end on a tiny checkpoint: every method writes a checkpoint
whose manifest rebuilds its config, `info` shows the factorized modules, and the global
rotation is a plain checkpoint that `transformers` loads without remote code; `eval
--gradient-alignment` against itself is 1."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.pruning import METHODS

from tiny_models import SAMPLE_TEXT, cli_inproc, save_tiny_checkpoint, tiny_tokens

IDS = tiny_tokens(2, 12, seed=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_factor")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def _run(tiny_dir, name: str, *options: str):
    out = tiny_dir / name
    res = cli_inproc("--quiet", "prune", "factor", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--out", str(out), *options)
    assert res.returncode == 0, res.stderr
    return out, json.loads((out / "manifest.json").read_text()), res.stdout


def test_global_slice_is_a_plain_checkpoint(tiny_dir):
    out, man, shown = _run(tiny_dir, "global", "--method", "slicegpt", "--rotation", "global",
                           "--budget", "remove-hidden:0.25", "--multiple", "4")
    assert man["loads_with"].startswith("plain")
    assert "plain transformers" in shown and "parameters (as stored)" in shown
    plain = tf.AutoModelForCausalLM.from_pretrained(out).eval()  # no remote code
    assert plain.config.hidden_size == 24
    ours = prunelab.load(str(out))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=IDS).logits,
                                   ours.model(input_ids=IDS, use_cache=False).logits)
    op = man["operations"][-1]
    assert op["operation"] == "prune-factor" and op["d_kept"] == 24
    assert METHODS.from_dict(op["config"]).rotation == "global"
    rep = man["report"]
    assert rep["params_after"] < rep["params_before"] or rep["kept_params"] >= 1  # untied head
    assert rep["flops_per_token_after"] < rep["flops_per_token_before"]


def test_keep_tied_from_the_cli_and_gguf_only_refused_before_any_work(tiny_dir):
    # the tiny checkpoint's head is untied: keep_tied leaves it so and says nothing false
    out, man, _ = _run(tiny_dir, "kept", "--method", "slicegpt", "--rotation", "global",
                       "--budget", "remove-hidden:0.25", "--multiple", "4", "--keep-tied")
    assert METHODS.from_dict(man["operations"][-1]["config"]).keep_tied is True
    assert man["report"]["tied_head"] is False
    res = cli_inproc("prune", "factor", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--method", "slicegpt", "--rotation",
                     "global", "--gguf-only", "--out", str(tiny_dir / "gguf-only"))
    assert res.returncode == 2 and not (tiny_dir / "gguf-only").exists()
    assert res.stderr.strip().splitlines() == [
        "error: --gguf-only makes models that only go to GGUF from memory (prunelab front's "
        "slice points, or the Python API); prunelab prune saves a checkpoint: drop "
        "--gguf-only"]


@pytest.mark.parametrize(("method", "options"), [
    ("svd-llm", ("--budget", "remove-weights:0.3", "--allocation", "spectrum")),
    ("basis-sharing", ("--budget", "remove-weights:0.3")),
    ("shared-dict", ("--budget", "remove-weights:0.3", "--set", "iters=3")),
    ("slicegpt", ("--budget", "remove-hidden:0.25", "--multiple", "4")),
    ("slicegpt", ("--budget", "remove-hidden:0.25", "--multiple", "4", "--widths", "spectrum")),
    ("slicegpt", ("--budget", "remove-hidden:0.25", "--multiple", "4", "--widths", "kl",
                  "--set", "width_levels=2")),
])
def test_factorized_checkpoints_need_remote_code_and_show_in_info(tiny_dir, method, options):
    how = options[options.index("--widths") + 1] if "--widths" in options else ""
    name = method + (f"-widths-{how}" if how else "")
    out, man, shown = _run(tiny_dir, name, "--method", method, *options)
    assert man["remote_code"]["trust_remote_code"] and man["remote_code"]["modules"]
    if how:
        widths = man["operations"][-1]["block_widths"]
        assert len(widths) == 5 and "hidden size" in shown
        assert how == "kl" or "per block" in shown
        assert sum(widths) <= 5 * 24 + 8  # about the uniform budget (shortcuts differ)
    if how == "kl":
        curves = man["report"]["width_kl_curves"]
        assert len(curves) == 5 and all(sorted(c) == ["16", "24"] for c in curves)
    assert "trust_remote_code=True" in shown
    assert man["report"]["flops_per_token_after"] < man["report"]["flops_per_token_before"]
    res = cli_inproc("info", "--model", str(out), "--trust-remote-code", "--json",
                     str(tiny_dir / f"{name}-info.json"))
    assert res.returncode == 0, res.stderr
    assert "factorized modules" in res.stdout
    info = json.loads((tiny_dir / f"{name}-info.json").read_text())
    kinds = {m["kind"] for m in info["factorized"]}
    assert kinds == {m["kind"] for m in man["remote_code"]["modules"]}
    assert info["params"] == man["report"]["params_after"]
    assert info["flops_per_token"] == man["report"]["flops_per_token_after"]
    again = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ours = prunelab.load(str(out), trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS, use_cache=False).logits,
                                   ours.model(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)


def test_eval_gradient_alignment_with_itself_is_one(tiny_dir):
    model = str(tiny_dir / "model")
    res = cli_inproc("eval", "--model", model, "--data", f"text:{tiny_dir / 'text.txt'}",
                     "--seqlen", "16", "--samples", "2", "--gradient-alignment", model, "--json",
                     str(tiny_dir / "ga.json"))
    assert res.returncode == 0, res.stderr
    assert "gradient alignment" in res.stdout
    got = json.loads((tiny_dir / "ga.json").read_text())
    assert got["gradient_alignment"] == pytest.approx(1.0, abs=1e-5)
