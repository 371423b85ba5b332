"""`prunelab run --ray`: the stages of a recipe as Ray tasks on a local 2-CPU Ray, in the
order of their dependencies; same outputs as the serial run, a rerun skips finished stages.

One local Ray instance for the module (its start costs seconds)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prunelab.workflow.recipe import load_recipe
from prunelab.workflow.run import run_recipe
from prunelab.workflow.run_ray import stage_deps

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("runray")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


@pytest.fixture(scope="module")
def local_ray():
    from prunelab.workflow.ray_backend import connect

    started = connect("auto", num_cpus=2, object_store_memory=100 * 1024 * 1024)
    # both workers import the library while the test runs its serial run
    from prunelab.workflow.run_ray import warm_up

    pending = [ray.remote(num_cpus=1)(warm_up).remote() for _ in "ab"]
    yield
    ray.get(pending)
    if started:
        ray.shutdown()


HEAD = "samples: 4\nseqlen: 16\nbatch_size: 2\nstages:\n"
TIMING = ("eval_seconds", "eval_tokens_per_s")


def _recipe(tiny) -> str:
    return (f"model: {tiny / 'model'}\ndata: text:{tiny / 'text.txt'}\n"
            f"test: text:{tiny / 'text.txt'}\n{HEAD}"
            "  - prune: {id: d, from: dense, method: depth, remove: 1, bootstrap: 0}\n"
            "  - prune: {id: m, from: dense, method: magnitude, sparsity: 0.5}\n"
            "  - prune: {id: w, from: d, method: wanda, sparsity: 0.5}\n"
            "  - evaluate: {id: ew, from: w, seqlen: 16, samples: 4}\n"
            "  - save: {from: w, path: final}\n"
            "  - report: {}\n")


def test_stage_dependencies(tiny):
    deps = stage_deps(load_recipe(_recipe(tiny)))
    assert deps == {"d": [], "m": [], "w": ["d"], "ew": ["w"], "save-4": ["w"],
                    "report-5": ["d", "m", "w", "ew", "save-4"]}
    probed = load_recipe(f"model: x\n{HEAD}  - probe: {{id: p}}\n  - evaluate: {{id: e}}\n"
                         "  - prune: {id: d, method: depth, remove: 1, "
                         "from_probe: points/p/probes/block-influence.json}\n")
    assert stage_deps(probed) == {"p": [], "e": [], "d": ["p"]}


def _tensors(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow  # a local Ray start + worker imports: ~40-70 s
def test_ray_run_equals_serial_and_rerun_skips(tiny, tmp_path, local_ray, monkeypatch):
    text = _recipe(tiny)
    serial = run_recipe(text, tmp_path / "serial")
    start = time.time()
    on_ray = run_recipe(text, tmp_path / "ray", ray="auto")
    assert [s["status"] for s in on_ray["stages"]] == ["ran"] * 6
    assert [s["id"] for s in on_ray["stages"]] == [s["id"] for s in serial["stages"]]
    for sid in ("ew",):
        got, want = (dict(r["results"][sid]["metrics"]) for r in (on_ray, serial))
        for k in TIMING:
            assert got.pop(k) > 0 and want.pop(k) > 0
        assert got == want
    for sid in ("d", "w", "m"):
        a = _tensors(tmp_path / "serial" / "points" / sid / "model")
        b = _tensors(tmp_path / "ray" / "points" / sid / "model")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sid
    a, b = _tensors(tmp_path / "serial" / "final"), _tensors(tmp_path / "ray" / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("leaderboard.csv", "leaderboard.md"):
        assert (tmp_path / "ray" / name).read_text() == (tmp_path / "serial" / name).read_text()
    assert "| ew |" in (tmp_path / "ray" / "leaderboard.md").read_text()
    # the workers ran in other processes, in dependency order (a stage after what it reads)
    run = json.loads((tmp_path / "ray" / "run.json").read_text())
    assert [s["hash"] for s in run["stages"]] == [s["hash"] for s in serial["stages"]]
    mtime = {s: (tmp_path / "ray" / "points" / s / "result.json").stat().st_mtime
             for s in ("d", "w", "ew")}
    assert start <= mtime["d"] <= mtime["w"] <= mtime["ew"]
    # a rerun (on Ray or serially) finds every stage finished: nothing is recomputed
    from prunelab import api

    def boom(*a, **k):
        raise AssertionError("a finished stage was recomputed")
    monkeypatch.setattr(api, "prune", boom)
    again = run_recipe(text, tmp_path / "ray", ray="auto")
    assert {s["status"] for s in again["stages"]} == {"reused"}
    assert again["results"] == on_ray["results"]
    assert {s["status"] for s in run_recipe(text, tmp_path / "ray")["stages"]} == {"reused"}


def test_run_command_ray_flags(tiny, tmp_path, capsys):
    from prunelab.cli import cli_main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe(tiny))
    assert cli_main(["run", str(recipe), "--out", str(tmp_path / "o"),
                     "--cpus-per-point", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --cpus-per-point and --gpus-per-point need --ray"
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # a local Ray start + worker imports: ~40-70 s
def test_compare_at_two_budgets_on_ray_equals_serial(tiny, tmp_path, local_ray):
    from prunelab.workflow.compare import compare

    data = f"text:{tiny / 'text.txt'}"
    kw = dict(calib=data, test=data, samples=4, seqlen=16, batch_size=2, test_samples=4,
              test_seqlen=16, speed=False)
    model = str(tiny / "model")
    serial = compare(model, ["depth", "magnitude"], "remove-blocks:1,2", tmp_path / "s", **kw)
    on_ray = compare(model, ["depth", "magnitude"], "remove-blocks:1,2", tmp_path / "r", ray="auto",
                     **kw)
    keys = ("method", "budget", "achieved", "params", "nonzero_params", "perplexity",
            "kl_to_reference", "top1_agreement", "operations")
    assert [[r.get(k) for k in keys] for r in on_ray["rows"]] == \
        [[r.get(k) for k in keys] for r in serial["rows"]]
    assert len(serial["rows"]) == 5 and (tmp_path / "r" / "budget_curves.png").is_file()
