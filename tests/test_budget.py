"""``--budget KIND:VALUE``: parsing, the keep/remove turn-round, what each method's config
takes (declared on its fields), recipe stages, and the one-line errors of retired flags."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from prunelab.budget import (
    RETIRED,
    Budget,
    accepted_kinds,
    budget_fields,
    budget_options,
    parse_budget,
    parse_budget_list,
    parse_budget_span,
    retired_hint,
)
from prunelab.errors import ConfigError


@pytest.mark.parametrize("text, budget", [
    ("remove-blocks:6", Budget("remove", "blocks", 6)),
    ("keep-params:0.8", Budget("keep", "params", 0.8)),
    ("keep-params:90000000", Budget("keep", "params", 90000000)),
    ("remove-weights:0.5", Budget("remove", "weights", 0.5)),
    ("remove-cache:0", Budget("remove", "cache", 0.0)),
    (" keep-tokens : 0.7 ", Budget("keep", "tokens", 0.7)),
])
def test_parse(text, budget):
    got = parse_budget(text)
    assert got == budget
    assert parse_budget(str(got)) == got  # str() is the command-line spelling


@pytest.mark.parametrize("text, words", [
    ("6", ["KIND:VALUE"]),
    ("blocks:6", ["'blocks' is now spelled remove-blocks", "remove-blocks:6"]),
    ("params:0.8", ["keep-params:0.8"]),
    ("sparsity:0.5", ["remove-weights:0.5"]),
    ("drop-blocks:2", ["keep-Q or remove-Q"]),
    ("remove-layers:2", ["keep-Q or remove-Q", "blocks, params"]),
    ("remove-blocks:1.5", ["whole number"]),
    ("remove-blocks:x", ["'x' is not a number"]),
    ("remove-weights:1.5", ["fraction in [0, 1]"]),
    ("keep-params:1.5", ["a fraction <= 1 or a count"]),
    ("remove-units:nan", ["finite"]),
    ("remove-units:inf", ["finite"]),
    ("remove-units:-0.1", [">= 0"]),
])
def test_parse_errors_are_one_line(text, words):
    with pytest.raises(ConfigError) as err:
        parse_budget(text)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--budget")
    for w in words:
        assert w in msg, msg


def test_turn_round_by_hand():
    assert Budget("keep", "units", 0.8).to("remove") == Budget("remove", "units", 0.2)
    assert Budget("remove", "params", 0.25).to("keep") == Budget("keep", "params", 0.75)
    assert Budget("keep", "mass", 0.9).to("keep") == Budget("keep", "mass", 0.9)
    with pytest.raises(ConfigError, match="a count cannot be turned"):
        Budget("remove", "blocks", 2).to("keep")
    with pytest.raises(ConfigError, match="a count cannot be turned"):
        Budget("keep", "params", 90000000).to("remove")


def test_lists_ranges_and_spans():
    assert parse_budget_list("remove-blocks:1..3") == [Budget("remove", "blocks", n)
                                                       for n in (1, 2, 3)]
    assert parse_budget_list("keep-params:0.9,0.8") == [Budget("keep", "params", 0.9),
                                                        Budget("keep", "params", 0.8)]
    assert parse_budget_span("remove-units:0.1..0.6") == (Budget("remove", "units", 0.1),
                                                          Budget("remove", "units", 0.6))
    for bad in ("keep-params:0.9..0.8x", "remove-blocks:3..1", "keep-params:0.5..0.9"):
        with pytest.raises(ConfigError):
            parse_budget_list(bad)
    for bad in ("remove-units:0.6..0.1", "remove-units:0.3", "remove-units:0.3..0.3"):
        with pytest.raises(ConfigError):
            parse_budget_span(bad)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    remove: int | None = dataclasses.field(default=None, metadata={"budget": "remove-blocks"})
    target: float | None = dataclasses.field(default=None, metadata={"budget": "keep-params"})
    low: float = dataclasses.field(default=0.1, metadata={"budget": "remove-units",
                                                          "span": "low"})
    high: float = dataclasses.field(default=0.6, metadata={"budget": "remove-units",
                                                           "span": "high"})
    other: int = 3


def test_budget_options_on_a_config():
    assert budget_fields(_Cfg) == {"remove": "remove-blocks", "target": "keep-params",
                                   "low": "remove-units", "high": "remove-units"}
    assert accepted_kinds(_Cfg) == ["remove-blocks:N", "keep-params:F", "remove-params:F",
                                    "remove-units:LOW..HIGH"]
    assert budget_options(_Cfg, None, "x") == {}
    assert budget_options(_Cfg, "remove-blocks:2", "x") == {"remove": 2}
    assert budget_options(_Cfg, "remove-params:0.3", "x") == {"target": 0.7}
    assert budget_options(_Cfg, "keep-units:0.5..0.9", "x") == {"low": 0.1, "high": 0.5}
    with pytest.raises(ConfigError, match=r"^x takes --budget remove-blocks:N, keep-params:F"):
        budget_options(_Cfg, "remove-weights:0.5", "x")
    with pytest.raises(ConfigError, match="given twice"):
        budget_options(_Cfg, ["remove-blocks:2", "remove-blocks:3"], "x")
    with pytest.raises(ConfigError, match="a range"):
        budget_options(_Cfg, "remove-blocks:1..3", "x")


def test_every_method_declares_its_budget():
    """Each registered pruning method, the heal config and every press say which budget
    sets which field, and the field exists with a numeric type."""
    from prunelab.inference import PRESSES
    from prunelab.pruning import METHODS
    from prunelab.train.config import HealConfig

    classes = [METHODS.get(n) for n in METHODS.names()] + [HealConfig] + \
        [PRESSES.get(n) for n in PRESSES.names()]
    for cls in classes:
        fields = budget_fields(cls)
        assert fields, f"{cls.__name__} declares no budget field"
        kinds = accepted_kinds(cls)
        assert kinds and all(":" in k for k in kinds)
    from prunelab.pruning import Depth, Wanda, Width

    assert budget_options(Depth, "remove-blocks:3", "d") == {"remove": 3}
    assert budget_options(Width, "keep-units:0.75", "w") == {"ratio": 0.25}
    assert budget_options(Wanda, "keep-weights:0.4", "s") == {"sparsity": 0.6}
    assert budget_options(HealConfig, ["remove-units:0.3", "remove-blocks:2"], "h") == \
        {"ratio": 0.3, "remove": 2}


def test_recipe_stage_budget():
    from prunelab.workflow.stages import parse_stage

    st = parse_stage(0, {"prune": {"method": "depth", "budget": "remove-blocks:2"}})
    assert st.options.method.remove == 2
    st = parse_stage(0, {"prune": {"method": "wanda", "budget": "keep-weights:0.3"}})
    assert st.options.method.sparsity == pytest.approx(0.7)
    same = parse_stage(0, {"prune": {"method": "wanda", "sparsity": 0.7}})
    assert same.options.method == st.options.method
    for raw, words in (({"method": "wanda", "budget": "remove-weights:0.5", "sparsity": 0.5},
                        "give the figure once"),
                       ({"method": "wanda", "budget": "remove-blocks:2"}, "takes --budget"),
                       ({"method": "wanda", "budget": 0.5}, "must be a string")):
        with pytest.raises(ConfigError, match=words):
            parse_stage(0, {"prune": raw})


def test_retired_hints():
    assert retired_hint("prune width", "--ratio") == "--budget remove-units:F"
    assert "remove-hidden" in retired_hint("prune factor", "--ratio")
    assert retired_hint("prune depth", "--remove") == RETIRED["--remove"]
    assert retired_hint("prune depth", "--probe") is None


@pytest.mark.parametrize("argv, new", [
    (["prune", "depth", "--remove", "2"], "--budget remove-blocks:N"),
    (["prune", "depth", "--target-params=0.8"], "--budget keep-params:F"),
    (["prune", "width", "--ratio", "0.2"], "--budget remove-units:F"),
    (["prune", "sparsity", "--sparsity", "0.5"], "--budget remove-weights:F"),
    (["prune", "tokens", "--keep", "0.5"], "--budget keep-tokens:F"),
    (["sweep", "depth", "--remove", "1..3"], "--budget remove-blocks:N..M"),
])
def test_retired_flag_is_one_line_error(argv, new, tmp_path, capsys):
    """Exit 2, one line naming the new spelling, nothing written (in this process; the
    real entry point is checked once below)."""
    from tiny_models import cli_here

    out = tmp_path / "out"
    res = cli_here(capsys, *argv, "--out", str(out))
    assert res.returncode == 2, res.stderr
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and new in lines[0], lines
    assert "Traceback" not in res.stderr and not out.exists()


def test_retired_flag_in_a_child_process(tmp_path):
    """The same through the real entry point (``python -m prunelab``)."""
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "prunelab", "prune", "depth", "--remove", "2",
                          "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith(
        "--remove was replaced by --budget remove-blocks:N"), lines
    assert "Traceback" not in res.stderr and not out.exists()


def test_reference_page_names_every_quantity_and_retired_flag():
    from pathlib import Path

    from prunelab.budget import QUANTITIES

    page = (Path(__file__).resolve().parent.parent / "docs" / "budgets.md").read_text()
    for q in QUANTITIES:
        assert f"| `{q}` |" in page, q
    for flag in RETIRED:
        assert f"`{flag}" in page, flag


def test_budgets_that_would_do_nothing_are_refused_in_one_line():
    """keep-params:1 / a count beyond the model, remove-weights:0 or -0 and an empty
    --budget (an unset shell variable) never write an unpruned checkpoint or mean the
    default."""
    from prunelab.cli.common import budget_fields
    from prunelab.pruning import Depth
    from prunelab.pruning.gates.config import Gates
    from prunelab.pruning.sparsity.methods.wanda import Wanda

    assert parse_budget("remove-weights:-0").value == 0.0
    assert str(parse_budget("remove-weights:-0").value) == "0.0"  # never -0.0
    for text in ("", "  "):
        with pytest.raises(ConfigError, match=r"^--budget is empty \(an unset shell "):
            parse_budget(text)
        with pytest.raises(ConfigError, match="--budget is empty"):
            budget_fields(Wanda, text, "prune sparsity")
    for text in ("remove-weights:0", "remove-weights:-0", "keep-weights:1"):
        with pytest.raises(ConfigError, match="^sparsity 0 removes no weight"):
            Wanda(**budget_fields(Wanda, text, "prune sparsity"))
    with pytest.raises(ConfigError, match=r"keep-params:1\) keeps every parameter"):
        Depth(**budget_fields(Depth, "keep-params:1.0", "prune depth"))
    with pytest.raises(ConfigError, match=r"0 skips no sublayer"):
        Gates(**budget_fields(Gates, "remove-compute:0", "prune gates"))


def test_depth_keep_params_beyond_the_model_is_refused():
    from prunelab.models.loading import wrap
    from prunelab.pruning import Depth
    from prunelab.pruning.depth.config import blocks_to_remove

    from tiny_models import tiny_model

    lm = wrap(tiny_model("llama"))
    total = sum(p.numel() for p in lm.model.parameters())
    for target in (1e12, float(total)):
        with pytest.raises(ConfigError, match=r"the model already has [\d,]+ parameters \(no "
                           "block would be removed\\)"):
            blocks_to_remove(lm, Depth(target_params=target))
    assert blocks_to_remove(lm, Depth(target_params=0.99)) == 1
