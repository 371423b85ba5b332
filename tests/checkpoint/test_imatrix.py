"""Importance matrices (:mod:`prunelab.checkpoint.imatrix`, :mod:`prunelab.calib.imatrix`):
llama.cpp's file forms written and read back exactly, the statistics against their
definition (sum over tokens of each input channel's square, per llama.cpp weight name),
depth-pruned models keyed by their renumbered blocks, and the quantizer taking one."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from prunelab import Depth
from prunelab.calib.imatrix import collect_imatrix, gguf_weight_name
from prunelab.checkpoint.imatrix import IMatrix, read_imatrix, write_imatrix
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, CorruptCheckpointError, UnsupportedOperationError
from prunelab.models.loading import wrap

from tiny_models import tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)


def test_gguf_form_round_trips_exactly(tmp_path):
    im = IMatrix(sums={"blk.0.attn_q.weight": np.array([1.5, 0.0, 3.25]),
                       "blk.1.ffn_down.weight": np.array([2.0, 4.0])},
                 counts={"blk.0.attn_q.weight": 4, "blk.1.ffn_down.weight": 8},
                 datasets=["wiki-vital:calib"], chunk_size=12, chunk_count=4)
    path = write_imatrix(tmp_path / "m.gguf", im)
    back = read_imatrix(path)
    assert back.datasets == ["wiki-vital:calib"]
    assert (back.chunk_size, back.chunk_count) == (12, 4)
    assert back.counts == im.counts
    for name, s in im.sums.items():
        np.testing.assert_array_equal(back.sums[name], s)
    # what llama.cpp's quantizer uses: the mean square per column
    np.testing.assert_array_equal(back.means()["blk.0.attn_q.weight"],
                                  np.array([0.375, 0.0, 0.8125], dtype=np.float32))
    # llama-imatrix's layout: <name>.in_sum2 [d_in] and <name>.counts [1], sorted, F32
    import gguf

    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == [
        "blk.0.attn_q.weight.in_sum2", "blk.0.attn_q.weight.counts",
        "blk.1.ffn_down.weight.in_sum2", "blk.1.ffn_down.weight.counts"]
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    assert reader.fields["general.type"].contents() == "imatrix"
    assert "general.architecture" not in reader.fields


def test_legacy_form_is_read_as_llamacpp_defines_it(tmp_path):
    """``.dat``: n; per entry len, name, ncall, nval, values (= mean x ncall); chunks; the
    dataset. llama.cpp's loader divides the values by ncall."""
    name = b"blk.0.ffn_up.weight"
    body = struct.pack("<i", 1) + struct.pack("<i", len(name)) + name
    body += struct.pack("<ii", 10, 2) + struct.pack("<2f", 30.0, 5.0)
    body += struct.pack("<i", 10) + struct.pack("<i", 4) + b"text"
    (tmp_path / "m.dat").write_bytes(body)
    im = read_imatrix(tmp_path / "m.dat")
    np.testing.assert_array_equal(im.means()["blk.0.ffn_up.weight"], [3.0, 0.5])
    assert im.chunk_count == 10 and im.datasets == ["text"]
    (tmp_path / "bad.dat").write_bytes(body[:20])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        read_imatrix(tmp_path / "bad.dat")


def test_bad_files_and_values_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_imatrix(tmp_path / "none.gguf")
    with pytest.raises(ConfigError, match="finite"):
        write_imatrix(tmp_path / "x.gguf", IMatrix(sums={"a": np.array([np.nan])},
                                                     counts={"a": 1}))
    assert not (tmp_path / "x.gguf").exists()
    with pytest.raises(UnsupportedOperationError, match="no llama.cpp name"):
        gguf_weight_name("llama", 0, "mlp.fc1")


def _hand_sums(lm, ids):
    """The definition, by hooks on a plain forward of the whole model."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for i in range(lm.adapter.num_blocks):
        for path, mod in lm.adapter.linears(i).items():
            name = gguf_weight_name("llama", i, path)

            def hook(_m, inp, name=name):
                x = inp[0].reshape(-1, inp[0].shape[-1]).double()
                sums[name] = sums.get(name, 0) + x.square().sum(0)
                counts[name] = counts.get(name, 0) + x.shape[0]
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            lm.model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return sums, counts


def test_collected_statistics_are_the_definition():
    lm = wrap(tiny_model("llama"), None, spec="tiny")
    im = collect_imatrix(lm, IDS, batch_size=3, dataset="tiny")
    sums, counts = _hand_sums(lm, IDS)
    assert sorted(im.sums) == sorted(sums) and len(sums) == 4 * 7
    for name in sums:
        np.testing.assert_allclose(im.sums[name], sums[name].numpy(), rtol=1e-5)
        assert im.counts[name] == counts[name] == IDS.numel()
    # q / k / v read one tensor: one set of sums
    np.testing.assert_array_equal(im.sums["blk.2.attn_q.weight"],
                                  im.sums["blk.2.attn_v.weight"])
    assert im.datasets == ["tiny"] and im.chunk_size == 12 and im.chunk_count == 4


def test_depth_pruned_models_are_keyed_by_their_renumbered_blocks():
    import prunelab

    lm = wrap(tiny_model("llama"), None, spec="tiny")
    calib = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0,
                         mode="calib", total_windows=4, sha256="0")
    prunelab.prune(lm, Depth(blocks=(1,)), calib)
    im = collect_imatrix(lm, IDS)
    assert {n.split(".")[1] for n in im.sums} == {"0", "1", "2"}
    sums, _ = _hand_sums(lm, IDS)
    for name in sums:
        np.testing.assert_allclose(im.sums[name], sums[name].numpy(), rtol=1e-5)
