"""Every user error of the CLI: exit 2, one ``error:`` line, no traceback, nothing written.

A table of bad invocations across all commands, run in-process through
:func:`prunelab.cli.cli_main` (a tiny checkpoint where a model must load); each case runs
in its own folder, whose files must be the same after the call as before. Plus the exit
codes that are not 2: ``--verbose`` (traceback, still exit 2), Ctrl-C (130, one line).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from prunelab.cli import cli_main

from tiny_models import SAMPLE_TEXT, char_tokenizer, save_tiny_checkpoint, tiny_model

M, T, O = "{m}", "{t}", "{o}"  # noqa: E741 (model, text, output)
PD = ["prune", "depth", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16"]
PS = ["prune", "sparsity", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16"]
PW = ["prune", "width", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16"]
PF = ["prune", "factor", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16"]
PR = ["probe", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16"]
SW = ["sweep", "depth", "--model", M, "--out", O, "--data", f"text:{T}", "--test",
      f"text:{T}", "--seqlen", "16", "--test-seqlen", "16"]
EV = ["eval", "--model", M, "--data", f"text:{T}", "--seqlen", "16"]
PG = ["prune", "gates", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16"]
PM = ["prune", "moe", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16"]
HE = ["heal", "--model", M, "--out", O, "--data", f"text:{T}", "--seqlen", "16",
      "--eval-data", f"text:{T}"]

CASES = {
    # usage errors (click): unknown commands and options, bad types, missing values
    "unknown command": ["bogus"],
    "unknown prune command": ["prune", "bogus"],
    "unknown sweep command": ["sweep", "bogus"],
    "unknown option": ["info", "--bogus"],
    "misspelt option": PS + ["--sparsty", "0.5"],
    "option without value": ["info", "--model"],
    "int option given text": EV + ["--samples", "abc"],
    "int option given float": EV + ["--batch-size", "1.5"],
    "float option given text": PW + ["--budget", "remove-units:x"],
    "probe without --probe": ["probe", "--out", O],
    "prune depth without --out": ["prune", "depth", "--budget", "remove-blocks:1"],
    "sweep without --out": ["sweep", "depth"],
    # sparsity options
    # budgets that would do nothing, or an empty one (an unset shell variable)
    "depth keep-params 1": PD + ["--budget", "keep-params:1.0"],
    "depth keep-params beyond the model": PD + ["--budget", "keep-params:1e12"],
    "sparsity remove-weights 0": PS + ["--budget", "remove-weights:0"],
    "sparsity remove-weights -0": PS + ["--budget", "remove-weights:-0"],
    "gates remove-compute 0": PG + ["--budget", "remove-compute:0"],
    "heal rep-lie remove-units 0": HE + ["--prune", "rep-lie", "--budget", "remove-units:0"],
    "empty budget, sparsity": PS + ["--budget", ""],
    "empty budget, depth": PD + ["--budget", " "],
    "empty budget, width": PW + ["--budget", ""],
    "empty budget, eval": EV + ["--budget", ""],
    "empty budget, compare": ["compare", "--model", M, "--methods", "wanda", "--out", O,
                              "--budget", ""],
    "sparsity above range": PS + ["--budget", "remove-weights:1.5"],
    "sparsity negative": PS + ["--budget", "remove-weights:-0.1"],
    "sparsity nan": PS + ["--budget", "remove-weights:nan"],
    "sparsity inf": PS + ["--budget", "remove-weights:inf"],
    "pattern N > M": PS + ["--pattern", "5:4"],
    "pattern garbage": PS + ["--pattern", "abc"],
    "pattern with sparsity": PS + ["--pattern", "2:4", "--budget", "remove-weights:0.7"],
    "pattern with owl": PS + ["--pattern", "2:4", "--allocation", "owl"],
    "unknown method": PS + ["--method", "bogus"],
    "unknown allocation": PS + ["--allocation", "bogus"],
    "owl m nan": PS + ["--allocation", "owl", "--owl-m", "nan"],
    "pals delta inf": PS + ["--allocation", "pals", "--pals-delta", "inf"],
    "unknown group": PS + ["--group", "bogus"],
    "unknown propagate": PS + ["--propagate", "bogus"],
    "unknown within-block": PS + ["--within-block", "bogus"],
    "sparsity batch size 0": PS + ["--batch-size", "0"],
    "sparsity batch size negative": PS + ["--batch-size", "-3"],
    "sparsity samples 0": PS + ["--samples", "0"],
    "sparsity selects nothing": PS + ["--targets", "no.such.*", "--samples", "2"],
    "method option for another method": PS + ["--method", "wanda", "--scope", "block"],
    "allocation option for another allocation": PS + ["--owl-m", "3"],
    "unknown --set key": PS + ["--set", "bogus=1"],
    "--set without =": PS + ["--set", "percdamp"],
    "--set value out of range": PS + ["--method", "sparsegpt", "--set", "percdamp=2"],
    "qk-wanda with a pattern": PS + ["--method", "qk-wanda", "--pattern", "2:4"],
    # depth options
    "depth without amount": PD,
    "depth remove 0": PD + ["--budget", "remove-blocks:0"],
    "depth remove negative": PD + ["--budget", "remove-blocks:-1"],
    "depth remove all": PD + ["--budget", "remove-blocks:4", "--samples", "2"],
    "depth target nan": PD + ["--budget", "keep-params:nan"],
    "depth target negative": PD + ["--budget", "keep-params:-5"],
    "depth blocks with remove": PD + ["--blocks", "1", "--budget", "remove-blocks:2"],
    "depth blocks garbage": PD + ["--blocks", "a,b"],
    "depth blocks out of range": PD + ["--blocks", "9", "--samples", "2"],
    "depth sublayers garbage": PD + ["--sublayers", "1:heads"],
    "depth sublayers with remove": PD + ["--sublayers", "1:mlp", "--budget", "remove-blocks:1"],
    "depth sublayers out of range": PD + ["--sublayers", "9:mlp", "--samples", "2"],
    "depth unknown strategy": PD + ["--budget", "remove-blocks:1", "--strategy", "bogus"],
    "depth unknown recovery": PD + ["--budget", "remove-blocks:1", "--recovery", "bogus"],
    "depth rank without lra": PD + ["--budget", "remove-blocks:1", "--recovery", "ghost", "--rank",
                                    "4"],
    "depth token-aware without bridge": PD + ["--budget", "remove-blocks:1", "--token-aware"],
    "depth beam width 0": PD + ["--budget", "remove-blocks:1", "--strategy", "beam",
                                "--beam-width", "0"],
    "depth beam score": PD + ["--budget", "remove-blocks:1", "--strategy", "beam", "--beam-score",
                              "x"],
    "depth unknown probe": PD + ["--budget", "remove-blocks:1", "--probe", "bogus"],
    "depth batch size 0": PD + ["--budget", "remove-blocks:1", "--batch-size", "0"],
    # width options
    "factor unknown method": PF + ["--method", "bogus"],
    "factor ratio nan": PF + ["--budget", "remove-hidden:nan"],
    "factor ratio too high": PF + ["--budget", "remove-hidden:1.0"],
    "factor target params above 1": PF + ["--budget", "keep-params:1.5"],
    "factor unknown rotation": PF + ["--rotation", "diagonal"],
    "factor unknown basis": PF + ["--basis", "svd"],
    "factor option of another method": PF + ["--method", "slicegpt", "--refit"],
    "factor multiple above hidden size": PF + ["--multiple", "4096"],
    "factor unreachable target": PF + ["--budget", "keep-params:0.01", "--multiple", "8"],
    "factor unknown --set key": PF + ["--set", "bogus=1"],
    "factor unknown widths": PF + ["--widths", "bogus"],
    "factor widths with one global rotation": PF + ["--rotation", "global", "--widths",
                                                    "spectrum"],
    "factor energy 0": PF + ["--widths", "energy", "--energy", "0"],
    "factor energy with target params": PF + ["--widths", "energy", "--budget", "keep-params:0.8"],
    "gates budget above 1": PG + ["--budget", "remove-compute:1.5"],
    "gates budget nan": PG + ["--budget", "nan"],
    "gates unknown select": PG + ["--select", "bogus"],
    "gates rounds 0": PG + ["--rounds", "0"],
    "gates unknown --set key": PG + ["--set", "bogus=1"],
    "moe experts 0": PM + ["--experts", "0"],
    "moe mass 0": PM + ["--budget", "keep-mass:0"],
    "moe mass inf": PM + ["--budget", "keep-mass:inf"],
    "moe unknown clustering": PM + ["--clustering", "bogus"],
    "moe more experts than channels": PM + ["--experts", "4096"],
    "heal unknown loss": HE + ["--loss", "bogus"],
    "heal steps 0": HE + ["--steps", "0"],
    "heal lr nan": HE + ["--lr", "nan"],
    "heal kd without a teacher": HE + ["--loss", "kd", "--steps", "2"],
    "heal unknown prune method": HE + ["--prune", "bogus"],
    "heal tokens and steps": HE + ["--tokens", "100", "--steps", "2"],
    "depth unknown granularity": PD + ["--budget", "remove-blocks:1", "--granularity", "bogus"],
    "depth sleb score on beam": PD + ["--budget", "remove-blocks:1", "--strategy", "beam",
                                      "--sleb-score",
                                      "kl"],
    "depth sleb resume on beam": PD + ["--budget", "remove-blocks:1", "--strategy", "beam",
                                       "--sleb-resume", "1"],
    "depth sleb resume malformed": PD + ["--budget", "remove-blocks:2", "--strategy", "sleb",
                                         "--sleb-resume", "1:bogus"],
    "depth sleb resume empty": PD + ["--budget", "remove-blocks:2", "--strategy", "sleb",
                                     "--sleb-resume", ","],
    "depth sleb resume negative": PD + ["--budget", "remove-blocks:2", "--strategy", "sleb",
                                        "--sleb-resume", "-1"],
    "depth sleb resume nan": PD + ["--budget", "remove-blocks:2", "--strategy", "sleb",
                                   "--sleb-resume", "nan"],
    "depth sleb resume mixed": PD + ["--budget", "remove-blocks:2", "--strategy", "sleb",
                                     "--sleb-resume", "1,2:mlp"],
    "depth bootstrap negative": PD + ["--budget", "remove-blocks:1", "--bootstrap", "-1"],
    "depth max instability above 1": PD + ["--budget", "remove-blocks:1", "--max-instability", "2"],
    "depth sublayer with boundary recovery": PD + ["--budget", "remove-blocks:1", "--granularity",
                                                   "sublayer", "--recovery", "boundary"],
    "probe bootstrap negative": PR + ["--probe", "leave-one-out", "--bootstrap", "-1"],
    "probe ablation on a probe without it": PR + ["--probe", "stable-rank", "--ablation",
                                                  "mean"],
    "probe unknown ablation": PR + ["--probe", "head-ablation", "--ablation", "bogus"],
    "probe gradient-flow steps 0": PR + ["--probe", "gradient-flow", "--steps", "0"],
    "width rep-lie option on wanda-sp": PW + ["--budget", "remove-units:0.2", "--rep-lie-steps",
                                              "3"],
    "width taper slope above 1": PW + ["--budget", "remove-units:0.2", "--allocation", "taper",
                                       "--taper-slope", "2"],
    "width taper slope without taper": PW + ["--budget", "remove-units:0.2", "--taper-slope",
                                             "0.2"],
    "sparsity taper slope nan": PS + ["--allocation", "taper", "--taper-slope", "nan"],
    "eval unknown press": EV + ["--press", "bogus"],
    "eval press ratio without a press": EV + ["--budget", "remove-cache:0.5"],
    "eval press ratio above 1": EV + ["--press", "snapkv", "--budget", "remove-cache:1.5"],
    "eval unknown press option": EV + ["--press", "h2o", "--press-option", "bogus=1"],
    "eval press fit on another press": EV + ["--press", "h2o", "--press-option", "fit=kl"],
    "eval press fit unknown": EV + ["--press", "decay", "--press-option", "fit=sgd"],
    "eval press fit twice": EV + ["--press", "decay", "--press-option", "fit=kl",
                                  "--press-option", "fit=ls"],
    "eval press fit kl with options": EV + ["--press", "decay", "--press-option", "fit=kl",
                                            "--press-option", "observe=16"],
    "generate max new tokens 0": ["generate", "--model", M, "--prompt", "hi",
                                  "--max-new-tokens", "0"],
    "generate prompt file missing": ["generate", "--model", M, "--prompt", "@/nonexistent"],
    "elastic bad budgets": ["prune", "elastic", "--model", M, "--out", O, "--data",
                            f"text:{T}", "--seqlen", "16", "--budget", "remove-units:0.1-0.6"],
    "elastic steps 0": ["prune", "elastic", "--model", M, "--out", O, "--data", f"text:{T}",
                        "--seqlen", "16", "--steps", "0"],
    "export keep 0": ["export", "--model", M, "--budget", "keep-units:0", "--out", O],
    "export unknown allocation": ["export", "--model", M, "--budget", "keep-units:0.5",
                                  "--allocation",
                                  "bogus", "--out", O],
    "factor multiple 0": PF + ["--multiple", "0"],
    "factor damping negative": PF + ["--damping", "-1"],
    "factor damping inf": PF + ["--damping", "inf"],
    "factor target params 0": PF + ["--budget", "keep-params:0"],
    "factor batch size 0": PF + ["--batch-size", "0"],
    "factor refine steps negative": PF + ["--basis", "sensitivity", "--set",
                                          "refine_steps=-1"],
    "svd-llm ratio 0": PF + ["--method", "svd-llm", "--budget", "remove-weights:0"],
    "shared-dict ratio nan": PF + ["--method", "shared-dict", "--budget", "remove-weights:nan"],
    "cactus rank nan": PS + ["--method", "cactus", "--rank", "nan"],
    "admm iterations negative": PS + ["--method", "admm", "--iterations", "-5"],
    "svd-llm ratio negative": PF + ["--method", "svd-llm", "--budget", "remove-weights:-0.2"],
    "svd-llm unknown allocation": PF + ["--method", "svd-llm", "--allocation", "bogus"],
    "basis-sharing group 0": PF + ["--method", "basis-sharing", "--group", "0"],
    "shared-dict unknown type": PF + ["--method", "shared-dict", "--types", "bogus"],
    "admm unknown mask source": PS + ["--method", "admm", "--mask-from", "bogus"],
    "admm iterations 0": PS + ["--method", "admm", "--iterations", "0"],
    "cactus negative rank": PS + ["--method", "cactus", "--rank", "-1"],
    "rank on wanda": PS + ["--method", "wanda", "--rank", "4"],
    "eval gradient alignment bad reference": ["eval", "--model", M, "--data", f"text:{T}",
                                              "--seqlen", "16", "--gradient-alignment",
                                              "/no/such/model"],
    "width ratio nan": PW + ["--budget", "remove-units:nan"],
    "width ratio too high": PW + ["--budget", "remove-units:0.99"],
    "width ratio and target": PW + ["--budget", "remove-units:0.2", "--budget", "keep-params:0.5"],
    "width unknown unit": PW + ["--unit", "bogus", "--budget", "remove-units:0.2"],
    "width unknown score": PW + ["--score", "bogus", "--budget", "remove-units:0.2"],
    "width unknown allocation": PW + ["--allocation", "bogus", "--budget", "remove-units:0.2"],
    "width joint uniform": PW + ["--unit", "joint", "--score", "cocurve", "--budget",
                                 "remove-units:0.2"],
    "width round-to 0": PW + ["--budget", "remove-units:0.2", "--round-to", "0"],
    "width damp negative": PW + ["--budget", "remove-units:0.2", "--damp", "-1"],
    "width batch size 0": PW + ["--budget", "remove-units:0.2", "--batch-size", "0"],
    # probe options
    "probe unknown": PR + ["--probe", "bogus"],
    "probe empty": PR + ["--probe", ","],
    "probe batch size 0": PR + ["--probe", "cka", "--batch-size", "0"],
    "probe max-remove negative": PR + ["--probe", "cka", "--max-remove", "-1"],
    "probe unknown states": PR + ["--probe", "cka", "--states", "bogus"],
    "probe bad pairs": PR + ["--probe", "interchange", "--pairs", "1-x"],
    "probe option no probe takes": PR + ["--probe", "cka", "--span", "2", "--samples", "2"],
    # sweep options
    "sweep batch size 0": SW + ["--batch-size", "0"],
    "sweep bad range": SW + ["--budget", "remove-blocks:x..y"],
    "sweep samples 0": SW + ["--samples", "0"],
    "sweep test samples 0": SW + ["--test-samples", "0"],
    # eval and info
    "eval batch size 0": EV + ["--batch-size", "0"],
    "eval unknown data": EV + ["--data", "bogus:thing"],
    "eval missing text file": EV + ["--data", "text:/nonexistent/x.txt"],
    "eval seqlen beyond positions": EV + ["--seqlen", "100000"],
    "eval missing model": ["eval", "--model", "/nonexistent/model"],
    "info missing model": ["info", "--model", "/nonexistent/model"],
    "info file not a model": ["info", "--model", T],
    "eval unknown dtype": EV + ["--dtype", "bogus"],
    "eval unknown device": EV + ["--device", "bogus"],
    "eval device beyond the machine": EV + ["--device", "cuda:7"],
    "eval malformed device": EV + ["--device", "cuda:x"],
    "eval data from a named pipe": EV[:-4] + ["--data", "text:{a}/fifo", "--seqlen", "16"],
    "eval data from a device": EV[:-4] + ["--data", "text:/dev/zero", "--seqlen", "16"],
    "eval tasks under a press": EV + ["--tasks", "arc_easy", "--press", "snapkv"],
    "eval missing reference": EV + ["--samples", "2", "--kl-reference", "/nonexistent/ref"],
    # corrupt or unsafe checkpoints (made in the assets fixture)
    "truncated safetensors": ["info", "--model", "{a}/truncated"],
    "config with extra blocks": ["eval", "--model", "{a}/extra_blocks", "--samples", "1"],
    "checkpoint missing a tensor": ["info", "--model", "{a}/missing_tensor"],
    "weights only as a pickle": ["info", "--model", "{a}/pickle_only"],
    "empty gguf": ["info", "--model", "{a}/empty.gguf"],
    # outputs
    "output name the file system cannot encode": PS + ["--out", "bad\udcffname"],
    "info json parent is a file": ["info", "--model", M, "--json", f"{T}/x.json"],
    "prune out is the current folder": PS + ["--out", "."],
    "probe out parent is a file": PR + ["--probe", "cka", "--out", f"{T}/sub"],
}

# cases whose output exists before the call (it must stay as it was)
EXISTING = {
    "info json exists": (["info", "--model", M, "--json", O], "file"),
    "info json over a folder with overwrite": (["info", "--model", M, "--json", O,
                                                "--overwrite"], "dir"),
    "prune out exists": (PD + ["--budget", "remove-blocks:1"], "dir"),
    "prune over a plain file with overwrite": (PW + ["--budget", "remove-units:0.2", "--overwrite"],
                                               "file"),
    "eval json exists": (EV + ["--json", O], "file"),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_errors")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 4)
    for name in ("truncated", "extra_blocks", "missing_tensor"):
        shutil.copytree(root / "model", root / name)
    weights = (root / "truncated" / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    cfg = json.loads((root / "model" / "config.json").read_text())
    (root / "extra_blocks" / "config.json").write_text(json.dumps(
        {**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 2}))
    tensors = load_file(root / "model" / "model.safetensors")
    tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, root / "missing_tensor" / "model.safetensors", metadata={"format": "pt"})
    _pickle_checkpoint(root / "pickle_only")
    (root / "empty.gguf").write_bytes(b"")
    os.mkfifo(root / "fifo")  # --data text:FIFO would block for ever on reading
    return root


def _pickle_checkpoint(path):
    model = tiny_model("llama")
    path.mkdir()
    model.config.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _run(argv, assets, case_dir, capsys):
    args = ["--quiet"] + [a.format(m=assets / "model", t=assets / "text.txt",
                                   o=case_dir / "out", a=assets) for a in argv]
    before = _snapshot(case_dir)
    cwd = os.getcwd()
    os.chdir(case_dir)
    try:
        code = cli_main(args)
    finally:
        os.chdir(cwd)
    cap = capsys.readouterr()
    return code, cap, before


def _assert_one_error_line(code, cap):
    text = cap.out + cap.err
    assert code == 2, text
    assert "Traceback" not in text, text
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert not cap.out.strip(), text


def test_the_table_is_large_enough():
    assert len(CASES) + len(EXISTING) >= 60


@pytest.mark.parametrize("name", list(CASES))
def test_bad_invocation(name, assets, tmp_path, capsys):
    code, cap, before = _run(CASES[name], assets, tmp_path, capsys)
    _assert_one_error_line(code, cap)
    assert _snapshot(tmp_path) == before  # nothing written, not even a temp or lock file


@pytest.mark.parametrize("name", list(EXISTING))
def test_existing_output_is_kept(name, assets, tmp_path, capsys):
    argv, kind = EXISTING[name]
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("mine\n")
    else:
        target.mkdir()
        (target / "notes.txt").write_text("mine\n")
    code, cap, before = _run(argv, assets, tmp_path, capsys)
    _assert_one_error_line(code, cap)
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith(".out.lock")} == before


def test_verbose_shows_the_traceback_and_still_exits_2(assets, tmp_path, capsys):
    code, cap, _ = _run(["--verbose"] + PD + ["--budget", "remove-blocks:0"], assets, tmp_path,
                        capsys)
    assert code == 2
    assert "Traceback" in cap.err
    assert cap.err.strip().splitlines()[-1].startswith("error: remove must be in")


def test_bare_group_prints_help_and_exits_0(assets, tmp_path, capsys):
    code, cap, _ = _run(["prune"], assets, tmp_path, capsys)
    assert code == 0
    assert "depth" in cap.out + cap.err and "sparsity" in cap.out + cap.err


_INTERRUPT = textwrap.dedent("""
    import os, signal, sys
    from prunelab.probes import context
    real = context.ProbeContext.ensure_cached
    def interrupted(self, *a, **k):
        real(self, *a, **k)
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, once the dense pass is cached
    context.ProbeContext.ensure_cached = interrupted
    from prunelab.cli import cli_main
    sys.exit(cli_main(sys.argv[1:]))
""")


def test_ctrl_c_exits_130_with_one_line(assets, tmp_path):
    out = tmp_path / "probes"
    args = [a.format(m=assets / "model", t=assets / "text.txt", o=out) for a in PR]
    proc = subprocess.run(
        [sys.executable, "-c", _INTERRUPT, "--quiet", *args, "--probe", "interchange",
         "--samples", "2"], capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.returncode == 130, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), proc.stderr
    assert "rerun the same command to resume" in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


_HOLDER = textwrap.dedent("""
    import sys, time
    from prunelab.io.lock import output_lock
    with output_lock(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.readline()
""")


def test_a_second_writer_of_the_same_output_is_refused(assets, tmp_path, capsys):
    """Another process holds the output's lock (it is writing it): the command is refused
    in one line before any work, and nothing is written."""
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, cap, before = _run(PD + ["--budget", "remove-blocks:1", "--samples", "2"], assets,
                                 tmp_path,
                                 capsys)
        _assert_one_error_line(code, cap)
        assert "another prunelab process is writing" in cap.err
        assert not out.exists()
    finally:
        holder.communicate("\n", timeout=60)
