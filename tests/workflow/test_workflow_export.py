"""The recipe stage ``export``: a GGUF file of the stage's model in the run folder (reloads
to the model's logits), reused on resume, refused over a file it did not write, its
llama.cpp figures in ``served.md`` and the report; one-line errors for bad options."""

from __future__ import annotations

import json

import pytest
import torch

from prunelab import api
from prunelab.errors import ConfigError, OutputExistsError
from prunelab.workflow.recipe import load_recipe
from prunelab.workflow.run import run_recipe

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from checkpoint.test_gguf_export import bpe_tokenizer

    root = tmp_path_factory.mktemp("export")
    save_tiny_checkpoint("llama", root / "model")
    for f in (root / "model").glob("tokenizer*"):
        f.unlink()
    bpe_tokenizer().save_pretrained(root / "model")  # GGUF export writes byte-level BPE
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _recipe(tiny, stages: str) -> str:
    return (f"model: {tiny / 'model'}\ndata: text:{tiny / 'text.txt'}\n"
            f"test: text:{tiny / 'text.txt'}\nsamples: 4\nseqlen: 16\nbatch_size: 2\n"
            f"stages:\n{stages}")


def _logits(model, ids):
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("stages, words", [
    ("  - export: {path: model.bin}\n", ["stage 0 (export)", "path", ".gguf"]),
    ("  - export: {path: ../x.gguf}\n", ["stage 0 (export)", "path"]),
    ("  - export: {path: points/x.gguf}\n", ["stage 0 (export)", "path"]),
    ("  - export: {outtype: q3}\n", ["stage 0 (export)", "outtype", "q4_k_m"]),
    ("  - export: {llamacpp: false, speed: true}\n", ["stage 0 (export)", "speed"]),
    ("  - export: {samples: 0}\n", ["stage 0 (export)", "samples"]),
    ("  - export: {llamacpp: 'false'}\n", ["stage 0 (export)", "llamacpp"]),
    ("  - save: {path: out}\n  - export: {path: out/m.gguf}\n",
     ["stage 1 (export 'export-1')", "nested paths"]),
    ("  - export: {path: a.gguf}\n  - export: {path: a.gguf}\n",
     ["stage 1 (export 'export-1')", "same path"]),
])
def test_export_stage_errors_name_the_field(tiny, stages, words):
    with pytest.raises(ConfigError) as err:
        load_recipe(_recipe(tiny, stages))
    assert all(w in str(err.value) for w in words), str(err.value)


def test_export_stage_writes_the_stage_model_and_reuses_it(tiny, tmp_path):
    out = tmp_path / "run"
    text = _recipe(tiny, "  - prune: {id: w, method: wanda, sparsity: 0.5}\n"
                         "  - export: {id: gg, path: served/w.gguf, outtype: f32, "
                         "llamacpp: false, speed: false}\n"
                         "  - report: {}\n")
    run_recipe(load_recipe(text), out)
    gguf_file = out / "served" / "w.gguf"
    stage_model = api.load(str(out / "points" / "w" / "model"))
    back = api.load(str(gguf_file))
    ids = torch.tensor([[5, 40, 41, 66, 72, 101, 32, 116]])
    assert torch.equal(_logits(back.model, ids), _logits(stage_model.model, ids))
    res = json.loads((out / "points" / "gg" / "result.json").read_text())
    assert res["arch"] == "llama" and res["model"] == "w"
    served = (out / "served.md").read_text()
    assert "| gg | w | w.gguf | f32 | llama | 4 |" in served
    assert "Served in llama.cpp" in (out / "leaderboard.md").read_text()
    assert "Served in llama.cpp" in (out / "report.html").read_text()
    from prunelab.report.folder import build_report  # `prunelab report RUN` shows it too

    again = build_report(out, tmp_path / "again.html")
    assert "Served in llama.cpp" in again.read_text() and "w.gguf" in again.read_text()
    # resumed: the file verifies, nothing is rewritten
    before = gguf_file.stat().st_mtime_ns
    run_recipe(load_recipe(text), out)
    assert gguf_file.stat().st_mtime_ns == before
    # a changed file is written again
    gguf_file.write_bytes(gguf_file.read_bytes()[:-4] + b"\0\0\0\0")
    run_recipe(load_recipe(text), out)
    assert torch.equal(_logits(api.load(str(gguf_file)).model, ids),
                       _logits(stage_model.model, ids))


def test_export_stage_never_replaces_a_file_it_did_not_write(tiny, tmp_path):
    out = tmp_path / "run"
    run_recipe(load_recipe(_recipe(tiny, "  - export: {path: a.gguf, llamacpp: false, "
                                         "speed: false}\n")), out)
    (out / "mine.gguf").write_bytes(b"precious")  # the user's, in the run folder
    text = _recipe(tiny, "  - export: {path: mine.gguf, llamacpp: false, speed: false}\n")
    with pytest.raises(OutputExistsError, match="not a GGUF file this run exported"):
        run_recipe(load_recipe(text), out)
    assert (out / "mine.gguf").read_bytes() == b"precious"


def test_export_stage_scores_the_file_inside_llamacpp(tiny, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is built by scripts/test.sh")
    out = tmp_path / "run"
    text = _recipe(tiny, "  - export: {id: dense-gguf, path: dense.gguf, outtype: f32, "
                         "samples: 2, seqlen: 16, threads: 1}\n"
                         "  - prune: {id: d, method: depth, remove: 1}\n"
                         "  - export: {id: d-gguf, path: d.gguf, outtype: f32, samples: 2, "
                         "seqlen: 16, threads: 1}\n"
                         "  - report: {}\n")
    run_recipe(load_recipe(text), out)
    res = json.loads((out / "points" / "d-gguf" / "result.json").read_text())
    cpp = res["llamacpp"]
    assert cpp["windows"] == 2 and cpp["seqlen"] == 16
    assert cpp["perplexity_rel_diff"] < 1e-4, cpp
    assert cpp["speed"]["prompt_tokens"] == 512 and cpp["speed"]["gen_tokens_per_s"] > 0
    served = (out / "served.md").read_text()
    assert "| d-gguf | d | d.gguf | f32 | llama | 3 |" in served
    assert "x) |" in served  # speed ratios to the dense export


def test_check_refuses_before_running(tiny, tmp_path, monkeypatch):
    import sys

    from prunelab.workflow.run import check_runnable

    save_tiny_checkpoint("phi3", tmp_path / "g")
    text = _recipe(tiny, "  - prune: {method: wanda, sparsity: 0.5}\n"
                         "  - export: {llamacpp: false, speed: false}\n")
    phi3 = text.replace(str(tiny / "model"), str(tmp_path / "g"))
    with pytest.raises(ConfigError, match=r"stage 1 \(export\): GGUF export writes llama.* "
                       r"the recipe's model is phi3"):
        check_runnable(load_recipe(phi3))
    check_runnable(load_recipe(text))  # llama: fine without llama.cpp
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    for stage in ("  - export: {}\n", "  - export: {outtype: q8_0, llamacpp: false, "
                                      "speed: false}\n"):
        with pytest.raises(ConfigError, match=r"stage 0 \(export\): .*llama-cpp-python"):
            check_runnable(load_recipe(_recipe(tiny, stage)))
