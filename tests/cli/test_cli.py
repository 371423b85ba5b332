"""The CLI end to end on a tiny checkpoint, and its error paths (exit 2, one line)."""

from __future__ import annotations

import json

import pytest
import torch

import prunelab

from tiny_models import SAMPLE_TEXT, cli, cli_here, cli_inproc, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def test_info_and_eval_json(tiny_dir):
    res = cli_inproc("--quiet", "info", "--model", str(tiny_dir / "model"))
    assert res.returncode == 0, res.stderr
    assert "KV heads (GQA groups)" in res.stdout and "0-3" in res.stdout
    out = tiny_dir / "eval.json"
    args = ["--quiet", "eval", "--model", str(tiny_dir / "model"), "--data",
            f"text:{tiny_dir / 'text.txt'}", "--seqlen", "32", "--samples", "5",
            "--batch-size", "2", "--kl-reference", str(tiny_dir / "model"), "--json", str(out)]
    res = cli_inproc(*args)
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    for key in ("perplexity", "tokens", "seqlen", "samples", "params", "bytes",
                "kl_to_reference", "top1_agreement"):
        assert key in got
    assert (got["tokens"], got["seqlen"], got["samples"]) == (5 * 31, 32, 5)
    assert got["kl_to_reference"] == pytest.approx(0, abs=1e-6)
    api = prunelab.evaluate(prunelab.load(str(tiny_dir / "model")),
                            data=f"text:{tiny_dir / 'text.txt'}", seqlen=32, samples=5)
    assert got["perplexity"] == pytest.approx(api["perplexity"], rel=1e-6)
    # an existing --json is not overwritten
    res = cli_inproc(*args)
    assert res.returncode == 2 and "--overwrite" in res.stderr
    res = cli_inproc(*(args[:-2] + ["--speed", "--json", str(out), "--overwrite"]))
    assert res.returncode == 0, res.stderr
    got = json.loads(out.read_text())
    assert got["prefill_tokens_per_s"] > 0 and got["peak_memory_bytes"] > 0
    assert got["decode_tokens_per_s"] > 0


@pytest.fixture
def here(capsys):
    """``prunelab ARGS`` in this process (refusals: no interpreter started per call)."""
    return lambda *args, **kw: cli_here(capsys, *args, **kw)


def assert_one_line_error(res, fragment):
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert fragment in lines[0]


def test_error_paths(tiny_dir, here):
    assert_one_line_error(here("info", "--model", str(tiny_dir / "missing")), "does not exist")
    assert_one_line_error(here("eval", "--model", str(tiny_dir / "model"), "--data", "nope:x",
                              "--seqlen", "32"), "unknown data spec")
    assert_one_line_error(here("eval", "--model", str(tiny_dir / "model"), "--seqlen", "512"),
                          "beyond the 128 positions")
    assert_one_line_error(
        cli_inproc("eval", "--model", str(tiny_dir / "model"), "--data",
            f"text:{tiny_dir / 'text.txt'}", "--seqlen", "32", "--samples", "999"),
        "ask for --samples")
    assert_one_line_error(here("eval", "--model", str(tiny_dir / "model"), "--seqlen", "0"),
                          "seqlen")


def test_verbose_shows_traceback(tiny_dir):
    """A new interpreter (``python -m prunelab``): the other commands here run in-process."""
    res = cli("--verbose", "info", "--model", str(tiny_dir / "missing"))
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_probe_command(tiny_dir, here):
    out = tiny_dir / "probes"
    args = ["--quiet", "probe", "--model", str(tiny_dir / "model"), "--data",
            f"text:{tiny_dir / 'text.txt'}", "--probe", "block-influence,interchange,interval",
            "--pairs", "0-1,1-3", "--max-length", "2", "--samples", "4", "--seqlen", "16",
            "--batch-size", "2", "--out", str(out)]
    res = cli_inproc(*args)
    assert res.returncode == 0, res.stderr
    inter = json.loads((out / "interchange.json").read_text())
    assert [s["layers"] for s in inter["scores"]] == [[0, 1], [1, 3]]
    assert inter["data"]["samples"] == 4 and inter["block_evaluations"] == 4 + 3
    assert (out / "summary.md").is_file() and (out / "interval.png").is_file()
    assert_one_line_error(here(*args), "--overwrite")
    assert_one_line_error(here(*args[:6], "--probe", "nope", "--out", str(out)), "unknown probe")
    bad = [a if a != "0-1,1-3" else "0-x" for a in args]
    assert_one_line_error(here(*bad, "--overwrite"), "--pairs")


def test_prune_commands(tiny_dir, here):
    base = ["--quiet", "prune"]
    data = ["--model", str(tiny_dir / "model"), "--data", f"text:{tiny_dir / 'text.txt'}",
            "--samples", "4", "--seqlen", "16", "--batch-size", "2"]
    out = tiny_dir / "sparse"
    res = cli_inproc(*base, "sparsity", *data, "--method", "sparsegpt", "--pattern", "2:4",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    man = json.loads((out / "manifest.json").read_text())
    assert man["report"]["achieved_sparsity"] == pytest.approx(0.5, abs=0.01)
    assert man["operations"][-1]["operation"] == "prune-sparsity"
    assert_one_line_error(here(*base, "sparsity", *data, "--method", "sparsegpt", "--out",
                              str(out)), "--overwrite")
    assert_one_line_error(here(*base, "sparsity", *data, "--method", "wanda", "--pattern",
                              "5:4", "--out", str(tiny_dir / "x")), "5:4")
    # --offload (weights stay on the CPU, blocks visit --device in turn; here the device
    # is the CPU too): the same pruned weights as without it
    off = tiny_dir / "sparse-offload"
    res = cli_inproc(*base, "sparsity", *data, "--method", "sparsegpt", "--pattern", "2:4",
              "--offload", "--out", str(off))
    assert res.returncode == 0, res.stderr
    a, b = prunelab.load(str(out)), prunelab.load(str(off))
    for (na, ta), (nb, tb) in zip(a.model.state_dict().items(), b.model.state_dict().items(),
                                  strict=True):
        assert na == nb and torch.equal(ta, tb), na
    lm = prunelab.load(str(tiny_dir / "model"), offload=True)  # Python: the same switch
    runner = prunelab.BlockRunner(lm, torch.zeros(2, 4, dtype=torch.long))
    assert lm.offload_to == torch.device("cpu") and runner.offload
    assert runner.store_device == torch.device("cpu")
    depth = tiny_dir / "depth"
    res = cli_inproc(*base, "depth", *data, "--budget", "remove-blocks:1", "--recovery", "foldable",
              "--offload", "--out", str(depth))
    assert res.returncode == 0, res.stderr
    man = json.loads((depth / "manifest.json").read_text())
    assert len(man["report"]["removed_blocks"]) == 1 and man["num_blocks"] == 3
    assert_one_line_error(here(*base, "depth", *data, "--budget", "remove-blocks:9", "--out",
                              str(tiny_dir / "y")), "cannot remove")
