"""`prunelab recipe --from` on checkpoints written outside a recipe: a CLI chain depth ->
wanda -> `prunelab heal` becomes prune, prune, heal stages (the same HealConfig), and
running that recipe reproduces the tensors; an operation a recipe cannot express is one
line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prunelab.errors import ConfigError
from prunelab.workflow.from_checkpoint import recipe_from_checkpoint
from prunelab.workflow.recipe import load_recipe

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A tiny llama, pruned by the CLI (depth 1 block, then 50 % Wanda) and healed by
    `prunelab heal` (kd from the dense model, 2 steps)."""
    from prunelab.cli import cli_main

    root = tmp_path_factory.mktemp("fromckpt")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    data = f"text:{root / 'text.txt'}"
    calib = ["--data", data, "--samples", "4", "--seqlen", "16", "--dtype", "float32"]
    assert cli_main(["-q", "prune", "depth", "--model", str(root / "model"), "--budget",
                     "remove-blocks:1",
                     "--bootstrap", "0", *calib, "--out", str(root / "d")]) == 0
    assert cli_main(["-q", "prune", "sparsity", "--model", str(root / "d"), "--method",
                     "wanda", "--budget", "remove-weights:0.5", *calib, "--out",
                     str(root / "w")]) == 0
    assert cli_main(["-q", "heal", "--model", str(root / "w"), "--teacher",
                     str(root / "model"), "--loss", "kd", "--steps", "2", "--batch-size", "2",
                     "--seqlen", "16", "--eval-every", "0", "--lr", "0.001", "--data", data,
                     "--eval-data", data, "--eval-samples", "4", "--dtype", "float32",
                     "--out", str(root / "h")]) == 0
    return root


def _same_tensors(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


def test_healed_cli_chain_round_trips(chain, tmp_path, capsys):
    from prunelab.cli import cli_main
    from prunelab.heal import HealConfig
    from prunelab.pruning import Depth, Wanda

    assert cli_main(["recipe", "--from", str(chain / "h")]) == 0
    recipe = load_recipe(capsys.readouterr().out)
    assert [s.kind for s in recipe.stages] == ["prune", "prune", "heal", "save"]
    assert recipe.model == str(chain / "model")  # back through the source checkpoints
    assert recipe.stages[0].options.method == Depth(remove=1, bootstrap=0)
    assert recipe.stages[1].options.method == Wanda(sparsity=0.5)
    man = json.loads((chain / "h" / "manifest.json").read_text())
    heal = recipe.stages[2].options
    assert heal.config == HealConfig(**man["healing"]["config"])
    assert heal.config.steps == 2 and heal.teacher == "dense" and heal.eval_samples == 4
    assert heal.train_samples is None and recipe.data == f"text:{chain / 'text.txt'}"
    text = tmp_path / "r.yaml"
    text.write_text(recipe.to_yaml())
    assert cli_main(["-q", "run", str(text), "--out", str(tmp_path / "again")]) == 0
    _same_tensors(chain / "h", tmp_path / "again" / "model")
    # the middle checkpoint alone: its own recipe, without the heal
    middle = recipe_from_checkpoint(chain / "w")
    assert [s.kind for s in middle.stages] == ["prune", "prune", "save"]
    assert middle.stages[:2] == recipe.stages[:2]


def _forged(tmp_path, chain, **changes) -> Path:
    """A copy of the healed checkpoint's manifest with ``changes`` (config files only)."""
    folder = tmp_path / "forged"
    folder.mkdir(parents=True)
    man = json.loads((chain / "h" / "manifest.json").read_text())
    man.update(changes)
    (folder / "manifest.json").write_text(json.dumps(man))
    return folder


def test_inexpressible_operations_are_one_line(chain, tmp_path, capsys):
    from prunelab.cli import cli_main

    man = json.loads((chain / "h" / "manifest.json").read_text())
    odd = {"operation": "prune-width", "method": "rep-lie", "config": {"unit": "ffn"}}
    folder = _forged(tmp_path, chain, operations=[*man["operations"][:-1], odd,
                                                  man["operations"][-1]])
    assert cli_main(["recipe", "--from", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "'prune-width' (rep-lie)" in err and "cannot be turned into a recipe" in err
    no_data = {k: v for k, v in man["healing"].items() if k != "data"}
    with pytest.raises(ConfigError, match="operation 'heal' records no training data"):
        recipe_from_checkpoint(_forged(tmp_path / "b", chain, healing=no_data))
    bad = dict(man["operations"][0], config={"name": "wanda", "sparsity": 7})
    with pytest.raises(ConfigError, match="'prune-sparsity' \\(wanda\\) cannot be turned"):
        recipe_from_checkpoint(_forged(tmp_path / "c", chain,
                                       operations=[bad, *man["operations"][1:]]))


def test_cli_heal_of_a_recipe_checkpoint(chain, tmp_path):
    """`prunelab heal` (ce, no held-out data) on a recipe's checkpoint: the recipe it keeps,
    then the heal stage."""
    from prunelab.cli import cli_main
    from prunelab.workflow.run import run_recipe

    data = f"text:{chain / 'text.txt'}"
    run_recipe(f"model: {chain / 'model'}\ndata: {data}\ntest: {data}\nsamples: 4\n"
               "seqlen: 16\nbatch_size: 2\nstages:\n  - prune: {id: d, method: depth, "
               "remove: 1, bootstrap: 0}\n  - save: {}\n", tmp_path / "run")
    assert cli_main(["-q", "heal", "--model", str(tmp_path / "run" / "model"), "--loss", "ce",
                     "--steps", "2", "--batch-size", "2", "--seqlen", "16", "--eval-every",
                     "0", "--data", data, "--eval-data", "none", "--dtype", "float32",
                     "--out", str(tmp_path / "h")]) == 0
    recipe = recipe_from_checkpoint(tmp_path / "h")
    assert [(s.kind, s.id) for s in recipe.stages] == [("prune", "d"), ("heal", "heal-1"),
                                                        ("save", "save-2")]
    heal = recipe.stages[1].options
    assert heal.teacher == "none" and heal.eval_data == "none" and heal.data is None
    run_recipe(recipe, tmp_path / "again")
    _same_tensors(tmp_path / "h", tmp_path / "again" / "model")
