"""Probes and pruning on encoders: the divergence to dense is 1 - cos of the mean-pooled
final hidden states (no next-token distribution), checked against a hand-built model."""

from __future__ import annotations

import copy

import pytest
import torch

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.adapters import get_adapter
from prunelab.models.loading import wrap
from prunelab.probes import run_probes
from prunelab.pruning import Depth, Wanda

from tiny_models import SAMPLE_TEXT, char_tokenizer, save_tiny_checkpoint, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def manual_divergence(dense, order, ids):
    """Mean over windows of 1 - cos(mean_t h_dense, mean_t h_model): the blocks of a copy
    of ``dense`` put in ``order`` (deletion or swap), run as a plain HF forward."""
    model = copy.deepcopy(dense)
    get_adapter(model).reorder_blocks(order)
    with torch.no_grad():
        ref = dense(input_ids=ids).last_hidden_state.mean(1).double()
        out = model(input_ids=ids).last_hidden_state.mean(1).double()
    return float((1 - torch.cosine_similarity(ref, out, dim=-1)).mean())


def test_leave_one_out_and_interchange_on_bert_equal_hand_built_models():
    dense = tiny_model("bert")
    res = run_probes(wrap(dense), ["leave-one-out", "interchange", "interval"], IDS,
                     batch_size=2, window=1, max_length=2)
    for i in range(4):
        got = res["leave-one-out"].scores[i]
        assert got["value"] == pytest.approx(
            manual_divergence(dense, [b for b in range(4) if b != i], IDS), rel=1e-4, abs=1e-9)
        assert got["value"] > 0
    for s in res["interchange"].scores:
        i, j = s["layers"]
        order = list(range(4))
        order[i], order[j] = j, i
        assert s["value"] == pytest.approx(manual_divergence(dense, order, IDS), rel=1e-4,
                                           abs=1e-9)
    span = next(s for s in res["interval"].scores if s["layers"] == [1, 3])
    assert span["value"] == pytest.approx(manual_divergence(dense, [0, 3], IDS), rel=1e-4)
    assert "1 - cos" in res["leave-one-out"].meta["value_protocol"]


def test_depth_pruning_bert_reports_the_encoder_divergence():
    dense = tiny_model("bert")
    loo = run_probes(wrap(dense), ["leave-one-out"], IDS, batch_size=2)["leave-one-out"]
    lm = wrap(copy.deepcopy(dense), char_tokenizer())
    rep = prunelab.prune(lm, Depth(remove=1, probe="leave-one-out"), CALIB, batch_size=2)
    assert rep["removed_blocks"] == [loo.ranking()[0]]
    assert "encoder" in rep["calib_divergence"]
    keep = [b for b in range(4) if b not in rep["removed_blocks"]]
    assert rep["calib_kl_before_recovery"] == pytest.approx(
        loo.scores[rep["removed_blocks"][0]]["value_all_positions"], rel=1e-4)
    assert rep["calib_kl_last_before_recovery"] == pytest.approx(
        manual_divergence(dense, keep, IDS), rel=1e-4)
    assert lm.adapter.num_blocks == 3 and lm.model.config.num_hidden_layers == 3
    # closed-form folding needs additive residual branches: refused for post-LN BERT
    with pytest.raises(UnsupportedOperationError, match="ghost or lra"):
        prunelab.prune(wrap(copy.deepcopy(dense)), Depth(recovery="foldable", blocks=(2,)),
                       CALIB, batch_size=2)
    ghost = wrap(copy.deepcopy(dense), char_tokenizer())
    rep = prunelab.prune(ghost, Depth(blocks=(2,), recovery="ghost"), CALIB, batch_size=2)
    assert rep["calib_kl_after_recovery"] < rep["calib_kl_before_recovery"]


def test_sparsity_on_bert_keeps_embeddings():
    lm = wrap(tiny_model("bert"), char_tokenizer())
    emb = lm.model.embeddings.word_embeddings.weight.detach().clone()
    rep = prunelab.prune(lm, Wanda(sparsity=0.5), CALIB, batch_size=2)
    assert rep["achieved_sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert torch.equal(lm.model.embeddings.word_embeddings.weight, emb)


def test_sweep_refuses_encoders_clearly():
    from prunelab.workflow.sweep import sweep_depth

    with pytest.raises(ConfigError, match="encoder"):
        sweep_depth(wrap(tiny_model("bert")), ["block-influence"], [1], ["none"], IDS, IDS,
                    "/nonexistent/never-written")


def test_cli_probe_and_prune_depth_on_a_bert_checkpoint(tmp_path):
    from tiny_models import cli_inproc

    save_tiny_checkpoint("bert", tmp_path / "bert")
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT)
    data = f"text:{tmp_path / 't.txt'}"
    r = cli_inproc("--quiet", "probe", "--model", str(tmp_path / "bert"), "--data", data,
                   "--probe", "leave-one-out,block-influence", "--samples", "4", "--seqlen", "32",
                   "--out", str(tmp_path / "probes"))
    assert r.returncode == 0, r.stderr
    assert "1 - cos" in (tmp_path / "probes" / "leave-one-out.json").read_text()
    r = cli_inproc("--quiet", "prune", "depth", "--model", str(tmp_path / "bert"), "--data", data,
                   "--budget", "remove-blocks:1", "--probe", "leave-one-out", "--samples", "4",
                   "--seqlen", "32", "--out", str(tmp_path / "pruned"))
    assert r.returncode == 0, r.stderr
    assert "1 - cos (pooled)" in r.stdout
    again = prunelab.load(str(tmp_path / "pruned"))
    assert again.adapter.num_blocks == 3 and again.is_encoder
