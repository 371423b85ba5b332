"""The served front (``prunelab front``): Pareto marking and targets on hand-made rows, the
grid and type parsers, and a whole front of a tiny Llama built inside llama.cpp, interrupted
and resumed, refused with other settings, discarded with --overwrite (nothing of the user's
removed), and asked for a target from the CLI."""

from __future__ import annotations

import json

import pytest

from prunelab.errors import ConfigError
from prunelab.workflow.front_grid import parse_grid, parse_point, parse_types, round_for
from prunelab.workflow.front_select import (
    best_for,
    dominated,
    mark_fronts,
    pareto_flags,
    parse_target,
)


def test_dominance_and_pareto_flags_by_hand():
    assert dominated((2, 2), (1, 2)) and dominated((2, 2), (1, 1))
    assert not dominated((2, 2), (2, 2)) and not dominated((1, 3), (2, 2))
    pts = [(100, 15.0), (90, 16.0), (95, 17.0), (80, 21.0), (80, 20.0), (90, 16.0), None,
           (70, float("nan"))]
    # (95, 17) loses to (90, 16); (80, 21) to (80, 20); ties keep both; unmeasured never
    assert pareto_flags(pts) == [True, True, False, False, True, True, False, False]


def _rows():
    return [{"file": "dense.f16", "mib": 258.0, "ppl": 15.0, "gen": 50.0},
            {"file": "dense.q4", "mib": 100.0, "ppl": 16.0, "gen": 70.0},
            {"file": "depth6.q4", "mib": 86.0, "ppl": 19.0, "gen": 85.0},
            {"file": "dense.q2", "mib": 84.0, "ppl": 21.0, "gen": 60.0},
            {"file": "depth6.q8", "mib": 110.0, "ppl": 18.0, "gen": 80.0}]


def test_fronts_and_targets_by_hand():
    rows = _rows()
    mark_fronts(rows)
    assert [r["front_size"] for r in rows] == [True, True, True, True, False]
    # speed: depth6.q4 fastest; dense.q4 70/16 undominated; depth6.q8 80/18 (nothing at
    # least as fast with a lower perplexity); dense.q2 slower and worse than dense.q4
    assert [r["front_speed"] for r in rows] == [True, True, True, False, True]
    assert best_for(rows, "size", 90)["file"] == "depth6.q4"
    assert best_for(rows, "size", 100)["file"] == "dense.q4"
    assert best_for(rows, "speed", 75)["file"] == "depth6.q8"
    assert best_for(rows, "ppl", 19.5)["file"] == "depth6.q4"  # the smallest that reaches it
    with pytest.raises(ConfigError, match="smallest is dense.q2 at 84.0 MiB"):
        best_for(rows, "size", 50)
    with pytest.raises(ConfigError, match="fastest is depth6.q4 at 85.0"):
        best_for(rows, "speed", 100)
    with pytest.raises(ConfigError, match="lowest is dense.f16 at 15.00"):
        best_for(rows, "ppl", 10)


@pytest.mark.parametrize("text", ["size", "size:", "size:x", "size:-1", "size:nan",
                                  "weight:3", "size:1:2", "size:0"])
def test_bad_targets_are_one_line(text):
    with pytest.raises(ConfigError, match="--target"):
        parse_target(text)


def test_grid_and_types():
    g = parse_grid("depth:6+heal,ffn:0.25,sublayers:2,slice:0.1,heads:0.34")
    assert [p.name for p in g] == ["depth6-heal", "ffn0.25", "sublayers2", "slice0.1",
                                   "heads0.34"]
    assert [p.heal for p in g] == [True, False, False, False, False]
    assert parse_grid("none") == () and len(parse_grid(None)) == 4
    assert g[1].config(256).round_to == 256 and g[3].config(256).multiple == 256
    for bad, why in (("depth:1.5", "whole number"), ("ffn:1.2", "fraction"),
                     ("width:3", "KIND one of"), ("depth:6+heal,depth:6+heal", "twice"),
                     ("depth:0", "whole number"), ("ffn:nan", "fraction")):
        with pytest.raises(ConfigError, match=why):
            parse_grid(bad)
    assert parse_types(None, imatrix=False)[-1] == "q2_k"
    assert "iq2_m" in parse_types(None, imatrix=True)
    with pytest.raises(ConfigError, match="unknown type 'q9_k'"):
        parse_types("q8_0,q9_k", True)
    with pytest.raises(ConfigError, match="needs an importance matrix"):
        parse_types("iq2_xxs", False)
    with pytest.raises(ConfigError, match="twice"):
        parse_types("q8_0,q8_0", True)
    assert round_for(("q8_0",)) == 32 and round_for(("q8_0", "q4_k_m")) == 256
    from prunelab.workflow.front_grid import check_points

    check_points(parse_grid("sublayers:2,slice:0.1"), "llama")
    with pytest.raises(ConfigError, match="sublayers:2: a gemma3 model"):
        check_points(parse_grid("depth:2,sublayers:2"), "gemma3")
    with pytest.raises(ConfigError, match="slice:0.1: a gemma3 model"):
        check_points(parse_grid("slice:0.1"), "gemma3")
    assert parse_point("depth:6").describe().startswith("6 blocks removed")


# ---------------------------------------------------------------- a whole tiny front


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is built by scripts/test.sh")
    from tiny_models import bpe_tokenizer, save_tiny_checkpoint

    root = tmp_path_factory.mktemp("front")
    ckpt = save_tiny_checkpoint("llama", root / "tiny")
    bpe_tokenizer().save_pretrained(ckpt)
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, then the cat sat. " * 200)
    return root, ckpt, text


def _settings(ckpt, text, **over):
    from prunelab.workflow.front import make_settings

    opts = dict(grid="depth:1+heal,ffn:0.25", types="f16,q8_0", grid_types="q8_0",
                imatrix=True, heal={"steps": 2, "batch_size": 2, "seqlen": 16},
                data=f"text:{text}", samples=4, seqlen=16, test=f"text:{text}", windows=2,
                test_seqlen=16, rounds=2, threads=1, prompt=16, gen=4)
    opts.update(over)
    return make_settings(str(ckpt), **opts)


def test_a_tiny_front_is_built_resumed_and_refused_with_other_settings(tiny, monkeypatch):
    from prunelab.workflow import front_run
    from prunelab.workflow.front import answer, build_front

    root, ckpt, text = tiny
    out = root / "f"
    calls = {"build": [], "file": []}
    real_build, real_file = front_run.FrontRun.build_model, front_run.FrontRun.make_file

    def build(self, name, point):
        calls["build"].append(name)
        return real_build(self, name, point)

    def make_file(self, name, kind):
        calls["file"].append(f"{name}.{kind}")
        if len(calls["file"]) == 3 and not calls.get("interrupted"):
            calls["interrupted"] = True
            raise KeyboardInterrupt  # Ctrl-C in the middle of the grid
        return real_file(self, name, kind)

    monkeypatch.setattr(front_run.FrontRun, "build_model", build)
    monkeypatch.setattr(front_run.FrontRun, "make_file", make_file)
    with pytest.raises(KeyboardInterrupt):
        build_front(_settings(ckpt, text), out)
    state = json.loads((out / "front.json").read_text())
    assert sorted(state["files"]) == ["dense.f16", "dense.q8_0"]  # the third never ended
    assert sorted(state["models"]) == ["dense", "depth1-heal"]
    first = dict(state["files"]["dense.q8_0"])
    calls["build"].clear()
    calls["file"].clear()
    front = build_front(_settings(ckpt, text), out)
    # nothing recorded was redone: the dense model, its two files, the healed model
    assert calls["build"] == ["ffn0.25"]
    assert calls["file"] == ["depth1-heal.q8_0", "ffn0.25.q8_0"]
    assert front["files"]["dense.q8_0"] == first
    assert len(front["speed"]["rounds"]) == 2
    assert sorted(front["files"]) == ["dense.f16", "dense.q8_0", "depth1-heal.q8_0",
                                      "ffn0.25.q8_0"]
    for rec in front["files"].values():
        assert (out / rec["path"]).is_file() and rec["ppl"] > 1
        assert rec["imatrix"] == (rec["type"] != "f16")
    assert front["models"]["depth1-heal"]["blocks"] == 3
    assert front["models"]["depth1-heal"]["heal"]["steps"] == 2
    rows = front["rows"]
    assert any(r["front_size"] for r in rows) and all(r["gen"] > 0 for r in rows)
    dense_q8 = next(r for r in rows if r["file"].endswith("dense.q8_0.gguf"))
    assert dense_q8["gen_x"] == 1.0
    healed = next(r for r in rows if r["file"].endswith("depth1-heal.q8_0.gguf"))
    assert "healed by distillation (LoRA, 2 steps), quantized q8_0" in healed["made"]
    for name in ("front.md", "front.csv", "front_size.png", "front_speed.png"):
        assert (out / name).is_file()
    best = answer(front, "size:10000")
    assert best["ppl"] == min(r["ppl"] for r in rows)
    # prunelab report shows the front: its table and both plots
    from prunelab.report.folder import build_report

    html = build_report(out).read_text()
    assert "Served front (llama.cpp)" in html and "depth1-heal.q8_0.gguf" in html
    assert "perplexity vs size (front_size.png)" in html
    assert "perplexity vs speed (front_speed.png)" in html
    # a finished front: a rerun does nothing
    calls["build"].clear()
    calls["file"].clear()
    build_front(_settings(ckpt, text), out)
    assert calls == {"build": [], "file": [], "interrupted": True}
    # other settings: refused, naming what differs
    with pytest.raises(ConfigError, match=r"other settings \(differs: windows\)"):
        build_front(_settings(ckpt, text, windows=3), out)


def test_a_slice_point_is_built_and_measured(tiny):
    from prunelab.workflow.front import build_front

    root, ckpt, text = tiny
    front = build_front(_settings(ckpt, text, grid="slice:0.25", types="f16",
                                  grid_types="f16", rounds=0), root / "slice")
    model = front["models"]["slice0.25"]
    assert model["prune"]["method"] == "slicegpt" and model["blocks"] == 4
    assert model["params"] < front["models"]["dense"]["params"]
    rows = {r["file"].split("/")[-1]: r for r in front["rows"]}
    assert rows["slice0.25.f16.gguf"]["ppl"] > 1
    assert "hidden size sliced (SliceGPT, global, tied head kept)" in \
        rows["slice0.25.f16.gguf"]["made"]


def test_a_heal_on_the_calibration_text_gets_the_dense_control(tiny):
    """loss=ce adapts to the calibration text's domain: the dense model fine-tuned the same
    way joins the ladder (every ladder type), so the pruned points are compared with it."""
    from prunelab.workflow.front import build_front
    from prunelab.workflow.front_state import adapts

    assert adapts({"loss": "ce", "steps": 2}) and not adapts({"loss": "kd", "steps": 2})
    assert adapts({"loss": "mix", "ce_weight": 1.0, "steps": 2})
    root, ckpt, text = tiny
    front = build_front(_settings(ckpt, text, grid="depth:1+heal",
                                  heal={"loss": "ce", "steps": 2, "batch_size": 2,
                                        "seqlen": 16}, rounds=1), root / "ce")
    assert sorted(front["models"]) == ["dense", "dense-heal", "depth1-heal"]
    assert front["models"]["dense-heal"]["heal"]["loss"] == "ce"
    assert front["models"]["dense-heal"]["blocks"] == 4
    assert sorted(front["files"]) == ["dense-heal.f16", "dense-heal.q8_0", "dense.f16",
                                      "dense.q8_0", "depth1-heal.q8_0"]
    control = next(r for r in front["rows"] if r["model"] == "dense-heal")
    assert "fine-tuned" in control["made"]
    pruned = next(r for r in front["rows"] if r["model"] == "depth1-heal")
    assert "healed by fine-tuning (ce; LoRA, 2 steps)" in pruned["made"]
    # without a heal on the grid there is nothing to control
    front = build_front(_settings(ckpt, text, grid="depth:1", heal={"loss": "ce"},
                                  rounds=0), root / "ce2")
    assert "dense-heal" not in front["models"]


def test_overwrite_removes_only_what_the_front_wrote(tiny):
    from prunelab.workflow.front import build_front

    root, ckpt, text = tiny
    out = root / "g"
    settings = _settings(ckpt, text, grid="none", types="q8_0", rounds=0)
    build_front(settings, out)
    (out / "notes.txt").write_text("mine")
    (out / "gguf" / "mine.bin").write_text("mine")
    (out / "gguf" / "mine.gguf").write_text("mine")  # a GGUF the front did not record
    build_front(_settings(ckpt, text, grid="none", types="q8_0", rounds=0, windows=3), out,
                overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "gguf" / "mine.bin").read_text() == "mine"
    assert (out / "gguf" / "mine.gguf").read_text() == "mine"
    assert json.loads((out / "front.json").read_text())["settings"]["windows"] == 3
    # a folder holding a front's names but no front state: someone else's, never replaced
    other = root / "other"
    other.mkdir()
    (other / "front.md").write_text("my notes")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="holds front.md that no front wrote"):
            build_front(settings, other, overwrite=overwrite)
    assert (other / "front.md").read_text() == "my notes"


def test_cli_builds_answers_and_refuses_in_one_line(tiny, capsys):
    from prunelab.cli import cli_main

    from tiny_models import save_tiny_checkpoint

    root, ckpt, text = tiny
    gpt2 = save_tiny_checkpoint("gpt2", root / "gpt2")  # a model llama.cpp's graphs lack
    out = root / "c"
    common = ["--model", str(ckpt), "--out", str(out), "--grid", "depth:1", "--types",
              "q8_0", "--data", f"text:{text}", "--samples", "4", "--seqlen", "16",
              "--test", f"text:{text}", "--windows", "2", "--test-seqlen", "16",
              "--rounds", "1", "--threads", "1", "--prompt", "16", "--gen", "4"]
    assert cli_main(["front", *common, "--target", "size:100000"]) == 0
    text_out = capsys.readouterr().out
    assert "best for size:100000:" in text_out and "served front" in text_out
    # asked again without --model: read from the folder
    assert cli_main(["front", "--out", str(out), "--target", "ppl:100000"]) == 0
    assert "best for ppl:100000: gguf/" in capsys.readouterr().out
    for args, msg in (
            (["front", "--out", str(out), "--target", "size:0.0001"], "smallest is"),
            (["front", "--out", str(out), "--target", "size"], "--target"),
            (["front", "--out", str(out), "--grid", "depth:1"], "give --model"),
            (["front", *common[:4], "--types", "q9_k"], "unknown type"),
            (["front", *common[:4], "--grid", "depth:x"], "grid point"),
            (["front", *common[:4], "--heal-set", "steps=-3"], "steps"),
            (["front", *common[:4], "--heal-set", "loss=ce", "--heal-set", "temperature=x"],
             "temperature"),
            (["front", *common[:4], "--no-imatrix", "--types", "iq2_xxs"], "importance"),
            (["front", "--out", str(root / "none"), "--target", "size:9"], "holds no front"),
            (["front", "--model", str(gpt2), "--out", str(root / "g2")],
             "gpt2 models are not written yet")):
        assert cli_main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], (args, err)
    assert not (root / "g2" / "gguf").exists()  # refused before any file was written
