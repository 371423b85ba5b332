"""The commands whose method options are generated from the configs (issue 38): ``prune
gates`` / ``moe`` / ``elastic`` / ``factor``, ``heal``, ``probe`` and the presses of
``eval``. For each: a field added to its config (a re-registered subclass, a new factor
method / probe / press) shows up in ``--help`` and reaches the config; an option the chosen
piece does not own is a one-line error (exit 2); and a representative invocation builds the
config the hand-written options built."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

import prunelab.heal
from prunelab import api
from prunelab.cli import (
    cli_main,
    conditional_cmds,
    elastic_cmds,
    factor_cmds,
    heal_cmds,
    inspect_cmds,
)
from prunelab.cli.common import LoadArgs
from prunelab.errors import ConfigError
from prunelab.heal import HealConfig
from prunelab.inference import PRESSES
from prunelab.inference.config import LazyLLM, Press
from prunelab.probes import PROBES
from prunelab.probes.base import route_options
from prunelab.pruning import METHODS
from prunelab.pruning.factor.config import FactorConfig
from prunelab.pruning.factor.lowrank import SvdLlm
from prunelab.pruning.gates.config import Gates
from prunelab.pruning.moe import PrunePath
from prunelab.pruning.width.elastic import ElasticRanking


def _help(argv, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "250")
    assert cli_main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.replace("│", " ").split())


def _one_line_error(code, text, message):
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert code == 2, text
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], text


@pytest.fixture
def captured(monkeypatch):
    """``prune_and_save`` of every prune command replaced by a recorder of the config."""
    seen = {}

    def fake(load, cfg, out_dir, overwrite, **kw):
        seen["cfg"] = cfg

    for mod in (conditional_cmds, elastic_cmds, factor_cmds):
        monkeypatch.setattr(mod, "prune_and_save", fake)
    return seen


def _prune(cmd, argv, tmp_path, capsys):
    code = cli_main(["prune", cmd, "--model", "m", "--out", str(tmp_path / "o"), *argv])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def _reregister(name, cls):
    """Replace ``name``'s class in place (registering a taken name keeps its position, so
    the listing order other tests check is unchanged)."""
    old = METHODS.get(name)
    METHODS.register(name, replace=True)(cls)
    return old


def _restore(name, old):
    METHODS.register(name, replace=True)(old)


# ----------------------------------------------------------------- prune gates / moe / elastic
@pytest.fixture
def my_gates():
    @dataclass(frozen=True)
    class MyGates(Gates):
        my_knob: int = field(default=1, metadata={"help": "my gates knob"})

    old = _reregister("gates", MyGates)
    yield MyGates
    _restore("gates", old)


def test_gates_field_added_to_its_config_is_an_option(my_gates, captured, tmp_path, capsys,
                                                      monkeypatch):
    text = _help(["prune", "gates"], capsys, monkeypatch)
    assert "--my-knob" in text and "my gates knob (default 1)" in text
    assert "--budget" in text and "--tau" in text and "--attention-scores" in text
    code, out = _prune("gates", ["--my-knob", "3", "--tau", "0.5"], tmp_path, capsys)
    assert code == 0, out
    assert captured["cfg"] == my_gates(my_knob=3, tau=0.5)


def test_gates_same_config_as_the_hand_written_options(captured, tmp_path, capsys):
    code, out = _prune("gates", ["--budget", "remove-compute:0.3", "--ema", "0.5", "--rounds", "4",
                                 "--rank-weight", "2", "--select", "order", "--positions",
                                 "last", "--set", "seed=7", "--set", "steps=10"],
                       tmp_path, capsys)
    assert code == 0, out
    assert captured["cfg"] == Gates(budget=0.3, ema=0.5, rounds=4, rank_weight=2.0,
                                    select="order", positions="last", seed=7, steps=10)
    code, out = _prune("gates", ["--select", "nope"], tmp_path, capsys)
    _one_line_error(code, out, "select must be one of per-flop, order")


def test_moe_same_config_and_new_fields(captured, tmp_path, capsys, monkeypatch):
    code, out = _prune("moe", ["--experts", "8", "--clustering", "kmeans", "--router",
                               "centroid", "--budget", "keep-mass:0.8", "--set", "seed=2"],
                       tmp_path, capsys)
    assert code == 0, out
    assert captured["cfg"] == PrunePath(experts=8, clustering="kmeans", router="centroid",
                                        mass=0.8, seed=2)

    @dataclass(frozen=True)
    class MyPath(PrunePath):
        my_temp: float = field(default=1.0, metadata={"help": "my router temperature"})

    old = _reregister("prunepath", MyPath)
    try:
        assert "--my-temp" in _help(["prune", "moe"], capsys, monkeypatch)
        code, out = _prune("moe", ["--my-temp", "2", "--router-steps", "5"], tmp_path, capsys)
        assert code == 0, out
        assert captured["cfg"] == MyPath(my_temp=2.0, router_steps=5)
    finally:
        _restore("prunepath", old)


def test_elastic_same_config_and_new_fields(captured, tmp_path, capsys, monkeypatch):
    code, out = _prune("elastic", ["--budget", "remove-units:0.2..0.5", "--steps", "10",
                                   "--lr", "0.1", "--budgets-per-step", "3", "--t-start", "2",
                                   "--t-end",
                                   "0.1", "--seed", "4"], tmp_path, capsys)
    assert code == 0, out
    assert captured["cfg"] == ElasticRanking(budget_min=0.2, budget_max=0.5, steps=10, lr=0.1,
                                             budgets_per_step=3, t_start=2.0, t_end=0.1,
                                             seed=4)
    text = _help(["prune", "elastic"], capsys, monkeypatch)
    assert "remove-units:LOW..HIGH" in text
    assert "--budget-min" not in text and "--budget-max" not in text

    @dataclass(frozen=True)
    class MyElastic(ElasticRanking):
        my_warm: int = field(default=0, metadata={"help": "my warm-up steps"})

    old = _reregister("elastic", MyElastic)
    try:
        assert "--my-warm" in _help(["prune", "elastic"], capsys, monkeypatch)
        code, out = _prune("elastic", ["--my-warm", "5"], tmp_path, capsys)
        assert code == 0, out
        assert captured["cfg"] == MyElastic(my_warm=5)
    finally:
        _restore("elastic", old)


# ---------------------------------------------------------------------------- prune factor
@pytest.fixture
def my_factor():
    @METHODS.register("my-factor")
    @dataclass(frozen=True)
    class MyFactor(FactorConfig):
        """a test factorization"""

        my_rank: int = field(default=4, metadata={"help": "my dictionary rank"})

    yield MyFactor
    METHODS.unregister("my-factor")


def test_factor_method_added_is_listed_with_its_options(my_factor, captured, tmp_path,
                                                        capsys, monkeypatch):
    text = _help(["prune", "factor"], capsys, monkeypatch)
    assert "my-factor" in text and "--my-rank" in text and "my-factor: my dictionary rank" in text
    code, out = _prune("factor", ["--method", "my-factor", "--my-rank", "9",
                                  "--budget", "keep-params:0.8"], tmp_path, capsys)
    assert code == 0, out
    assert captured["cfg"] == my_factor(my_rank=9, target_params=0.8)
    code, out = _prune("factor", ["--method", "slicegpt", "--my-rank", "9"], tmp_path, capsys)
    _one_line_error(code, out, "--my-rank does not apply to --method slicegpt")


def test_factor_same_config_as_the_hand_written_options(captured, tmp_path, capsys):
    code, out = _prune("factor", ["--method", "svd-llm", "--budget", "remove-weights:0.3",
                                  "--allocation",
                                  "spectrum", "--refit", "--targets", "a.*, b.*", "--ignore",
                                  "c", "--damping", "0.02"], tmp_path, capsys)
    assert code == 0, out
    assert captured["cfg"] == SvdLlm(ratio=0.3, allocation="spectrum", refit=True,
                                     targets=("a.*", "b.*"), ignore=("c",), damping=0.02)
    code, out = _prune("factor", ["--method", "svd-llm", "--no-refit"], tmp_path, capsys)
    assert code == 0 and captured["cfg"] == SvdLlm(refit=False), out
    code, out = _prune("factor", ["--method", "slicegpt", "--refit"], tmp_path, capsys)
    _one_line_error(code, out, "--refit does not apply to --method slicegpt")
    code, out = _prune("factor", ["--method", "shared-dict", "--group", "3"], tmp_path, capsys)
    _one_line_error(code, out, "--group does not apply to --method shared-dict")


# ------------------------------------------------------------------------------------ heal
@pytest.fixture
def heal_seen(monkeypatch):
    seen = {}

    def fake_heal(model, teacher, data, held_out, *, config, **kw):
        seen["cfg"] = config
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(api, "heal", fake_heal)
    return seen


def _heal(argv, tmp_path, capsys):
    code = cli_main(["heal", "--model", "m", "--out", str(tmp_path / "o"), *argv])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_heal_same_config_as_the_hand_written_options(heal_seen, tmp_path, capsys):
    code, out = _heal(["--loss", "mix", "--kd-weight", "0.5", "--lora-rank", "4", "--steps",
                       "10", "--every", "5", "--prune", "cascadeflow", "--budget",
                       "remove-blocks:2",
                       "--seqlen", "64", "--seed", "1", "--batch-size", "2", "--train-bridges",
                       "--lr", "1e-3", "--flow-measure", "residual"], tmp_path, capsys)
    assert code == 2 and "stopped by the test" in out, out
    cfg = heal_seen["cfg"]
    assert cfg == HealConfig(quiet=cfg.quiet, loss="mix", kd_weight=0.5, lora_rank=4,
                             steps=10, prune_every=5, prune="cascadeflow", remove=2,
                             seqlen=64, seed=1, batch_size=2, train_bridges=True, lr=1e-3,
                             flow_measure="residual")
    code, out = _heal(["--prune", "rep-lie", "--budget", "remove-units:0.3", "--prune-every", "3",
                       "--eval-data", "none", "--full"], tmp_path, capsys)
    _one_line_error(code, out, "prune rep-lie reads the LoRA matrices")
    code, out = _heal(["--prune", "rep-lie", "--budget", "remove-units:0.3", "--prune-every", "3",
                       "--eval-data", "none", "--set", "round_to=16"], tmp_path, capsys)
    assert code == 2 and "stopped by the test" in out, out
    cfg = heal_seen["cfg"]
    assert cfg == HealConfig(quiet=cfg.quiet, prune="rep-lie", ratio=0.3, prune_every=3,
                             patience=0, round_to=16)


def test_heal_field_added_to_its_config_is_an_option(heal_seen, tmp_path, capsys,
                                                    monkeypatch):
    @dataclass(frozen=True)
    class MyHeal(HealConfig):
        my_clip: float = field(default=0.0, metadata={"help": "my logit clipping"})

    monkeypatch.setattr(prunelab.heal, "HealConfig", MyHeal)
    text = _help(["heal"], capsys, monkeypatch)
    assert "--my-clip" in text and "my logit clipping" in text
    assert "--prune-every" in text and "--every" in text and "--quiet" not in text
    code, out = _heal(["--my-clip", "3", "--temperature", "4"], tmp_path, capsys)
    assert code == 2 and "stopped by the test" in out, out
    cfg = heal_seen["cfg"]
    assert type(cfg) is MyHeal and cfg.my_clip == 3.0 and cfg.temperature == 4.0
    assert heal_cmds  # the module the command lives in


# ----------------------------------------------------------------------------------- probe
@pytest.fixture
def probe_seen(monkeypatch):
    seen = {}

    class Dummy:
        pass

    def fake_probe(lm, names, **kw):
        options = {k: v for k, v in kw.items() if k not in (
            "data", "seqlen", "samples", "seed", "batch_size", "out_dir", "overwrite",
            "states", "max_remove", "bootstrap")}
        seen["options"] = options
        route_options(names, {k: v for k, v in options.items()
                              if k not in ("pairs",)})  # the real routing and its errors
        return {}

    monkeypatch.setattr(LoadArgs, "load", lambda self: Dummy())
    monkeypatch.setattr(api, "probe", fake_probe)
    return seen


def _probe(argv, tmp_path, capsys):
    code = cli_main(["probe", "--model", "m", "--out", str(tmp_path / "o"), *argv])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_probe_options_reach_the_probes_that_take_them(probe_seen, tmp_path, capsys):
    code, out = _probe(["--probe", "induction,interchange", "--induction-length", "5",
                        "--induction-sequences", "2", "--top-k", "1", "--window", "2"],
                       tmp_path, capsys)
    assert code == 0, out
    # the keywords the hand-written options passed (None: not given)
    assert probe_seen["options"] == {"length": 5, "sequences": 2, "top_k": 1, "window": 2,
                                     "pairs": None}
    code, out = _probe(["--probe", "cka", "--span", "2"], tmp_path, capsys)
    _one_line_error(code, out, "no requested probe takes option 'span'")


def test_probe_added_is_listed_with_its_options(probe_seen, tmp_path, capsys, monkeypatch):
    @PROBES.register("my-probe")
    @dataclass(frozen=True)
    class MyProbe:
        """a test probe"""

        my_depth: int = field(default=2, metadata={"help": "my probe depth"})

        def run(self, ctx):
            return None
    try:
        text = _help(["probe"], capsys, monkeypatch)
        assert "my-probe" in text and "--my-depth" in text
        assert "my-probe: my probe depth (default 2)" in text
        code, out = _probe(["--probe", "my-probe", "--my-depth", "4"], tmp_path, capsys)
        assert code == 0, out
        assert probe_seen["options"]["my_depth"] == 4
        code, out = _probe(["--probe", "cka", "--my-depth", "4"], tmp_path, capsys)
        _one_line_error(code, out, "no requested probe takes option 'my_depth'")
    finally:
        PROBES.unregister("my-probe")


# ------------------------------------------------------------------------------ eval presses
@pytest.fixture
def press_seen(monkeypatch):
    seen = {}

    class Dummy:
        pass

    def fake_config(lm, name, ratio, options, own=None, data=None, seqlen=None):
        seen["cfg"] = PRESSES.make(name, **({} if ratio is None else {"ratio": ratio}),
                                   **(own or {}))
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(LoadArgs, "load", lambda self: Dummy())
    monkeypatch.setattr(inspect_cmds, "_moe_setup", lambda lm, mass: False)
    monkeypatch.setattr(inspect_cmds, "_press_config", fake_config)
    return seen


def _eval(argv, capsys):
    code = cli_main(["eval", "--model", "m", *argv])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def test_press_options_are_generated_flags(press_seen, capsys):
    code, out = _eval(["--press", "lazyllm", "--budget", "remove-cache:0.3", "--press-layer", "2"],
                      capsys)
    assert code == 2 and "stopped by the test" in out, out
    assert press_seen["cfg"] == LazyLLM(ratio=0.3, layer=2)
    code, out = _eval(["--press", "lazyllm", "--press-window", "4"], capsys)
    _one_line_error(code, out, "--press-window does not apply to --press lazyllm")
    code, out = _eval(["--press-layer", "2"], capsys)
    _one_line_error(code, out, "--press-layer needs --press NAME")
    code, out = _eval(["--budget", "remove-cache:0.3"], capsys)
    _one_line_error(code, out, "--budget remove-cache:F / --press-option need --press NAME")


def test_press_added_is_listed_with_its_options(press_seen, capsys, monkeypatch):
    @dataclass(frozen=True)
    class MyPress(Press):
        """a test press"""

        ratio: float = 0.5
        my_sinks: int = field(default=2, metadata={"help": "my sink tokens"})

    PRESSES.register("my-press")(MyPress)
    try:
        text = _help(["eval"], capsys, monkeypatch)
        assert "--press-my-sinks" in text and "my sink tokens" in text
        assert "remove-cache:F" in text and "--press-ratio" not in text
        assert "--press-my-ratio" not in text
        code, out = _eval(["--press", "my-press", "--press-my-sinks", "7"], capsys)
        assert code == 2 and "stopped by the test" in out, out
        assert press_seen["cfg"] == MyPress(my_sinks=7)
    finally:
        PRESSES.unregister("my-press")
