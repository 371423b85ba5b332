"""The "Adding a method" examples of docs/adding-methods.md (examples/my_methods.py),
registered from outside the package, run through the Python API and the CLI and give what
they promise."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import prunelab
from prunelab import Depth, Width, wrap
from prunelab.cli import cli_main
from prunelab.data import TokenBatches
from prunelab.probes import PROBES
from prunelab.pruning import METHODS, RECOVERIES
from prunelab.pruning.width.scoring.base import WIDTH_SCORES

from tiny_models import SAMPLE_TEXT, char_tokenizer, save_tiny_checkpoint, tiny_model, tiny_tokens

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "my_methods.py"
CALIB = TokenBatches(input_ids=tiny_tokens(4, 12), spec="tiny", seqlen=12, samples=4, seed=0,
                     mode="calib", total_windows=4, sha256="0")


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("my_methods", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    METHODS.unregister("wanda-power")
    PROBES.unregister("weight-norm")
    RECOVERIES.unregister("mean-shift")
    WIDTH_SCORES.unregister("column-norm")


def test_sparsity_method_masks_by_its_own_score(ex):
    dense = tiny_model("llama")
    with torch.no_grad():  # block 0's q_proj reads the normed embeddings (nothing pruned yet)
        x = dense.model.layers[0].input_layernorm(dense.model.embed_tokens(CALIB.input_ids))
    sum_sq = x.double().pow(2).sum((0, 1))
    w = dense.model.layers[0].self_attn.q_proj.weight.detach().double()
    score = w.abs() * sum_sq  # |W| * ||X_j||^2 for power 2
    expected = torch.zeros_like(w, dtype=torch.bool)
    expected.scatter_(1, torch.topk(score, w.shape[1] // 2, dim=1).indices, True)
    lm = wrap(tiny_model("llama"), char_tokenizer())
    rep = prunelab.prune(lm, ex.WandaPower(sparsity=0.5, power=2.0), CALIB, batch_size=2)
    assert rep["achieved_sparsity"] == 0.5 and rep["method"] == "wanda-power"
    assert torch.equal(lm.model.model.layers[0].self_attn.q_proj.weight != 0, expected)


def test_probe_ranks_blocks_by_weight_norm(ex):
    lm = wrap(tiny_model("llama"), char_tokenizer())
    res = prunelab.probe(lm, "weight-norm", CALIB)
    norms = [math.sqrt(sum(float(p.detach().double().pow(2).sum())
                           for p in lm.adapter.block(i).parameters())) for i in range(4)]
    assert [s["value"] for s in res.scores] == pytest.approx(norms, rel=1e-6)
    assert res.ranking() == sorted(range(4), key=lambda i: norms[i])


def test_recovery_adds_the_mean_shift(ex):
    dense = wrap(tiny_model("opt"), char_tokenizer())
    none = prunelab.prune(dense, Depth(blocks=(2,)), CALIB, batch_size=2)
    lm = wrap(tiny_model("opt"), char_tokenizer())
    rep = prunelab.prune(lm, Depth(blocks=(2,), recovery="mean-shift"), CALIB, batch_size=2)
    assert rep["recovery"] == "mean-shift"
    assert rep["calib_kl_after_recovery"] < none["calib_kl_after_recovery"]


def test_width_score_removes_the_weakest_columns(ex):
    lm = wrap(tiny_model("llama"), char_tokenizer())
    w = lm.adapter.mlp_projections(0)["down"].weight.detach().double()
    rep = prunelab.prune(lm, Width(unit="ffn", score="column-norm", ratio=0.25, round_to=1),
                         CALIB, batch_size=2)
    removed = rep["blocks"][0]["removed_channels"]
    n = w.shape[1] // 4  # a quarter of the channels, the same count in every block
    assert len(removed) == n
    assert set(removed) == set(torch.argsort(w.norm(dim=0))[:n].tolist())


def test_the_cli_runs_the_registered_methods(ex, tmp_path, capsys):
    save_tiny_checkpoint("llama", tmp_path / "model")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    common = ["--model", str(tmp_path / "model"), "--data", f"text:{tmp_path / 'text.txt'}",
              "--samples", "2", "--seqlen", "16", "--batch-size", "2"]
    assert cli_main(["--quiet", "prune", "sparsity", *common, "--method", "wanda-power",
                     "--set", "power=2", "--out", str(tmp_path / "s")]) == 0
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert METHODS.from_dict(man["operations"][-1]["config"]) == ex.WandaPower(power=2.0)
    assert cli_main(["--quiet", "probe", *common, "--probe", "weight-norm",
                     "--out", str(tmp_path / "p")]) == 0
    assert (tmp_path / "p" / "weight-norm.json").is_file()
    assert cli_main(["--quiet", "prune", "width", *common, "--unit", "ffn", "--score",
                     "column-norm", "--budget", "remove-units:0.25", "--out",
                     str(tmp_path / "w")]) == 0
    capsys.readouterr()


def test_a_new_family_with_its_own_pruner_goes_through_the_one_wrapper():
    """The pattern of pruning/base.py's docstring: a config in METHODS, a Pruner for it
    returning a DictReport; api.prune adds the shared fields and the history."""
    from dataclasses import dataclass

    from prunelab.pruning import PRUNERS, DictReport, Pruner

    @METHODS.register("drop-first")
    @dataclass(frozen=True)
    class DropFirst:
        remove: int = 1

    @PRUNERS.register(DropFirst)
    class DropFirstPruner(Pruner):
        operation = "prune-depth"

        def run(self, lm, config, input_ids, *, batch_size):
            lm.adapter.delete_blocks(list(range(config.remove)))
            return DictReport({"removed_blocks": list(range(config.remove))},
                              history_keys=("removed_blocks",))

    try:
        lm = wrap(tiny_model("llama"), char_tokenizer())
        rep = prunelab.prune(lm, DropFirst(remove=2), CALIB, batch_size=2)
        assert lm.adapter.num_blocks == 2 and rep["removed_blocks"] == [0, 1]
        assert rep["method"] == "drop-first" and rep["config"] == {"name": "drop-first",
                                                                   "remove": 2}
        assert rep["size_after"]["params"] < rep["size_before"]["params"]
        assert lm.history[-1] == {"operation": "prune-depth", "method": "drop-first",
                                  "config": {"name": "drop-first", "remove": 2},
                                  "removed_blocks": [0, 1]}
        assert METHODS.from_dict(lm.history[-1]["config"]) == DropFirst(remove=2)
    finally:
        METHODS.unregister("drop-first")
        PRUNERS.unregister(DropFirst)
