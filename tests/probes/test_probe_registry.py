"""Probes as registered typed configs: names and classes, strict options and routing, the
round trip of every config, typed configs through ``prunelab.probe``, and a probe
registered from this file alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.adapters import get_adapter
from prunelab.models.loading import wrap
from prunelab.probes import (
    CKA,
    PROBES,
    BlockInfluence,
    Contraction,
    Interchange,
    Interval,
    LeaveOneOut,
    ProbeResult,
    Replacement,
    SpanAngular,
    SublayerAblation,
    WeightRedundancy,
    make_config,
    probe_spec,
    route_options,
    run_probes,
)
from prunelab.pruning import Depth
from prunelab.registry import to_dict

from tiny_models import tiny_model, tiny_tokens

BUILT_IN = {"block-influence": BlockInfluence, "span-angular": SpanAngular, "cka": CKA,
            "contraction": Contraction, "leave-one-out": LeaveOneOut,
            "sublayer-ablation": SublayerAblation, "replacement": Replacement,
            "interchange": Interchange, "weight-redundancy": WeightRedundancy,
            "interval": Interval}
# a non-default value of every option, so that the round trip cannot pass on defaults alone
NON_DEFAULT = {"block-influence": dict(angular=True), "span-angular": dict(span=3),
               "cka": dict(all_pairs=False, max_tokens=64),
               "contraction": dict(scale=0.05, seed=7),
               "replacement": dict(pairs=((0, 2), (1, 3))),
               "interchange": dict(window=2, pairs=((3, 1),)),
               "interval": dict(max_length=2), "head-ablation": dict(ablation="mean"),
               "induction": dict(length=5, sequences=2, top_k=1, seed=3)}
IDS = tiny_tokens(4, 12)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def test_user_facing_names_map_to_the_exported_classes():
    for name, cls in BUILT_IN.items():
        assert PROBES.get(name) is cls and PROBES.name_of(cls()) == name
        assert cls.__doc__.strip().splitlines()[0]  # the first line is the CLI's help
    assert probe_spec("weight-redundancy").forward is False
    assert [n for n in BUILT_IN if not probe_spec(n).forward] == ["weight-redundancy"]
    assert {n for n in BUILT_IN if probe_spec(n).resumable} == {
        "leave-one-out", "sublayer-ablation", "replacement", "interchange", "interval"}


@pytest.mark.parametrize("name", PROBES.names())
def test_every_probe_config_round_trips(name):
    cls = PROBES.get(name)
    for cfg in (cls(), make_config(name, **NON_DEFAULT.get(name, {}))):
        d = json.loads(json.dumps(to_dict(cfg)))  # through JSON, as in a manifest
        assert d["name"] == name
        back = PROBES.from_dict(d)
        assert back == cfg and type(back) is cls
    if name in NON_DEFAULT:
        assert make_config(name, **NON_DEFAULT[name]) != cls()


def test_unknown_keys_are_errors_everywhere():
    with pytest.raises(ConfigError, match=r"'windw'.*window, pairs"):
        make_config("interchange", windw=1)
    with pytest.raises(ConfigError, match=r"'windw'.*window, pairs"):
        PROBES.from_dict({"name": "interchange", "windw": 1})
    with pytest.raises(ConfigError, match=r"'angular'.*\(none\)"):
        make_config("sublayer-ablation", angular=True)  # a probe without options
    with pytest.raises(ConfigError, match=r"'angular'.*metric, metric_data"):
        make_config("leave-one-out", angular=True)
    with pytest.raises(ConfigError, match="unknown probe 'nope'"):
        PROBES.from_dict({"name": "nope"})


def test_shared_options_are_routed_and_an_unused_one_is_an_error():
    inter, cka = route_options(["interchange", "cka"], {"window": 1, "all_pairs": False,
                                                        "pairs": None})
    assert inter == Interchange(window=1) and cka == CKA(all_pairs=False)
    with pytest.raises(ConfigError, match=r"no requested probe takes option 'span' "
                                          r"\(interchange: window, pairs; cka: all_pairs"):
        route_options(["interchange", "cka"], {"window": 1, "span": 2})
    # a ready config is used as it is: its options are not shared
    ready = Interchange(pairs=((0, 1),))
    assert route_options([ready, "replacement"], {"window": 2}) == [ready,
                                                                   Replacement(window=2)]
    with pytest.raises(ConfigError, match="ready interchange config"):
        route_options([ready, "cka"], {"window": 2})


@pytest.fixture(scope="module")
def llama():
    return wrap(tiny_model("llama"))


def test_probe_takes_typed_configs_names_and_mixed_lists(llama):
    typed = prunelab.probe(llama, Interchange(window=1), CALIB, batch_size=2)
    named = prunelab.probe(llama, "interchange", CALIB, batch_size=2, window=1)
    assert isinstance(typed, ProbeResult) and typed.scores == named.scores
    assert [s["layers"] for s in typed.scores] == [[0, 1], [1, 2], [2, 3]]
    assert typed.probe_config() == Interchange(window=1)
    both = prunelab.probe(llama, [Interchange(pairs=((0, 3),)), "cka"], CALIB, batch_size=2,
                          all_pairs=False)
    assert list(both) == ["interchange", "cka"]
    assert [s["layers"] for s in both["interchange"].scores] == [[0, 3]]
    assert both["cka"].probe_config() == CKA(all_pairs=False)
    assert len(both["cka"].scores) == 4  # adjacent boundaries only
    with pytest.raises(ConfigError, match="'span'"):
        prunelab.probe(llama, "interchange,cka", CALIB, batch_size=2, span=2)
    with pytest.raises(ConfigError, match="requested twice"):
        prunelab.probe(llama, [Interchange(window=1), "interchange"], CALIB, batch_size=2)
    # seed samples the data and seeds the probes that take one, never an error
    c3 = prunelab.probe(llama, "contraction", CALIB, batch_size=2, seed=3)
    assert c3.config["seed"] == 3
    assert prunelab.probe(llama, "cka", CALIB, batch_size=2, seed=3).config["all_pairs"]


# ---------------------------------------------------------------- a probe from outside
@dataclass(frozen=True)
class WeightNorm:
    """Frobenius norm of each block's parameters (forward-free toy probe)."""

    squared: bool = False

    def run(self, ctx) -> ProbeResult:
        scores = []
        for i in range(ctx.num_blocks):
            sq = sum(float(torch.linalg.vector_norm(p.detach().double()) ** 2)
                     for p in ctx.adapter.block(i).parameters())
            scores.append({"layers": [i], "value": sq if self.squared else math.sqrt(sq)})
        return ProbeResult("weight-norm", {"squared": self.squared}, scores, kind="layer",
                           num_blocks=ctx.num_blocks)


@pytest.fixture()
def weight_norm():
    # the decorator applied here rather than on the class, so the test can unregister it
    PROBES.register("weight-norm", forward=False)(WeightNorm)
    yield WeightNorm
    PROBES.unregister("weight-norm")


def shrunk_block_model(block: int = 2):
    model = tiny_model("llama")
    with torch.no_grad():
        for p in get_adapter(model).block(block).parameters():
            p.mul_(0.01)
    return model


def expected_norms(model) -> list[float]:
    ad = get_adapter(model)
    return [math.sqrt(sum(float((p.detach().double() ** 2).sum())
                          for p in ad.block(i).parameters())) for i in range(ad.num_blocks)]


def test_a_probe_registered_from_a_test_file_runs_everywhere(weight_norm, tmp_path):
    model = shrunk_block_model(2)
    lm = wrap(model)
    assert "weight-norm" in PROBES and PROBES.from_dict({"name": "weight-norm"}) == WeightNorm()
    res = prunelab.probe(lm, WeightNorm(), CALIB, batch_size=2)
    assert [s["value"] for s in res.scores] == pytest.approx(expected_norms(model), rel=1e-12)
    assert res.ranking()[0] == 2
    # forward-free as declared: the boundaries are never cached
    assert res.meta["block_evaluations"] == 0 and res.meta["cache_block_evaluations"] == 0.0
    out = tmp_path / "probes"
    many = run_probes(lm, ["weight-norm", "block-influence"], IDS, batch_size=2, out_dir=out,
                      squared=True)
    assert many["weight-norm"].scores[0]["value"] == pytest.approx(
        expected_norms(model)[0] ** 2, rel=1e-12)
    assert many["weight-norm"].meta["cache_block_evaluations"] == 0.0
    assert many["block-influence"].meta["cache_block_evaluations"] == 4.0
    assert (out / "weight-norm.json").is_file() and (out / "weight-norm.png").is_file()
    assert "weight-norm" in (out / "summary.md").read_text()
    # depth pruning runs it by name, routing none of its own options to it
    report = prunelab.prune(lm, Depth(remove=1, probe="weight-norm"), CALIB, batch_size=2)
    assert report["removed_blocks"] == [2]


def test_probe_modules_import_in_any_order():
    """Probe results and their plots (one package since the house in floors) import cleanly
    each on its own, in a fresh interpreter."""
    for snippet in ("import prunelab.probes.base", "import prunelab.probes.plots",
                    "import prunelab.probes.swap_plots", "import prunelab.probes.cascadeflow"):
        run = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
