"""Quantization-aware widths and importance matrices through llama.cpp's own quantizer, on
a tiny Llama whose widths are multiples of the k-quant block (256): widths rounded for the
target type leave no weight in a fallback type, the export names those that do fall back,
and an importance matrix reaches the quantizer (a different file; the IQ types that need
one are refused without it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

import prunelab
from prunelab import Width
from prunelab.calib.imatrix import collect_imatrix
from prunelab.checkpoint.gguf_export import (
    fallback_note,
    fallbacks,
    quantize_gguf,
    write_gguf,
)
from prunelab.checkpoint.imatrix import IMatrix, write_imatrix
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap

from tiny_models import VOCAB, tiny_tokens

pytest.importorskip("llama_cpp", reason="llama-cpp-python is built by scripts/test.sh")

IDS = tiny_tokens(4, 16)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def kquant_model(ffn: int = 512):
    """2 blocks, hidden 256, FFN ``ffn``, 4 heads of 64 (2 KV groups): every input width a
    multiple of 256."""
    from tiny_models import bpe_tokenizer

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=ffn,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=64)
    model = tf.LlamaForCausalLM(cfg).eval()
    return wrap(model, bpe_tokenizer(), spec="tiny-kquant")


def test_dense_widths_of_256_do_not_fall_back(tmp_path):
    rep = write_gguf(kquant_model(), tmp_path / "d.gguf", "q4_k_m")
    assert rep["fallbacks"] == [] and fallbacks(tmp_path / "d.gguf", "q4_k_m") == []
    assert not any("fell back" in n for n in rep["notes"])
    assert {"Q4_K"} <= set(rep["tensor_types"])


def test_widths_rounded_for_the_type_keep_every_weight_in_it(tmp_path):
    rounded = kquant_model(ffn=768)
    prunelab.prune(rounded, Width(unit="ffn", ratio=0.3, gguf_type="q4_k_m"), CALIB)
    widths = [m.up_proj.out_features for m in (b.mlp for b in rounded.model.model.layers)]
    assert widths == [512, 512]  # 768 x 0.7 = 538 -> a multiple of 256
    rep = write_gguf(rounded, tmp_path / "r.gguf", "q4_k_m")
    assert rep["fallbacks"] == []
    plain = kquant_model(ffn=768)
    prunelab.prune(plain, Width(unit="ffn", ratio=0.3), CALIB)  # multiples of 8
    rep = write_gguf(plain, tmp_path / "p.gguf", "q4_k_m")
    names = {f["tensor"] for f in rep["fallbacks"]}
    assert names == {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}
    cols = {f["columns"] for f in rep["fallbacks"]}
    assert cols == {plain.model.model.layers[0].mlp.up_proj.out_features}
    note = next(n for n in rep["notes"] if "fell back" in n)
    assert "blk.*.ffn_down.weight x2" in note and "--gguf-type q4_k_m" in note
    assert note == fallback_note(rep["fallbacks"], "q4_k_m")


def test_gguf_type_is_checked_and_rounds_with_round_to():
    assert Width(unit="ffn", ratio=0.2, gguf_type="q8_0").round_to == 32
    assert Width(unit="ffn", ratio=0.2, round_to=96, gguf_type="q4_k_m").round_to == 768
    with pytest.raises(ConfigError, match="gguf_type must be one of"):
        Width(unit="ffn", ratio=0.2, gguf_type="q9_k")


def test_an_importance_matrix_reaches_the_quantizer(tmp_path):
    lm = kquant_model()
    write_gguf(lm, tmp_path / "f16.gguf", "f16")
    im = collect_imatrix(lm, IDS)
    quantize_gguf(tmp_path / "f16.gguf", tmp_path / "plain.gguf", "q3_k_m")
    quantize_gguf(tmp_path / "f16.gguf", tmp_path / "im.gguf", "q3_k_m", imatrix=im)
    path = write_imatrix(tmp_path / "m.imatrix", im)
    quantize_gguf(tmp_path / "f16.gguf", tmp_path / "file.gguf", "q3_k_m", imatrix=path)
    a, b, c = ((tmp_path / n).read_bytes() for n in ("plain.gguf", "im.gguf", "file.gguf"))
    assert len(a) == len(b) and a != b  # same types, other roundings
    assert b == c  # the file and the object give the same quantization
    # an IQ type llama.cpp refuses without one
    with pytest.raises(ConfigError, match="needs an importance matrix"):
        quantize_gguf(tmp_path / "f16.gguf", tmp_path / "iq.gguf", "iq2_xxs")
    quantize_gguf(tmp_path / "f16.gguf", tmp_path / "iq.gguf", "iq2_xxs", imatrix=im)
    assert (tmp_path / "iq.gguf").stat().st_size < len(a)
    # a matrix made for another model: refused before llama.cpp, in one line
    bad = IMatrix(sums={k: np.ones(3) for k in im.sums}, counts=dict(im.counts))
    with pytest.raises(ConfigError, match="has 3 values, the weight 256 columns"):
        quantize_gguf(tmp_path / "f16.gguf", tmp_path / "bad.gguf", "q3_k_m", imatrix=bad)
    other = IMatrix(sums={"blk.9.attn_q.weight": np.ones(256)},
                    counts={"blk.9.attn_q.weight": 1})
    with pytest.raises(ConfigError, match="names none of"):
        quantize_gguf(tmp_path / "f16.gguf", tmp_path / "bad.gguf", "q3_k_m", imatrix=other)
    assert not (tmp_path / "bad.gguf").exists()
