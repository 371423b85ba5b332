"""Recipes: validation (stage + field named, unknown keys), resumable runs (finished stages
are not redone), composition, the recipe back from a checkpoint reproducing its tensors,
the generated schema in docs/workflow.md, and the `run` / `recipe` commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prunelab.errors import ConfigError
from prunelab.workflow.from_checkpoint import recipe_from_checkpoint
from prunelab.workflow.recipe import load_recipe, stage_hashes
from prunelab.workflow.run import run_recipe

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _recipe(tiny, stages: str, extra: str = "") -> str:
    return (f"model: {tiny / 'model'}\ndata: text:{tiny / 'text.txt'}\n"
            f"test: text:{tiny / 'text.txt'}\nsamples: 4\nseqlen: 16\nbatch_size: 2\n"
            f"{extra}stages:\n{stages}")


EVAL = "{seqlen: 16, samples: 4}"


@pytest.mark.parametrize("stages, words", [
    ("  - evaluate: {}\n  - prune: {method: wanda, sparsity: 1.5}\n",
     ["stage 1 (prune)", "sparsity", "1.5"]),
    ("  - prune: {id: d, method: depth, remove: 0}\n", ["stage 0 (prune 'd')", "remove"]),
    ("  - prune: {method: wanda, sparsity: 0.5, sparsty: 0.5}\n",
     ["stage 0 (prune)", "'sparsty'"]),
    ("  - evaluate: {seqlen: 16, speeed: true}\n", ["stage 0 (evaluate)", "'speeed'"]),
    ("  - heal: {loss: kd, stepz: 3}\n", ["stage 0 (heal)", "'stepz'"]),
    ("  - heal: {loss: kl}\n", ["stage 0 (heal)", "loss"]),
    ("  - probe: {probes: [{name: interchange, windw: 1}]}\n", ["stage 0 (probe)", "'windw'"]),
    ("  - prune: {method: wanda, sparsity: 0.5, calib: {sample: 3}}\n",
     ["stage 0 (prune)", "'sample'"]),
    ("  - prune: {method: nope}\n", ["stage 0 (prune)", "'nope'"]),
    ("  - trim: {}\n", ["stage 0", "'trim'"]),
    ("  - save: {from: later}\n  - prune: {id: later, method: wanda, sparsity: 0.5}\n",
     ["stage 0 (save)", "'later'"]),
    ("  - evaluate: {id: e}\n  - evaluate: {id: e}\n", ["stage 1", "'e'", "twice"]),
    ("  - evaluate: {press: {name: snapkv, ratio: 2.0}}\n", ["stage 0 (evaluate)", "ratio"]),
    ("  - evaluate: {press: {name: snapkv}, press_context: 0.5, press_continuation: 8}\n",
     ["stage 0 (evaluate)", "press_context or press_continuation"]),
    ("  - evaluate: {seqlen: 16, press: {name: snapkv}, press_continuation: 15}\n",
     ["stage 0 (evaluate)", "press_continuation 15 leaves 1 of the 16 tokens"]),
    ("  - evaluate: {seqlen: 16, press: {name: snapkv}, press_context: 1}\n",
     ["stage 0 (evaluate)", "press_context 1 leaves 16 of the 16 tokens"]),
])
def test_errors_name_the_stage_and_the_field(tiny, stages, words):
    with pytest.raises(ConfigError) as err:
        load_recipe(_recipe(tiny, stages))
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_evaluate_stage_reports_the_press_continuation():
    """The evaluate stage under a press: the continuation figures (the last
    press_continuation tokens, scored on the pressed cache) beside the whole window's."""
    from prunelab.data.batches import TokenBatches
    from prunelab.inference import StreamingLLM
    from prunelab.models.loading import wrap
    from prunelab.workflow.evaluate import evaluate_model
    from prunelab.workflow.stages import EvaluateStage

    from tiny_models import tiny_model, tiny_tokens

    lm, ref = wrap(tiny_model("llama")), wrap(tiny_model("llama"))
    ids = tiny_tokens(2, 24)
    data = TokenBatches(ids, spec="tiny", seqlen=24, samples=2, seed=0, mode="test",
                        total_windows=2, sha256="")
    opts = EvaluateStage(seqlen=24, samples=2, press=StreamingLLM(ratio=0.5),
                         press_continuation=8)
    res = evaluate_model(lm, opts, data=data, reference=ref)
    assert res["press"]["prompt"] == 16 and res["continuation"] == 8
    assert res["continuation_kl_to_reference"] > 0
    assert res["kl_to_reference"] * 24 == pytest.approx(res["continuation_kl_to_reference"] * 8,
                                                        rel=1e-4)
    zero = evaluate_model(lm, EvaluateStage(seqlen=24, samples=2, press=StreamingLLM(ratio=0.0)),
                          data=data, reference=ref)
    assert zero["continuation"] == 12 and zero["continuation_kl_to_reference"] == 0.0


def test_unknown_top_level_key_and_missing_model(tiny):
    with pytest.raises(ConfigError, match="no top-level key 'seeed'"):
        load_recipe(_recipe(tiny, "  - evaluate: {}\n", extra="seeed: 1\n"))
    with pytest.raises(ConfigError, match="model"):
        load_recipe({"stages": [{"evaluate": {}}]})
    with pytest.raises(ConfigError, match="seed"):
        load_recipe(_recipe(tiny, "  - evaluate: {}\n", extra="seed: -1\n"))


def test_typed_configs_and_sources(tiny):
    from prunelab.pruning import Depth, Wanda

    r = load_recipe(_recipe(tiny, "  - prune: {id: d, method: depth, remove: 1}\n"
                                  "  - prune: {method: wanda, sparsity: 0.5}\n"
                                  "  - evaluate: {}\n  - prune: {id: w, from: dense, "
                                  "method: width, ratio: 0.25}\n  - save: {from: prune-1}\n"))
    assert isinstance(r.stages[0].options.method, Depth)
    assert r.stages[1].options.method == Wanda(sparsity=0.5)
    assert r.inputs() == {"d": "dense", "prune-1": "d", "evaluate-2": "prune-1",
                          "w": "dense", "save-4": "prune-1"}
    again = load_recipe(r.to_yaml())  # round trip through YAML
    assert again == r and stage_hashes(again) == stage_hashes(r)


class _Count:
    def __init__(self, monkeypatch, module, name):
        self.calls = 0
        real = getattr(module, name)

        def wrapped(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapped)


def test_resume_skips_finished_stages(tiny, tmp_path, monkeypatch):
    from prunelab import api
    from prunelab.workflow import evaluate as ev

    text = _recipe(tiny, f"  - prune: {{id: d, method: depth, remove: 1, bootstrap: 0}}\n"
                         f"  - prune: {{method: wanda, sparsity: 0.5}}\n"
                         f"  - evaluate: {EVAL}\n  - save: {{}}\n")
    prunes = _Count(monkeypatch, api, "prune")
    real_eval = ev.evaluate_model
    state = {"fail": True, "evals": 0}

    def flaky(*a, **k):  # the first run is interrupted in the evaluate stage
        state["evals"] += 1
        if state["fail"]:
            raise KeyboardInterrupt
        return real_eval(*a, **k)
    monkeypatch.setattr(ev, "evaluate_model", flaky)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_recipe(text, out)
    assert prunes.calls == 2 and (out / "run.json").is_file()
    state["fail"] = False
    man = run_recipe(text, out)
    assert prunes.calls == 2  # both prune stages reused from their checkpoints
    assert [s["status"] for s in man["stages"]] == ["reused", "reused", "ran", "ran"]
    man = run_recipe(text, out)
    assert prunes.calls == 2 and state["evals"] == 2
    assert {s["status"] for s in man["stages"]} == {"reused"}
    # a changed option reruns that stage and what depends on it, nothing upstream
    changed = text.replace("sparsity: 0.5", "sparsity: 0.25")
    man = run_recipe(changed, out)
    assert prunes.calls == 3
    assert [s["status"] for s in man["stages"]] == ["reused", "ran", "ran", "ran"]
    recorded = json.loads((out / "run.json").read_text())
    assert [s["hash"] for s in recorded["stages"]] == list(
        stage_hashes(load_recipe(changed)).values())


def test_interrupted_probe_stage_keeps_finished_probes(tiny, tmp_path, monkeypatch):
    from prunelab import api

    text = _recipe(tiny, "  - probe: {id: p, probes: [block-influence, weight-redundancy]}\n")
    out = tmp_path / "run"
    first = run_recipe(text, out)
    (out / "points" / "p" / "result.json").unlink()  # as if stopped before it was recorded
    (out / "points" / "p" / "probes" / "weight-redundancy.json").unlink()
    seen = []
    real = api.probe

    def spy(lm, probes, *a, **k):
        seen.append(list(probes))
        return real(lm, probes, *a, **k)
    monkeypatch.setattr(api, "probe", spy)
    again = run_recipe(text, out)
    assert [[type(p).__name__ for p in x] for x in seen] == [["WeightRedundancy"]]
    assert again["results"]["p"]["probes"] == first["results"]["p"]["probes"]


def test_out_folder_rules(tiny, tmp_path):
    text = _recipe(tiny, f"  - evaluate: {EVAL}\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    from prunelab.errors import OutputExistsError
    with pytest.raises(OutputExistsError, match="not a prunelab run"):
        run_recipe(text, other)
    with pytest.raises(OutputExistsError):
        run_recipe(text, other, overwrite=True)  # never wipes a foreign folder
    assert (other / "keep.txt").is_file()


def _tensors_equal(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


def test_compose_then_recipe_from_checkpoint_reproduces_tensors(tiny, tmp_path):
    text = _recipe(tiny, "  - prune: {method: depth, remove: 1, recovery: foldable, "
                         "bootstrap: 0}\n  - prune: {method: wanda, sparsity: 0.5}\n"
                         "  - heal: {loss: kd, steps: 2, batch_size: 2, seqlen: 16, "
                         "eval_every: 0, lr: 0.001, quiet: true}\n"
                         f"  - evaluate: {EVAL}\n  - save: {{path: final}}\n")
    out = tmp_path / "a"
    run_recipe(text, out)
    man = json.loads((out / "final" / "manifest.json").read_text())
    ops = [op["operation"] for op in man["operations"]]
    assert ops == ["prune-depth", "prune-sparsity", "heal"]
    assert man["num_blocks"] == 3
    back = recipe_from_checkpoint(out / "final")
    assert [s.kind for s in back.stages] == ["prune", "prune", "heal", "save"]
    run_recipe(back, tmp_path / "b")
    _tensors_equal(out / "final", tmp_path / "b" / "final")


def test_recipe_from_a_cli_checkpoint(tiny, tmp_path):
    from prunelab import api
    from prunelab.pruning import Depth, Wanda

    lm = api.load(str(tiny / "model"), dtype="float32")
    data = f"text:{tiny / 'text.txt'}"
    rep = api.prune(lm, Depth(remove=1, bootstrap=0), data=data, seqlen=16, samples=4)
    api.prune(lm, Wanda(sparsity=0.5), data=data, seqlen=16, samples=4)
    api.save(lm, tmp_path / "ckpt", data=rep["data"], before=rep["size_before"])
    r = recipe_from_checkpoint(tmp_path / "ckpt")
    assert [s.options.method for s in r.stages[:2]] == [Depth(remove=1, bootstrap=0),
                                                       Wanda(sparsity=0.5)]
    run_recipe(r, tmp_path / "again")
    _tensors_equal(tmp_path / "ckpt", tmp_path / "again" / "model")
    with pytest.raises(ConfigError, match="manifest.json"):
        recipe_from_checkpoint(tiny / "model")


def test_schema_doc_is_generated():
    from prunelab.workflow.schema import doc_section, render_schema

    page = (ROOT / "docs" / "workflow.md").read_text()
    assert doc_section(page) == render_schema().strip("\n"), \
        "docs/workflow.md is stale: python -m prunelab.workflow.schema docs/workflow.md"
    assert "`wanda`" in page and "`sparsity`" in page and "`lora_rank`" in page


def test_run_and_recipe_commands(tiny, tmp_path, capsys):
    from prunelab.cli import cli_main

    good = tmp_path / "r.yaml"
    good.write_text(_recipe(tiny, f"  - prune: {{method: wanda, sparsity: 0.5}}\n"
                                  f"  - evaluate: {EVAL}\n  - save: {{}}\n  - report: {{}}\n"))
    assert cli_main(["-q", "run", str(good), "--out", str(tmp_path / "o"), "--check"]) == 0
    assert not (tmp_path / "o").exists()
    assert cli_main(["-q", "run", str(good), "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "leaderboard.md").is_file()
    assert (tmp_path / "o" / "leaderboard.csv").read_text().startswith("method,achieved")
    capsys.readouterr()
    assert cli_main(["recipe", "--from", str(tmp_path / "o" / "model")]) == 0
    assert load_recipe(capsys.readouterr().out).stages[0].options.method.sparsity == 0.5
    bad = tmp_path / "bad.yaml"
    bad.write_text(_recipe(tiny, "  - prune: {method: wanda, sparsity: 2}\n"))
    assert cli_main(["run", str(bad), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: stage 0 (prune)") and "sparsity" in err
    assert "\n" not in err and not (tmp_path / "x").exists()
    (tmp_path / "y.yaml").write_text("x")
    assert cli_main(["recipe", "--from", str(tmp_path / "o" / "model"), "--out",
                     str(tmp_path / "y.yaml")]) == 2
    assert "exists" in capsys.readouterr().err


def test_depth_reads_an_earlier_probe_stage(tiny, tmp_path):
    text = _recipe(tiny, "  - probe: {id: p, probes: [block-influence]}\n"
                         "  - prune: {id: d, method: depth, remove: 1, bootstrap: 0, "
                         "from_probe: points/p/probes/block-influence.json}\n")
    man = run_recipe(text, tmp_path / "o")
    first = man["results"]["p"]["probes"]["block-influence"]["ranking"][0]
    assert man["results"]["d"]["report"]["removed_blocks"] == [first]
    saved = json.loads((tmp_path / "o" / "points" / "d" / "model" / "manifest.json")
                       .read_text())
    path = saved["recipe"]["stages"][0]["prune"]["from_probe"]
    assert Path(path).is_absolute() and Path(path).is_file()
    bad = text.replace("points/p/", "points/q/")
    with pytest.raises(ConfigError, match="from_probe"):
        run_recipe(bad, tmp_path / "o2")


# ------------------------------------------------------------------ plugins
@pytest.fixture
def plugin_recipe(tiny, tmp_path):
    """A recipe folder with the one-file method of examples/ beside the recipe."""
    import shutil

    from prunelab import plugins
    from prunelab.pruning import METHODS

    shutil.copy(ROOT / "examples" / "one_file_method.py", tmp_path / "my_method.py")
    text = (f"model: {tiny / 'model'}\ndata: text:{tiny / 'text.txt'}\n"
            f"test: text:{tiny / 'text.txt'}\nsamples: 2\nseqlen: 16\nbatch_size: 2\n"
            "plugins: [my_method.py]\nstages:\n"
            "  - prune: {id: p0, method: input-power, power: 0.0, sparsity: 0.5}\n"
            "  - prune: {id: p4, from: dense, method: input-power, power: 4.0, sparsity: 0.5}\n")
    (tmp_path / "r.yaml").write_text(text)
    yield tmp_path
    METHODS.unregister("input-power")
    plugins.imported.clear()


def test_recipe_plugins_register_a_one_file_method(plugin_recipe, tmp_path):
    """A recipe names the user's method file; its method and option are then a stage's
    method and keys, the run uses the option, and the plugin's code is in the stage hash."""
    rec = load_recipe(plugin_recipe / "r.yaml")
    assert rec.plugins == (str((plugin_recipe / "my_method.py").resolve()),)
    assert [s.options.method.power for s in rec.stages] == [0.0, 4.0]
    before = stage_hashes(rec)
    run_recipe(rec, tmp_path / "out")
    w0 = load_file(str(tmp_path / "out" / "points" / "p0" / "model" / "model.safetensors"))
    w4 = load_file(str(tmp_path / "out" / "points" / "p4" / "model" / "model.safetensors"))
    key = next(k for k in w0 if k.endswith("mlp.up_proj.weight"))
    assert (w0[key] == 0).float().mean() == pytest.approx(0.5, abs=0.02)
    assert not torch.equal(w0[key] == 0, w4[key] == 0)  # the power changed the masks
    # editing the plugin's code changes every stage's hash (the rerun is not skipped)
    with open(plugin_recipe / "my_method.py", "a") as f:
        f.write("\n# changed\n")
    after = stage_hashes(load_recipe(plugin_recipe / "r.yaml"))
    assert all(after[k] != before[k] for k in before)


def test_recipe_without_plugins_keeps_its_hashes(tiny):
    """``plugins`` is left out of the top fields when not given (hashes as before)."""
    rec = load_recipe({"model": str(tiny / "model"),
                       "stages": [{"prune": {"method": "wanda", "sparsity": 0.5}}]})
    assert rec.plugins == () and "plugins" not in rec.top()


@pytest.mark.parametrize("plugins, message", [
    ("[missing.py]", "plugin .*missing.py: no such file"),
    ("[no_such_module_xyz]", "plugin no_such_module_xyz: no such module"),
    ("7", "plugins: a list of Python files or module names"),
    ("[[a.py]]", "plugins: a list of Python files or module names"),
])
def test_recipe_plugin_errors(tiny, tmp_path, plugins, message):
    (tmp_path / "r.yaml").write_text(f"model: {tiny / 'model'}\nplugins: {plugins}\nstages:\n"
                                     "  - prune: {method: wanda, sparsity: 0.5}\n")
    with pytest.raises(ConfigError, match=message):
        load_recipe(tmp_path / "r.yaml")


def test_evaluate_speed_is_measured_beside_the_dense_model(tiny, tmp_path):
    text = _recipe(tiny, "  - evaluate: {seqlen: 16, samples: 2, speed: true}\n"
                         "  - prune: {id: w, method: wanda, sparsity: 0.5}\n"
                         "  - evaluate: {seqlen: 16, samples: 2, speed: true, "
                         "speed_rounds: 2}\n"
                         "  - report: {}\n")
    man = run_recipe(load_recipe(text), tmp_path / "o")
    evals = [r for r in man["results"].values() if r["kind"] == "evaluate"]
    dense, pruned = (e["metrics"] for e in evals)
    assert "prefill_x_dense" not in dense  # the dense model is measured alone
    assert pruned["speed_rounds"] == 2 and isinstance(pruned["speed_noisy"], bool)
    lo, mid, hi = (pruned[f"decode_x_dense{s}"] for s in ("_min", "", "_max"))
    assert 0 < lo <= mid <= hi
    board = (tmp_path / "o" / "leaderboard.md").read_text()
    assert "prefill_x_dense" in board and f"{mid:.2f} [{lo:.2f}-{hi:.2f}]" in board


@pytest.mark.parametrize("split", ["press_continuation: 8", "press_context: 0.75", ""])
def test_an_evaluate_stage_with_a_press_reads_back_from_its_yaml(split):
    """to_yaml writes one way of splitting the windows (never both, which the loader
    refuses), and the recipe reads back equal."""
    from prunelab.workflow.recipe import load_recipe

    text = ("model: smollm2-135m\nstages:\n  - evaluate: {seqlen: 24, press: {name: snapkv}"
            + (", " + split if split else "") + "}\n")
    recipe = load_recipe(text)
    back = recipe.to_yaml()
    assert not ("press_context" in back and "press_continuation" in back), back
    assert load_recipe(back) == recipe
