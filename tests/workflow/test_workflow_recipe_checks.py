"""Recipes, third reliability round (issue 39): typed fields (a string is never a
boolean), ids and save paths that cannot escape or collide, reuse of a finished stage only
when its checkpoint verifies against the hashes recorded when it was written, a comparison
that refuses another model's points, and `run --check` catching what fails at once."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from prunelab.errors import ConfigError
from prunelab.workflow.recipe import load_recipe
from prunelab.workflow.run import run_recipe

from tiny_models import SAMPLE_TEXT, cli, cli_inproc, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _recipe(tiny, stages: str, extra: str = "") -> str:
    """A recipe on the tiny model; ``extra`` top-level lines replace the defaults (a key
    given twice is an error)."""
    given = {line.partition(":")[0] for line in extra.splitlines()}
    base = [f"model: {tiny / 'model'}", f"data: text:{tiny / 'text.txt'}",
            f"test: text:{tiny / 'text.txt'}", "samples: 4", "seqlen: 16", "batch_size: 2"]
    top = "".join(line + "\n" for line in base if line.partition(":")[0] not in given)
    return f"{top}{extra}stages:\n{stages}"


EVAL = "  - evaluate: {seqlen: 16, samples: 4}\n"


# ------------------------------------------------------------------ class 1: typed fields

@pytest.mark.parametrize("extra, stages, words", [
    ("trust_remote_code: 'false'\n", EVAL, ["trust_remote_code", "true or false", "'false'"]),
    ("trust_remote_code: 'no'\n", EVAL, ["trust_remote_code", "'no'"]),
    ("trust_remote_code: 1\n", EVAL, ["trust_remote_code", "true or false"]),
    ("seqlen: 16.0\n", EVAL, ["seqlen", "integer"]),
    ("dtype: 32\n", EVAL, ["dtype", "string"]),
    ("", "  - evaluate: {speed: 'false'}\n", ["stage 0 (evaluate)", "speed", "'false'"]),
    ("", "  - evaluate: {reference: 0}\n", ["stage 0 (evaluate)", "reference"]),
    ("", "  - evaluate: {tasks: 3}\n", ["stage 0 (evaluate)", "tasks"]),
    ("", "  - prune: {method: wanda, sparsity: '0.5'}\n", ["stage 0 (prune)", "sparsity"]),
    ("", "  - prune: {method: depth, remove: '1'}\n", ["stage 0 (prune)", "remove", "'1'"]),
    ("", "  - prune: {method: depth, remove: 1, bootstrap: 1.5}\n",
     ["stage 0 (prune)", "bootstrap"]),
    ("", "  - prune: {method: wanda, sparsity: 0.5, calib: {samples: '4'}}\n",
     ["stage 0 (prune)", "calib", "samples"]),
    ("", "  - heal: {full: 'false'}\n", ["stage 0 (heal)", "full", "'false'"]),
    ("", "  - heal: {steps: 2.5}\n", ["stage 0 (heal)", "steps"]),
    ("", "  - heal: {loss: kd, train_samples: '3'}\n", ["stage 0 (heal)", "train_samples"]),
    ("", "  - probe: {probes: [{name: interchange, window: '1'}]}\n",
     ["stage 0 (probe)", "interchange", "window"]),
    ("", "  - probe: {probes: 3}\n", ["stage 0 (probe)", "probes"]),
    ("", "  - evaluate: {press: {name: snapkv, ratio: '0.5'}}\n",
     ["stage 0 (evaluate)", "snapkv", "ratio"]),
    ("", "  - report: {title: 3}\n", ["stage 0 (report)", "title"]),
    ("", "  - prune: {method: depth, remove: 1, recovery: {name: lra, rank: '4'}}\n",
     ["stage 0 (prune)", "recovery 'lra'", "rank"]),
])
def test_recipe_fields_are_typed(tiny, extra, stages, words):
    with pytest.raises(ConfigError) as err:
        load_recipe(_recipe(tiny, stages, extra))
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_yaml_integers_are_read_as_floats(tiny):
    r = load_recipe(_recipe(tiny, "  - heal: {lr: 1, warmup: 0}\n"
                                  "  - evaluate: {press_context: 1}\n"))
    heal, ev = r.stages[0].options.config, r.stages[1].options
    assert (heal.lr, heal.warmup, ev.press_context) == (1.0, 0.0, 1.0)
    assert all(type(v) is float for v in (heal.lr, heal.warmup, ev.press_context))
    r = load_recipe(_recipe(tiny, EVAL, "trust_remote_code: false\n"))
    assert r.trust_remote_code is False


def test_string_false_never_runs_checkpoint_code(tiny, tmp_path):
    """A checkpoint with its own modeling file: 'false' as a string used to turn remote
    code on; now the recipe is refused before anything is imported."""
    model = tmp_path / "m"
    save_tiny_checkpoint("llama", model)
    flag = tmp_path / "ran.txt"
    (model / "modeling_prunelab.py").write_text(f"open({str(flag)!r}, 'w').write('x')\n")
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_prunelab.X"}
    (model / "config.json").write_text(json.dumps(cfg))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe(tiny, EVAL, "trust_remote_code: 'false'\n")
                      .replace(str(tiny / "model"), str(model)))
    r = cli("run", str(recipe), "--out", str(tmp_path / "out"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: trust_remote_code must be true or false, got 'false'"]
    assert not flag.exists() and not (tmp_path / "out").exists()


# ------------------------------------------------------------ class 2: ids and save paths

@pytest.mark.parametrize("stages, words", [
    ("  - evaluate: {id: '.'}\n", ["stage 0", "id", "'.'"]),
    ("  - prune: {id: '..', method: wanda, sparsity: 0.5}\n", ["stage 0", "id", "'..'"]),
    ("  - prune: {id: .hidden, method: wanda, sparsity: 0.5}\n", ["stage 0", "'.hidden'"]),
    ("  - prune: {id: a/b, method: wanda, sparsity: 0.5}\n", ["stage 0", "'a/b'"]),
    ("  - save: {path: .}\n", ["stage 0 (save)", "path", "'.'"]),
    ("  - save: {path: ./}\n", ["stage 0 (save)", "path"]),
    ("  - save: {path: ..}\n", ["stage 0 (save)", "path"]),
    ("  - save: {path: a/../b}\n", ["stage 0 (save)", "path"]),
    ("  - save: {path: /tmp/x}\n", ["stage 0 (save)", "path"]),
    ("  - save: {path: points/x}\n", ["stage 0 (save)", "points"]),
    ("  - save: {path: run.json}\n", ["stage 0 (save)", "run.json"]),
    ("  - save: {path: leaderboard.md}\n", ["stage 0 (save)", "leaderboard.md"]),
    ("  - save: {path: m}\n  - save: {path: ./m/}\n",
     ["stage 1 (save 'save-1')", "stage 0 (save 'save-0')", "same folder"]),
    ("  - save: {path: m}\n  - prune: {method: wanda, sparsity: 0.5}\n"
     "  - save: {path: m/inner}\n", ["stage 2 (save 'save-2')", "nested"]),
])
def test_ids_and_save_paths_cannot_escape_or_collide(tiny, stages, words):
    with pytest.raises(ConfigError) as err:
        load_recipe(_recipe(tiny, stages))
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_two_saves_with_one_path_refused_by_check(tiny, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe(tiny, "  - save: {path: m}\n"
                                    "  - prune: {method: wanda, sparsity: 0.5}\n"
                                    "  - save: {path: m}\n"))
    r = cli_inproc("run", str(recipe), "--out", str(tmp_path / "out"), "--check")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "same folder" in r.stderr


@pytest.mark.parametrize("content, words", [
    (b"model: m\nstages:\n  - null\n", ["stage 0", "one-key mapping"]),
    (b"model: m\nstages: [null]\n", ["stage 0"]),
    (b"model: \xff\xfe\nstages: []\n", ["not UTF-8"]),
    (b"\x80\x81", ["not UTF-8"]),
])
def test_null_stage_and_non_utf8_recipe_are_one_line(tmp_path, content, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    r = cli_inproc("run", str(recipe), "--out", str(tmp_path / "out"), "--check")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for w in words:
        assert w in lines[0]


# --------------------------------------------- class 3: reuse only what verifies its hashes

def test_a_stage_whose_checkpoint_changed_runs_again(tiny, tmp_path, capfd):
    text = _recipe(tiny, "  - prune: {id: p, method: wanda, sparsity: 0.5}\n"
                         "  - save: {path: final}\n")
    out = tmp_path / "run"
    man = run_recipe(text, out)
    weights = out / "points" / "p" / "model" / "model.safetensors"
    saved = out / "final" / "model.safetensors"
    want = load_file(str(saved))
    recorded = man["results"]["p"]["files"]["model.safetensors"]
    assert recorded["size"] == weights.stat().st_size and len(recorded["sha256"]) == 64
    assert {s["status"] for s in run_recipe(text, out)["stages"]} == {"reused"}

    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    man = run_recipe(text, out)
    assert [s["status"] for s in man["stages"]] == ["ran", "reused"]
    err = capfd.readouterr().err
    assert "stage 0 prune p: " in err and "model.safetensors changed size" in err
    assert "running it again" in err
    saved.unlink()  # the saved checkpoint's weights deleted
    man = run_recipe(text, out)
    assert [s["status"] for s in man["stages"]] == ["reused", "ran"]
    got = load_file(str(saved))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # same size, other bytes: the hash tells
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    man = run_recipe(text, out)
    assert [s["status"] for s in man["stages"]] == ["ran", "reused"]
    assert "sha256 differs" in capfd.readouterr().err
    # a result without recorded hashes (an older run) is not trusted either
    res = out / "points" / "p" / "result.json"
    body = json.loads(res.read_text())
    del body["files"]
    res.write_text(json.dumps(body))
    man = run_recipe(text, out)
    assert man["stages"][0]["status"] == "ran"


def test_compare_refuses_another_models_points(tiny, tmp_path):
    from prunelab.errors import ResumeMismatchError
    from prunelab.workflow.compare import compare

    data = f"text:{tiny / 'text.txt'}"
    kw = dict(calib=data, test=data, samples=4, seqlen=16, batch_size=2, test_samples=4,
              test_seqlen=16, speed=False)
    model = tmp_path / "m"
    save_tiny_checkpoint("llama", model, seed=0)
    out = tmp_path / "cmp"
    first = compare(str(model), ["wanda"], "remove-weights:0.5", out, **kw)
    again = compare(str(model), ["wanda"], "remove-weights:0.5", out, **kw)  # resumes
    assert again["rows"][1]["perplexity"] == first["rows"][1]["perplexity"]
    # the same path now holds another model: its points are not the first model's
    save_tiny_checkpoint("llama", model, seed=1)
    with pytest.raises(ResumeMismatchError, match="model weights") as err:
        compare(str(model), ["wanda"], "remove-weights:0.5", out, **kw)
    assert "\n" not in str(err.value) and "--overwrite" in str(err.value)
    with pytest.raises(ResumeMismatchError, match="options"):  # other settings
        compare(str(tiny / "model"), ["wanda"], "remove-weights:0.5", out,
                **{**kw, "seed": 3})
    fresh = compare(str(model), ["wanda"], "remove-weights:0.5", out, **kw, overwrite=True)
    assert fresh["dense"]["perplexity"] != first["dense"]["perplexity"]
    # the CLI says it in one line, exit 2
    save_tiny_checkpoint("llama", model, seed=2)
    r = cli_inproc("compare", "--model", str(model), "--methods", "wanda", "--budget",
                   "remove-weights:0.5", "--out", str(out), "--calib", data, "--test", data,
                   "--samples", "4", "--seqlen", "16", "--test-samples", "4", "--test-seqlen", "16",
                   "--batch-size", "2", "--no-speed")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "another model" in r.stderr


def test_compare_refuses_a_folder_of_points_that_is_no_comparison(tiny, tmp_path):
    from prunelab.errors import OutputExistsError
    from prunelab.workflow.compare import compare

    out = tmp_path / "run"
    run_recipe(_recipe(tiny, EVAL), out)  # a recipe run folder: points/, no compare.json
    data = f"text:{tiny / 'text.txt'}"
    with pytest.raises(OutputExistsError, match="compare.json"):
        compare(str(tiny / "model"), ["wanda"], "remove-weights:0.5", out, calib=data,
                test=data, samples=4, seqlen=16, batch_size=2, test_samples=4,
                test_seqlen=16, speed=False)


# ------------------------------------------------ class 5: run --check catches what fails

@pytest.mark.parametrize("extra, stages, line", [
    ("dtype: float8\n", EVAL,
     "dtype must be one of float32, bfloat16, float16 or auto, got 'float8'"),
    ("device: gpu\n", EVAL, "device must be cpu, cuda, cuda:N or auto, got 'gpu'"),
    ("", "  - prune: {method: wanda, sparsity: 0.5, calib: {data: 'bogus:x'}}\n",
     "stage 0 (prune): calib: unknown data spec 'bogus:x'"),
    ("", "  - evaluate: {seqlen: 16, samples: 4, data: 'text:/no/such.txt'}\n",
     "stage 0 (evaluate): data: data spec 'text:/no/such.txt': /no/such.txt does not exist"),
    ("", "  - prune: {id: depth6, method: depth, remove: 1, calib: {seqlen: 4096}}\n",
     "stage 0 (prune 'depth6'): calib seqlen 4096 is beyond the model's 128 positions"),
    ("", "  - evaluate: {}\n",
     "stage 0 (evaluate): seqlen 256 is beyond the model's 128 positions"),
    ("", "  - heal: {seqlen: 512}\n",
     "stage 0 (heal): seqlen 512 is beyond the model's 128 positions"),
    ("", "  - prune: {method: wanda, sparsity: 0.5, calib: {samples: 4000}}\n",
     "stage 0 (prune): calib windows: "),
    ("", "  - evaluate: {seqlen: 16, samples: 4, tasks: [no-such-task]}\n",
     "stage 0 (evaluate): tasks: unknown task 'no-such-task'"),
    ("", "  - prune: {method: depth, remove: 1, from_probe: points/p/probes/x.json}\n",
     "stage 0 (prune): from_probe points/p/probes/x.json is not written by an earlier probe"),
    ("", "  - prune: {method: depth, remove: 1, from_probe: /no/such/probe.json}\n",
     "stage 0 (prune): from_probe /no/such/probe.json does not exist"),
])
def test_check_catches_what_fails_at_once(tiny, tmp_path, extra, stages, line):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe(tiny, stages, extra))
    r = cli_inproc("run", str(recipe), "--out", str(tmp_path / "out"), "--check")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + line), lines
    assert "--" not in lines[0]  # recipe fields, never command-line flags
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, words", [
    ("/no/such/model", ["model: '/no/such/model' does not exist"]),
    ("no-such-model", ["model: 'no-such-model' is neither an embedded model"]),
])
def test_check_refuses_a_missing_model(tiny, tmp_path, model, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe(tiny, EVAL).replace(str(tiny / "model"), model))
    r = cli_inproc("run", str(recipe), "--out", str(tmp_path / "out"), "--check")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr


def test_check_accepts_a_probe_read_by_a_later_stage(tiny, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(_recipe(tiny, "  - probe: {id: p, probes: [block-influence]}\n"
                                    "  - prune: {method: depth, remove: 1, bootstrap: 0, "
                                    "from_probe: points/p/probes/block-influence.json}\n"
                                    + EVAL))
    r = cli_inproc("run", str(recipe), "--out", str(tmp_path / "out"), "--check")
    assert r.returncode == 0, r.stderr
    assert "3 stages, valid" in r.stdout


def test_run_time_errors_name_the_stage_and_the_field(tiny, tmp_path, monkeypatch):
    """An error only the run can find is one line naming the stage, in the recipe's words."""
    from prunelab import api
    from prunelab.errors import DataError

    def refuse(*a, **k):
        raise DataError("text:x gives only 3 windows of 16 tokens; ask for --samples 3 "
                        "or fewer (or a shorter --seqlen)")
    monkeypatch.setattr(api, "prune", refuse)
    with pytest.raises(DataError) as err:
        run_recipe(_recipe(tiny, "  - prune: {id: w, method: wanda, sparsity: 0.5}\n"),
                   tmp_path / "out")
    assert str(err.value) == ("stage 0 (prune 'w'): text:x gives only 3 windows of 16 "
                              "tokens; ask for samples 3 or fewer (or a shorter seqlen)")


def test_a_save_never_replaces_what_the_run_did_not_write(tiny, tmp_path):
    out = tmp_path / "run"
    text = _recipe(tiny, EVAL)
    run_recipe(text, out)  # a run folder
    mine = out / "final"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(Exception) as err:
        run_recipe(_recipe(tiny, EVAL + "  - save: {path: final}\n"), out)
    assert "is not a checkpoint this run saved" in str(err.value)
    assert (mine / "notes.txt").read_text() == "keep me"
