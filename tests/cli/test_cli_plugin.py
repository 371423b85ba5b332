"""A user's method is one file: ``--plugin FILE.py`` / ``$PRUNELAB_PLUGINS`` import it,
``prune sparsity --help`` lists it and its option (from the catalog, built in a child
process), and a run uses the option; a missing or broken plugin is a one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prunelab
from prunelab.cli import cli_main, plugins
from prunelab.pruning import METHODS

from tiny_models import SAMPLE_TEXT, cli_here, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "one_file_method.py"


def cli(*args, env=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="200", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"),
                                                    os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "prunelab", *args], capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.fixture
def forget_plugin():
    yield
    METHODS.unregister("input-power")
    plugins._loaded.clear()
    plugins.set_cli(None)


def test_help_lists_the_plugin_method_and_its_option(tmp_path):
    env = {"PRUNELAB_CACHE": str(tmp_path / "cache")}
    res = cli("--plugin", str(EXAMPLE), "prune", "sparsity", "--help", env=env)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "input-power" in text and "--power" in text
    assert "exponent p of the input norm" in text and "(default 1.0)" in text
    # without the plugin neither shows; with it through the environment both do
    res = cli("prune", "sparsity", "--help", env=env)
    assert res.returncode == 0 and "input-power" not in res.stdout and "--power" not in res.stdout
    res = cli("prune", "sparsity", "--help", env={**env, "PRUNELAB_PLUGINS": str(EXAMPLE)})
    assert res.returncode == 0 and "input-power" in res.stdout and "--power" in res.stdout


def test_a_run_uses_the_plugin_option(tmp_path, forget_plugin, capsys):
    save_tiny_checkpoint("llama", tmp_path / "model")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    common = ["--model", str(tmp_path / "model"), "--data", f"text:{tmp_path / 'text.txt'}",
              "--samples", "2", "--seqlen", "16", "--batch-size", "2", "--budget",
              "remove-weights:0.5"]
    for power in ("0", "4"):
        assert cli_main(["--quiet", "--plugin", str(EXAMPLE), "prune", "sparsity", *common,
                         "--method", "input-power", "--power", power,
                         "--out", str(tmp_path / f"p{power}")]) == 0
    capsys.readouterr()
    configs = [json.loads((tmp_path / f"p{p}" / "manifest.json").read_text())
               ["operations"][-1]["config"] for p in ("0", "4")]
    assert [c["name"] for c in configs] == ["input-power"] * 2
    assert [c["power"] for c in configs] == [0.0, 4.0]
    w0, w4 = (prunelab.load(str(tmp_path / f"p{p}")).model.model.layers[0].self_attn
              .q_proj.weight for p in ("0", "4"))
    dense = prunelab.load(str(tmp_path / "model")).model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(w0 != 0, w4 != 0)  # the exponent changed the mask
    # power 0 is magnitude pruning per row: the larger half of |W| of each row is kept
    kept = torch.zeros_like(dense, dtype=torch.bool)
    kept.scatter_(1, torch.topk(dense.abs(), dense.shape[1] // 2, dim=1).indices, True)
    assert torch.equal(w0 != 0, kept)
    # the method's option belongs to it only
    assert cli_main(["--plugin", str(EXAMPLE), "prune", "sparsity", *common, "--power", "2",
                     "--out", str(tmp_path / "x")]) == 2
    cap = capsys.readouterr()
    assert "error: --power does not apply to --method wanda" in cap.out + cap.err


def test_missing_or_broken_plugin_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """In this process (the plugin file and the environment are what the command reads),
    except the --help of a broken plugin: only a new interpreter (no torch yet) builds the
    catalog in a child, whose failure is then raised in the parent."""
    monkeypatch.delenv("PRUNELAB_PLUGINS", raising=False)
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path / "cache"))
    res = cli_here(capsys, "--plugin", str(tmp_path / "nope.py"), "prune", "sparsity",
                   "--help")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"error: --plugin {tmp_path / 'nope.py'}: "
                                               "no such file"]
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    for res in (cli_here(capsys, "--plugin", str(bad), "info", "--model", "x"),
                cli("--plugin", str(bad), "prune", "sparsity", "--help",
                    env={"PRUNELAB_CACHE": str(tmp_path / "cache")})):
        assert res.returncode == 2, res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: cannot load plugin {bad}")
        assert "RuntimeError: boom" in lines[0]
    monkeypatch.setenv("PRUNELAB_PLUGINS", "no_such_module_xyz")
    res = cli_here(capsys, "info", "--model", "x")
    assert res.returncode == 2
    assert res.stderr.strip() == "error: plugin no_such_module_xyz: no such module"


# ------------------------------------------------- a plugin never replaces a piece silently
TAKES_WANDA = """\
from dataclasses import dataclass
from prunelab.pruning import METHODS
from prunelab.pruning.sparsity.methods.wanda import Wanda

@METHODS.register("wanda"{replace})
@dataclass(frozen=True)
class MyWanda(Wanda):
    '''a plugin's wanda'''
"""
TAKES_SNAPKV = """\
from dataclasses import dataclass
from prunelab.inference import PRESSES, SnapKV

@PRESSES.register("snapkv")
@dataclass(frozen=True)
class MySnap(SnapKV):
    '''a plugin's snapkv'''
"""


def _one_error(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def test_a_plugin_taking_a_builtin_name_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PRUNELAB_PLUGINS", raising=False)
    wanda = tmp_path / "wanda_plugin.py"
    wanda.write_text(TAKES_WANDA.format(replace=""))
    snap = tmp_path / "snap_plugin.py"
    snap.write_text(TAKES_SNAPKV)
    builtin = METHODS.get("wanda")
    try:
        line = _one_error(cli_here(capsys, "--plugin", str(wanda), "prune", "sparsity",
                                   "--model", "m", "--out", str(tmp_path / "o")))
        assert line == (f"error: pruning method 'wanda' is already registered by "
                        f"prunelab.pruning.sparsity.methods.wanda.Wanda; {wanda} (MyWanda) "
                        "cannot take it (give it another name, or register('wanda', "
                        "replace=True) to replace it on purpose)")
        assert METHODS.get("wanda") is builtin
        line = _one_error(cli_here(capsys, "--plugin", str(snap), "eval", "--model", "m",
                                   "--press", "snapkv"))
        assert line.startswith("error: press 'snapkv' is already registered by "
                               "prunelab.inference.config.SnapKV; ") and f"{snap} (MySnap)" in line
    finally:
        plugins._loaded.clear()
        plugins.set_cli(None)
    assert not (tmp_path / "o").exists()
    line = _one_error(cli("--plugin", str(wanda), "prune", "sparsity", "--help",
                          env={"PRUNELAB_CACHE": str(tmp_path / "cache")}))
    assert "pruning method 'wanda' is already registered by" in line and "MyWanda" in line


def test_a_plugin_replacing_a_builtin_on_purpose_is_printed(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PRUNELAB_PLUGINS", raising=False)
    plugin = tmp_path / "wanda_plugin.py"
    plugin.write_text(TAKES_WANDA.format(replace=", replace=True"))
    save_tiny_checkpoint("llama", tmp_path / "model")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    builtin = METHODS.get("wanda")
    try:
        res = cli_here(capsys, "--plugin", str(plugin), "prune", "sparsity", "--model",
                       str(tmp_path / "model"), "--data", f"text:{tmp_path / 'text.txt'}",
                       "--samples", "2", "--seqlen", "16", "--batch-size", "2",
                       "--out", str(tmp_path / "o"))
        assert res.returncode == 0, res.stderr
        assert METHODS.get("wanda").__name__ == "MyWanda"
    finally:
        METHODS.register("wanda", replace=True)(builtin)
        plugins._loaded.clear()
        plugins.set_cli(None)
    assert (f"prunelab: warning: pruning method 'wanda' of "
            f"prunelab.pruning.sparsity.methods.wanda.Wanda is replaced by {plugin} (MyWanda)"
            in " ".join(res.stderr.split()))


@pytest.mark.parametrize("code", ["0", "3", "'bye'"])
def test_a_plugin_that_exits_at_import_is_a_one_line_error(tmp_path, monkeypatch, capsys,
                                                           code):
    monkeypatch.delenv("PRUNELAB_PLUGINS", raising=False)
    plugin = tmp_path / "exits.py"
    plugin.write_text(f"import sys\nsys.exit({code})\n")
    want = f"error: cannot load plugin {plugin}: it exits at import (SystemExit({code}))"
    try:
        res = cli_here(capsys, "--plugin", str(plugin), "prune", "sparsity", "--model", "m",
                       "--out", str(tmp_path / "o"))
    finally:
        plugins._loaded.clear()
        plugins.set_cli(None)
    assert _one_error(res) == want
    if code == "0":  # --help builds the catalog in a child first
        res = cli("--plugin", str(plugin), "prune", "sparsity", "--help",
                  env={"PRUNELAB_CACHE": str(tmp_path / "cache")})
        assert _one_error(res) == want
