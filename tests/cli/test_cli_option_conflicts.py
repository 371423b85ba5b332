"""Conflicting, degenerate and broken options on the command line (issue 39, classes 3, 6,
7 and 10): each is one `error:` line, exit 2, no traceback and no output written; the
options that were broken now work."""

from __future__ import annotations

import json

import pytest
import transformers as tf

from tiny_models import SAMPLE_TEXT, cli_here, cli_inproc, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_conflicts")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def _small(tiny_dir) -> list[str]:
    return ["--model", str(tiny_dir / "model"), "--data", f"text:{tiny_dir / 'text.txt'}",
            "--samples", "4", "--seqlen", "16", "--batch-size", "2"]


EVAL = ["eval", "--samples", "2", "--seqlen", "32"]
CASES = {
    # --set never overrides a flag or a --budget silently
    "set over a flag": (["prune", "factor", "--method", "slicegpt", "--multiple", "4", "--set",
                         "multiple=8"], "--set multiple=... repeats --multiple"),
    "set over a budget": (["prune", "factor", "--method", "slicegpt", "--budget",
                           "remove-hidden:0.25", "--set", "ratio=0.5"],
                          "repeats --budget remove-hidden"),
    "set target over ratio": (["prune", "factor", "--method", "slicegpt", "--budget",
                               "remove-hidden:0.25", "--set", "target_params=0.8"],
                              "not both"),
    "set over sparsity": (["prune", "sparsity", "--budget", "remove-weights:0.5", "--set",
                           "sparsity=0.3"], "repeats --budget remove-weights"),
    "set over gates flag": (["prune", "gates", "--steps", "10", "--set", "steps=20"],
                            "repeats --steps"),
    "set over elastic seed": (["prune", "elastic", "--seed", "3", "--set", "seed=4"],
                              "repeats --seed"),
    # degenerate values
    "slicegpt ratio 0": (["prune", "factor", "--method", "slicegpt", "--budget",
                          "remove-hidden:0"], "not fewer than the dense"),
    "slicegpt larger model": (["prune", "factor", "--method", "slicegpt", "--multiple", "2",
                               "--budget", "remove-hidden:0.01"], "not fewer than the dense"),
    "shared-dict ratio 0": (["prune", "factor", "--method", "shared-dict", "--budget",
                             "remove-weights:0"], "ratio must be > 0"),
    "gates steps 0": (["prune", "gates", "--set", "steps=0"], "steps must be in [1"),
    "elastic t_end above t_start": (["prune", "elastic", "--t-start", "0.01"],
                                    "t_end 0.05 is above t_start 0.01"),
    "heal lr 0": (["heal", "--lr", "0"], "lr must be > 0"),
    "heal units without prune": (["heal", "--budget", "remove-units:0.3"],
                                 "applies to prune rep-lie only"),
    "heal blocks with rep-lie": (["heal", "--prune", "rep-lie", "--budget", "remove-blocks:2"],
                                 "applies to prune cascadeflow only"),
    "heal set over flag": (["heal", "--lr", "0.001", "--set", "lr=0.01"], "repeats --lr"),
    # presses
    "press-context without press": ([*EVAL, "--press-context", "0.5"],
                                    "--press-context applies with --press"),
    "press-context 0": ([*EVAL, "--press", "snapkv", "--press-context", "0"],
                        "leaves 0 of the 32 tokens"),
    "press-context 1": ([*EVAL, "--press", "snapkv", "--press-context", "1"],
                        "leaves 32 of the 32 tokens"),
    "press-context one token": ([*EVAL, "--press", "snapkv", "--press-context", "0.04"],
                                "leaves 1 of the 32 tokens"),
    "press-context one continuation token": ([*EVAL, "--press", "snapkv", "--press-context",
                                              "0.97"], "leaves 31 of the 32 tokens"),
    "press-continuation without press": ([*EVAL, "--press-continuation", "8"],
                                         "--press-continuation applies with --press"),
    "press-continuation and press-context": ([*EVAL, "--press", "snapkv", "--press-context",
                                              "0.5", "--press-continuation", "8"],
                                             "give --press-context or --press-continuation"),
    "press-continuation beyond the window": ([*EVAL, "--press", "snapkv",
                                              "--press-continuation", "31"],
                                             "leaves 1 of the 32 tokens"),
    "press-continuation 1": ([*EVAL, "--press", "snapkv", "--press-continuation", "1"],
                             "takes 2 to 30 tokens"),
    "press-continuation 0": ([*EVAL, "--press", "snapkv", "--press-continuation", "0"],
                             "--press-continuation must be"),
    "press-option ratio": ([*EVAL, "--press", "snapkv", "--press-option", "ratio=0.5"],
                           "--budget remove-cache:F"),
    "press-option over a press flag": ([*EVAL, "--press", "snapkv", "--press-window", "4",
                                        "--press-option", "window=2"],
                                       "--press-option window repeats --press-window"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_conflicting_or_degenerate_options_are_one_line(tiny_dir, case, capsys):
    args, expected = CASES[case]
    out = tiny_dir / f"out-{case.replace(' ', '-')}"
    head, rest = (args[:1], args[1:]) if args[0] in ("eval", "heal") else (args[:2], args[2:])
    common = _small(tiny_dir)
    if head == ["eval"]:
        common = common[:4]  # eval: --samples / --seqlen given in the case
    if head == ["heal"]:
        common = [*common[:4], "--train-samples", "4", "--seqlen", "16"]
    extra = [] if head == ["eval"] else ["--out", str(out)]
    res = cli_here(capsys, *head, *common, *rest, *extra)  # in this process
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert expected in lines[0]
    assert "Traceback" not in res.stderr and not out.exists()


def test_press_row_says_what_the_press_kept(tiny_dir):
    res = cli_inproc("--quiet", "eval", *_small(tiny_dir)[:4], "--samples", "2", "--seqlen", "32",
                     "--press", "snapkv", "--budget", "remove-cache:0.5", "--json",
                     str(tiny_dir / "press.json"))
    assert res.returncode == 0, res.stderr
    assert "on the first 16 tokens (50%) of each window; last window kept 8 of 16" in \
        " ".join(res.stdout.replace("│", " ").split())
    got = json.loads((tiny_dir / "press.json").read_text())["press"]
    assert got["last_prefill"]["prompt"] == 16 and got["last_prefill"]["kept"] == 8


def test_gates_removing_every_mlp_saves_and_reloads(tiny_dir):
    """At half the sublayer compute the cover takes every MLP branch of the tiny model: the
    config keeps its FFN width (no block has one left) instead of failing on a missing
    module after calibration."""
    out = tiny_dir / "gates-half"
    res = cli_inproc("--quiet", "prune", "gates", *_small(tiny_dir), "--budget",
                     "remove-compute:0.5", "--set", "steps=20", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rep = json.loads((out / "manifest.json").read_text())["report"]
    assert rep["achieved"] >= 0.5
    parts = {p for _, p in rep["removed_sublayers"]}
    config = json.loads((out / "config.json").read_text())
    if parts == {"mlp"} and len(rep["removed_sublayers"]) == 4:
        assert config["intermediate_size"] == 48
    ev = cli_inproc("--quiet", "eval", "--model", str(out), "--trust-remote-code", "--data",
                    f"text:{tiny_dir / 'text.txt'}", "--samples", "2", "--seqlen", "16")
    assert ev.returncode == 0, ev.stderr


def test_slicegpt_width_the_config_cannot_hold_is_rounded_and_said(tiny_dir):
    """26 heads-indivisible -> the nearest width Llama's config accepts, 24, with a warning;
    the checkpoint loads in plain transformers."""
    out = tiny_dir / "slice-26"
    res = cli_inproc("prune", "factor", *_small(tiny_dir), "--method", "slicegpt", "--rotation",
                     "global", "--multiple", "2", "--budget", "remove-hidden:0.1875", "--out",
                     str(out))
    assert res.returncode == 0, res.stderr
    assert "hidden size 26 cannot be a LlamaConfig" in res.stderr
    assert "slicing to the nearest one that can, 24" in res.stderr
    assert tf.AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 24
