"""The example recipes in recipes/: each parses and checks (fast, nothing runs); the
cheapest run end to end on a tiny model (their model and data swapped for tiny ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prunelab.workflow.recipe import load_recipe, parse_recipe
from prunelab.workflow.run import check_runnable, run_recipe

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
FAMILIES = {"depth", "sparsity", "width", "factor", "heal", "gates", "inference", "compose",
            "demo", "serve"}


def test_one_recipe_per_family():
    assert FAMILIES <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_example_recipe_is_valid(path):
    recipe = load_recipe(path)
    if any(st.kind == "export" for st in recipe.stages):
        pytest.importorskip("llama_cpp", reason="export stages score inside llama.cpp")
    check_runnable(recipe)
    assert recipe.model == "smollm2-135m"
    assert load_recipe(recipe.to_yaml()) == recipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _on_tiny(path: Path, tiny: Path):
    raw = yaml.safe_load(path.read_text())
    data = f"text:{tiny / 'text.txt'}"
    raw.update(model=str(tiny / "model"), data=data, test=data, samples=4, seqlen=16,
               batch_size=2)
    for st in raw["stages"]:
        (kind, opts), = st.items()
        if kind == "evaluate":
            opts.update(samples=4, seqlen=16, batch_size=2)
    return parse_recipe(raw)


@pytest.mark.parametrize("name", ["sparsity", "width", "factor"])
def test_cheap_recipes_run_on_a_tiny_model(name, tiny, tmp_path):
    recipe = _on_tiny(RECIPES[[p.stem for p in RECIPES].index(name)], tiny)
    man = run_recipe(recipe, tmp_path / name)
    assert {s["status"] for s in man["stages"]} == {"ran"}
    evals = [r for r in man["results"].values() if r["kind"] == "evaluate"]
    assert evals and all(r["metrics"]["perplexity"] > 1 for r in evals)
    assert (tmp_path / name / "model" / "manifest.json").is_file()
    assert evals[0]["metrics"]["nonzero_params"] < 39392  # the dense tiny model's count
