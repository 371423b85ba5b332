"""`compare`: methods at a matched budget on a tiny model; the leaderboard rows equal
separately-run evaluations, budgets convert and are reported as achieved, reruns skip."""

from __future__ import annotations

import csv
import json

import pytest

from prunelab.errors import ConfigError
from prunelab.workflow.budget import Budget, achieved, apply_budget, parse_budget, sizes
from prunelab.workflow.compare import compare

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _kw(tiny):
    data = f"text:{tiny / 'text.txt'}"
    return dict(calib=data, test=data, samples=4, seqlen=16, batch_size=2, test_samples=4,
                test_seqlen=16)


@pytest.mark.parametrize("text, budget", [("keep-params:0.8", Budget("keep", "params", 0.8)),
                                          ("remove-weights:0.5", Budget("remove", "weights", 0.5)),
                                          ("remove-blocks:2", Budget("remove", "blocks", 2))])
def test_parse_budget(text, budget):
    assert parse_budget(text) == budget and str(budget) == text


@pytest.mark.parametrize("text", ["keep-params:1.2", "remove-weights:0", "remove-blocks:0",
                                  "remove-blocks:1.5",
                                  "flops:0.5", "params"])
def test_bad_budgets(text):
    with pytest.raises(ConfigError, match="--budget"):
        parse_budget(text)


def test_budget_conversion_by_hand():
    from prunelab.pruning import Depth, Wanda, Width

    dense = {"params": 1000, "linear_params": 800, "block_params": 200, "blocks": 4}
    assert apply_budget(Wanda(sparsity=0.5), Budget("keep", "params", 0.8), dense).sparsity == 0.25
    assert apply_budget(Wanda(sparsity=0.5), Budget("remove", "blocks", 2), dense).sparsity == 0.5
    assert apply_budget(Depth(remove=1), Budget("remove", "blocks", 3), dense).remove == 3
    assert apply_budget(Depth(remove=1), Budget("keep", "params", 0.8), dense).remove == 1
    w = apply_budget(Width(ratio=0.1), Budget("remove", "weights", 0.5), dense)
    assert w.target_params == pytest.approx(0.6) and w.ratio is None
    after = {"params": 900, "nonzero_params": 700, "linear_params": 800,
             "nonzero_linear_params": 500, "block_params": 200, "blocks": 4}
    got = achieved(after, dense, Budget("remove", "weights", 0.5))
    assert got["achieved"] == "remove-weights 0.375" and got["params_kept"] == 0.7


def test_leaderboard_rows_match_separate_evaluations(tiny, tmp_path):
    from prunelab import api
    from prunelab.pruning import Magnitude, Wanda
    from prunelab.workflow.evaluate import evaluate_model
    from prunelab.workflow.stages import EvaluateStage

    out = tmp_path / "cmp"
    kw = _kw(tiny)
    res = compare(str(tiny / "model"), ["magnitude", "wanda"], "remove-weights:0.5", out,
                  speed=False, **kw)
    rows = {r["method"]: r for r in res["rows"]}
    assert list(rows) == ["dense", "magnitude", "wanda"]
    ref = api.load(str(tiny / "model"), dtype="float32")
    ev = EvaluateStage(samples=4, seqlen=16, batch_size=2)
    for name, cfg in (("magnitude", Magnitude(sparsity=0.5)), ("wanda", Wanda(sparsity=0.5))):
        lm = api.load(str(tiny / "model"), dtype="float32")
        api.prune(lm, cfg, data=kw["calib"], seqlen=16, samples=4, batch_size=2)
        alone = evaluate_model(lm, ev, data=kw["test"], reference=ref)
        for key in ("perplexity", "kl_to_reference", "top1_agreement", "nonzero_params"):
            assert rows[name][key] == pytest.approx(alone[key], rel=1e-9), (name, key)
        assert rows[name]["sparsity"] == pytest.approx(0.5, abs=0.01)
        assert rows[name]["achieved"].startswith("remove-weights 0.5")
    dense = api.evaluate(ref, data=kw["test"], seqlen=16, samples=4, batch_size=2)
    assert rows["dense"]["perplexity"] == pytest.approx(dense["perplexity"], rel=1e-9)
    with open(out / "leaderboard.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [t["method"] for t in table] == ["dense", "magnitude", "wanda"]
    assert float(table[2]["perplexity"]) == pytest.approx(rows["wanda"]["perplexity"])
    assert "| wanda |" in (out / "leaderboard.md").read_text()
    assert (out / "quality_vs_params.png").stat().st_size > 1000
    # a rerun reads every point back
    stamp = (out / "points" / "wanda" / "result.json").stat().st_mtime_ns
    again = compare(str(tiny / "model"), ["magnitude", "wanda"], "remove-weights:0.5", out,
                    speed=False, **kw)
    assert (out / "points" / "wanda" / "result.json").stat().st_mtime_ns == stamp
    assert [r["perplexity"] for r in again["rows"]] == [r["perplexity"] for r in res["rows"]]


def test_structured_methods_state_what_they_reach(tiny, tmp_path):
    out = tmp_path / "cmp"
    recipe = tmp_path / "depth-foldable.yaml"
    recipe.write_text("model: x\nstages:\n  - prune: {method: depth, remove: 1, "
                      "recovery: foldable, bootstrap: 0}\n")
    res = compare(str(tiny / "model"), ["width", str(recipe)], "remove-blocks:1", out, speed=True,
                  **_kw(tiny))
    rows = {r["method"]: r for r in res["rows"]}
    assert rows["depth-foldable"]["achieved"] == "remove-blocks 1"
    assert rows["depth-foldable"]["blocks_removed"] == 1
    dense = sizes(__import__("prunelab").api.load(str(tiny / "model"), dtype="float32"))
    want = 1 - dense["block_params"] / dense["params"]
    assert rows["width"]["blocks_removed"] == 0
    assert abs(rows["width"]["params_kept"] - want) < 0.05  # rounding of FFN widths
    assert rows["width"]["prefill_tokens_per_s"] > 0
    assert json.loads((out / "points" / "width" / "payload.json").read_text())["stages"][0][
        "prune"]["target_params"] == pytest.approx(want)


def test_compare_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="unknown pruning method 'nope'"):
        compare(str(tiny / "model"), ["nope"], "keep-params:0.8", tmp_path / "x", **_kw(tiny))
    with pytest.raises(ConfigError, match="takes no budget"):
        compare(str(tiny / "model"), ["prunepath"], "keep-params:0.8", tmp_path / "y", **_kw(tiny))


def test_compare_command(tiny, tmp_path, capsys):
    from prunelab.cli import cli_main

    data = f"text:{tiny / 'text.txt'}"
    args = ["compare", "--model", str(tiny / "model"), "--calib", data, "--test", data,
            "--samples", "4", "--seqlen", "16", "--test-samples", "4", "--test-seqlen", "16",
            "--batch-size", "2", "--no-speed"]
    assert cli_main([*args, "--methods", "magnitude", "--budget", "half",
                     "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --budget") and "\n" not in err
    assert not (tmp_path / "a").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x")
    assert cli_main([*args, "--methods", "magnitude", "--budget", "remove-weights:0.5",
                     "--out", str(other)]) == 2
    assert "not a prunelab run" in capsys.readouterr().err
    assert cli_main(["-q", *args, "--methods", "magnitude", "--budget", "remove-weights:0.5",
                     "--out", str(tmp_path / "b")]) == 0
    assert "| magnitude | remove-weights 0.5" in capsys.readouterr().out
