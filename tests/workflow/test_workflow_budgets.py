"""`compare` at several budgets of one kind (the depth pruning curve / quality against
parameters kept): the rows equal those of the single-budget runs, the curves are a PNG,
bad budget lists are one-line errors; the leaderboard's zero-shot average."""

from __future__ import annotations

import csv

import pytest

from prunelab.errors import ConfigError
from prunelab.workflow.budget import Budget, parse_budgets
from prunelab.workflow.compare import compare

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

KEYS = ("perplexity", "kl_to_reference", "top1_agreement", "nonzero_params", "params",
        "achieved", "achieved_value", "blocks_removed", "operations")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("budgets")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 3)
    return root


def _kw(tiny):
    data = f"text:{tiny / 'text.txt'}"
    return dict(calib=data, test=data, samples=4, seqlen=16, batch_size=2, test_samples=4,
                test_seqlen=16, speed=False)


def test_parse_budget_lists():
    assert parse_budgets("remove-blocks:2,4,6") == [Budget("remove", "blocks", n)
                                                    for n in (2, 4, 6)]
    assert parse_budgets("keep-params:0.9, 0.8") == [Budget("keep", "params", 0.9),
                                                     Budget("keep", "params", 0.8)]
    assert parse_budgets("remove-weights:0.5") == [Budget("remove", "weights", 0.5)]


@pytest.mark.parametrize("text, words", [
    ("remove-blocks:2,x", ["'remove-blocks:2,x'", "'x' is not a number"]),
    ("remove-blocks:2,keep-params:0.8", ["one kind", "'keep-params:0.8'"]),
    ("keep-params:0.8,remove-weights:0.5", ["one kind"]),
    ("remove-blocks:2,4,2", ["remove-blocks:2 is listed twice"]),
    ("keep-params:0.8,0.80", ["keep-params:0.8 is listed twice"]),
    ("keep-params:0.9,1.5", ["a fraction <= 1 or a count", "1.5"]),
    ("remove-blocks:2,,4", ["empty value"]),
    ("depth:2,4", ["--budget takes"]),
])
def test_bad_budget_lists_are_one_line(text, words):
    with pytest.raises(ConfigError) as err:
        parse_budgets(text)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--budget")
    for w in words:
        assert w in msg, msg


def test_two_budgets_give_the_rows_of_two_single_runs(tiny, tmp_path):
    model, kw = str(tiny / "model"), _kw(tiny)
    both = compare(model, ["depth", "magnitude"], "remove-blocks:1,2", tmp_path / "both", **kw)
    singles = {n: compare(model, ["depth", "magnitude"], f"remove-blocks:{n}", tmp_path / f"b{n}",
                          **kw) for n in (1, 2)}
    got = [(r["method"], r.get("budget")) for r in both["rows"]]
    assert got == [("dense", None), ("depth", "remove-blocks:1"), ("depth", "remove-blocks:2"),
                   ("magnitude", "remove-blocks:1"), ("magnitude", "remove-blocks:2")]
    for row in both["rows"][1:]:
        n = int(row["budget"].split(":")[1])
        alone = {r["method"]: r for r in singles[n]["rows"]}[row["method"]]
        assert "budget" not in alone  # a single budget keeps today's rows
        for k in KEYS:
            assert row[k] == alone[k], (row["method"], n, k)
    assert both["rows"][0]["perplexity"] == singles[1]["dense"]["perplexity"]
    depth = {r["budget"]: r for r in both["rows"] if r["method"] == "depth"}
    assert depth["remove-blocks:1"]["blocks_removed"] == 1
    assert depth["remove-blocks:2"]["blocks_removed"] == 2
    with open(tmp_path / "both" / "leaderboard.csv") as fh:
        table = list(csv.DictReader(fh))
    assert list(table[0])[:3] == ["method", "budget", "achieved"]
    assert [(t["method"], t["budget"]) for t in table][1:] == got[1:]
    assert float(table[2]["perplexity"]) == pytest.approx(depth["remove-blocks:2"]["perplexity"])
    assert (tmp_path / "b1" / "leaderboard.csv").read_text().startswith("method,achieved,")
    board = (tmp_path / "both" / "leaderboard.md").read_text()
    assert "| depth | remove-blocks:2 | remove-blocks 2 |" in board
    png = tmp_path / "both" / "budget_curves.png"
    assert str(png) in both["plots"] and not (tmp_path / "b1" / "budget_curves.png").exists()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    pixels = imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.std() > 0.01
    # resumable: a rerun with one more budget runs only the new points
    point = tmp_path / "both" / "points" / "depth.remove-blocks=2" / "result.json"
    stamp = point.stat().st_mtime_ns
    more = compare(model, ["depth", "magnitude"], "remove-blocks:1,2,3", tmp_path / "both", **kw)
    assert (tmp_path / "both" / "points" / "depth.remove-blocks=2" / "result.json").stat() \
        .st_mtime_ns == stamp
    assert [r["perplexity"] for r in more["rows"][1:3]] == \
        [r["perplexity"] for r in both["rows"][1:3]]
    assert len(more["rows"]) == 7


def test_budget_list_cli_errors(tiny, tmp_path, capsys):
    from prunelab.cli import cli_main

    data = f"text:{tiny / 'text.txt'}"
    args = ["compare", "--model", str(tiny / "model"), "--calib", data, "--test", data,
            "--methods", "magnitude", "--no-speed"]
    for bad in ("remove-blocks:2,x", "remove-blocks:1,keep-params:0.5", "remove-blocks:1,1"):
        assert cli_main([*args, "--budget", bad, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --budget") and "\n" not in err, err
    assert not (tmp_path / "o").exists()


def test_zero_shot_average_column(tmp_path):
    from prunelab.workflow.leaderboard import csv_text, markdown, write_study

    rows = [{"method": "dense", "perplexity": 10.0,
             "tasks": {"arc_easy": {"acc": 0.50, "acc_norm": 0.60},
                       "winogrande": {"acc": 0.70, "acc_norm": 0.10}}},
            {"method": "wanda", "perplexity": 12.0,
             "tasks": {"arc_easy": {"acc": 0.40, "acc_norm": 0.45},
                       "winogrande": {"acc": 0.55, "acc_norm": 0.90}}},
            {"method": "none", "perplexity": 13.0}]
    table = list(csv.DictReader(csv_text(rows).splitlines()))
    header = list(table[0])
    assert header.index("zero-shot avg") == header.index("winogrande") + 1
    # arc_easy's headline is acc_norm, winogrande's acc (lm-eval's metric lists)
    assert float(table[0]["arc_easy"]) == 0.60 and float(table[0]["winogrande"]) == 0.70
    assert float(table[0]["zero-shot avg"]) == pytest.approx(0.65)
    assert float(table[1]["zero-shot avg"]) == pytest.approx(0.50)
    assert table[2]["zero-shot avg"] == ""
    md = markdown(rows)
    assert "| zero-shot avg |" in md and "| 0.6500 |" in md and "| 0.5000 |" in md
    assert "zero-shot avg" not in csv_text([{"method": "dense", "perplexity": 10.0}])
    write_study(tmp_path, rows, dense=rows[0])
    assert "zero-shot avg" in (tmp_path / "leaderboard.md").read_text()
