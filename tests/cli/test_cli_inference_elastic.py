"""`eval --press`, `generate --press`, `prune elastic` + `export`, and the taper allocations,
end to end on a tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from tiny_models import SAMPLE_TEXT, cli_here, cli_inproc, save_tiny_checkpoint, tiny_tokens

IDS = tiny_tokens(2, 12, seed=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_inference")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def _eval(tiny_dir, name, *extra):
    js = tiny_dir / f"{name}.json"
    res = cli_inproc("eval", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--seqlen", "32", "--samples", "2",
                     *extra, "--json", str(js), "--overwrite")
    assert res.returncode == 0, res.stderr
    return json.loads(js.read_text()), res.stdout


def test_eval_under_a_press(tiny_dir, capsys):
    plain, _ = _eval(tiny_dir, "plain")
    zero, shown = _eval(tiny_dir, "snap0", "--press", "snapkv", "--budget", "remove-cache:0")
    assert zero["perplexity"] == plain["perplexity"] and "press" in shown
    half, _ = _eval(tiny_dir, "snap5", "--press", "snapkv", "--budget", "remove-cache:0.5")
    assert half["press"]["name"] == "snapkv" and half["press"]["config"]["ratio"] == 0.5
    assert half["perplexity"] != plain["perplexity"]
    bad = cli_here(capsys, "eval", "--model", str(tiny_dir / "model"), "--data",
                   f"text:{tiny_dir / 'text.txt'}", "--seqlen", "32", "--budget",
                   "remove-cache:0.5")
    assert bad.returncode == 2 and "--press NAME" in bad.stderr


def test_eval_press_reports_the_continuation_beside_the_whole_window(tiny_dir):
    """The last --press-continuation tokens of each window run on the pressed cache; their
    figures come first in the table and beside the whole window's in the JSON. A press
    keeping everything has the dense continuation (KL 0, agreement 1)."""
    ref = ["--reference", str(tiny_dir / "model"), "--press-continuation", "8"]
    zero, _ = _eval(tiny_dir, "cont0", "--press", "snapkv", "--budget", "remove-cache:0", *ref)
    assert zero["continuation_kl_to_reference"] == 0.0
    assert zero["continuation_top1_agreement"] == 1.0
    assert zero["continuation"] == 8 and zero["continuation_tokens"] == 2 * 7
    assert (zero["press"]["prompt"], zero["press"]["continuation"]) == (24, 8)
    half, shown = _eval(tiny_dir, "cont5", "--press", "streaming-llm", "--budget",
                        "remove-cache:0.5", *ref)
    assert half["continuation_kl_to_reference"] > 0
    # the prefill runs in full: the window's KL is all in its continuation, diluted 32 / 8
    assert half["kl_to_reference"] * 32 == pytest.approx(
        half["continuation_kl_to_reference"] * 8, rel=1e-4)
    rows = [" ".join(line.replace("│", " ").split()) for line in shown.splitlines()]
    labels = [r for r in rows if "KL to reference" in r or "perplexity" in r]
    assert labels[0].startswith("continuation perplexity") and "the 8 tokens after each " \
        "pressed prompt of 24" in labels[0]
    assert labels[1].startswith("continuation KL to reference")
    assert any(r.startswith("perplexity (whole window)") for r in labels)
    assert any(r.startswith("KL to reference (whole window)") for r in labels)
    plain, shown = _eval(tiny_dir, "plain-ref", "--reference", str(tiny_dir / "model"))
    assert "continuation" not in plain and "whole window" not in shown


def test_the_decay_press_calibrates_on_the_commands_data_and_seqlen(tiny_dir):
    """It used to fit on 512-token wiki-vital windows whatever --data / --seqlen said, so on
    this 128-position model it failed naming a --seqlen 512 nobody gave."""
    got, _ = _eval(tiny_dir, "decay", "--press", "decay", "--budget", "remove-cache:0.5")
    assert got["press"]["name"] == "decay" and got["seqlen"] == 32
    assert got["perplexity"] > 0


def test_decay_windows_follow_the_data_and_the_positions():
    from types import SimpleNamespace

    from prunelab.cli.inspect_cmds import _decay_windows

    lm = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(
        max_position_embeddings=128)))
    assert _decay_windows(lm, "wiki-vital:test", 64) == ("wiki-vital:calib", 64)
    assert _decay_windows(lm, "wiki-vital", 512) == ("wiki-vital:calib", 128)
    assert _decay_windows(lm, "wikitext2:validation@/d", 32) == ("wikitext2:calib@/d", 32)
    assert _decay_windows(lm, "c4", 16) == ("c4:calib", 16)
    assert _decay_windows(lm, "text:/x/a.txt", 32) == ("text:/x/a.txt", 32)
    assert _decay_windows(lm, None, None) == ("wiki-vital:calib", 128)


def test_tasks_under_a_press_are_refused_up_front(tiny_dir, capsys):
    res = cli_here(capsys, "eval", "--model", str(tiny_dir / "model"), "--tasks", "arc_easy",
                   "--press", "snapkv", "--budget", "remove-cache:0.5")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: --tasks and --press do not combine (a press prunes the prompt of each "
        "perplexity window; task items are scored whole): run them as two commands"]


def test_generate_under_a_press(tiny_dir):
    plain = cli_inproc("generate", "--model", str(tiny_dir / "model"), "--prompt",
                       SAMPLE_TEXT[:60], "--max-new-tokens", "4")
    assert plain.returncode == 0, plain.stderr
    pressed = cli_inproc("generate", "--model", str(tiny_dir / "model"), "--prompt",
                         SAMPLE_TEXT[:60], "--max-new-tokens", "4", "--press", "streaming-llm",
                         "--budget", "remove-cache:0.5")
    assert pressed.returncode == 0, pressed.stderr
    assert "cache bytes" in pressed.stdout and "prompt tokens" in pressed.stdout


def test_prune_elastic_then_export_any_size(tiny_dir):
    ckpt = tiny_dir / "elastic"
    res = cli_inproc("--quiet", "prune", "elastic", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--samples", "4", "--seqlen", "16",
                     "--batch-size", "2", "--steps", "5", "--budget", "remove-units:0.2..0.5",
                     "--out", str(ckpt))
    assert res.returncode == 0, res.stderr
    assert (ckpt / "elastic.json").exists() and "units ranked" in res.stdout
    full = tiny_dir / "full"
    res = cli_inproc("export", "--model", str(ckpt), "--budget", "keep-units:1.0", "--out",
                     str(full))
    assert res.returncode == 0, res.stderr
    dense = tf.AutoModelForCausalLM.from_pretrained(tiny_dir / "model").eval()
    again = tf.AutoModelForCausalLM.from_pretrained(full, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, dense(input_ids=IDS).logits)
    half = tiny_dir / "half"
    res = cli_inproc("export", "--model", str(ckpt), "--budget", "keep-units:0.5", "--allocation",
                     "uniform", "--round-to", "4", "--out", str(half))
    assert res.returncode == 0, res.stderr and "plain transformers" in res.stdout
    small = tf.AutoModelForCausalLM.from_pretrained(half)  # uniform: no remote code
    assert small.config.intermediate_size < 48


def test_taper_allocations(tiny_dir):
    width = tiny_dir / "taper-width"
    res = cli_inproc("--quiet", "prune", "width", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--seqlen", "16", "--samples", "4", "--unit",
                     "ffn", "--budget", "remove-units:0.5", "--allocation", "taper",
                     "--taper-slope", "0.4", "--round-to", "1", "--out", str(width))
    assert res.returncode == 0, res.stderr
    widths = json.loads((width / "config.json").read_text())["prunelab_widths"]["linears"]
    ffn = [w["out"] for w in widths if w["module"].endswith("up_proj")]
    assert ffn == [34, 27, 21, 14]  # 48 channels, half kept on average, 0.4 more at block 0
    sparse = tiny_dir / "taper-sparse"
    res = cli_inproc("--quiet", "prune", "sparsity", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--seqlen", "16", "--samples", "4",
                     "--method", "wanda", "--budget", "remove-weights:0.5", "--allocation", "taper",
                     "--taper-slope", "0.2", "--out", str(sparse))
    assert res.returncode == 0, res.stderr
    per_block = json.loads((sparse / "manifest.json").read_text())["report"]["per_block_sparsity"]
    assert per_block == pytest.approx([0.4, 0.4 + 0.2 / 3, 0.6 - 0.2 / 3, 0.6])


@pytest.mark.slow
def test_eval_under_the_kl_fitted_decay_press(tiny_dir):
    """``--press decay --press-option fit=kl``: the blended press fitted end-to-end (on
    windows cut to the tiny model's 128 positions) is the one evaluated."""
    got, _ = _eval(tiny_dir, "decaykl", "--press", "decay", "--budget", "remove-cache:0.5",
                   "--press-option", "fit=kl")
    cfg = got["press"]["config"]
    assert got["press"]["name"] == "decay" and cfg["ratio"] == 0.5
    assert len(cfg["blend"]) == 2 * 4  # (lam, rho) per block of the 4-block tiny llama
    assert cfg["mix"] in (0.0, 0.5, 1.0) and torch.isfinite(torch.tensor(got["perplexity"]))



def test_press_needles_option_errors(tiny_dir):
    """``needles=N`` joins the ``fit=kl`` decay fit only; bad uses are one-line errors
    (the option parsing, then one command for the exit status)."""
    from prunelab.cli.inspect_cmds import _press_fit
    from prunelab.errors import ConfigError

    assert _press_fit("decay", ["fit=kl", "needles=3", "window=4"]) == ("kl", 3, ["window=4"])
    assert _press_fit("decay", None) == ("ls", 0, [])
    for name, opts, msg in (("snapkv", ["needles=1"], "applies to --press decay"),
                            ("decay", ["fit=kl", "needles=x"], "integer >= 0"),
                            ("decay", ["needles=-2"], "integer >= 0"),
                            ("decay", ["needles=nan"], "integer >= 0"),
                            ("decay", ["needles=1", "needles=2"], "given twice")):
        with pytest.raises(ConfigError, match=msg):
            _press_fit(name, opts)
    res = cli_inproc("eval", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--seqlen", "32", "--samples", "2",
                     "--press", "decay", "--budget", "remove-cache:0.5", "--press-option",
                     "needles=2")
    assert res.returncode == 2 and "fit=kl only" in res.stderr, res.stderr
    assert res.stderr.strip().startswith("error:") and "Traceback" not in res.stderr


@pytest.mark.slow
def test_press_needles_too_long_for_the_model(tiny_dir):
    """The tiny model's 128 positions leave no room for a needle, a question and a key."""
    res = cli_inproc("eval", "--model", str(tiny_dir / "model"), "--data",
                     f"text:{tiny_dir / 'text.txt'}", "--seqlen", "32", "--samples", "2",
                     "--press", "decay", "--budget", "remove-cache:0.5", "--press-option", "fit=kl",
                     "--press-option", "needles=1")
    assert res.returncode == 2 and "cannot hold the needle" in res.stderr, res.stderr
