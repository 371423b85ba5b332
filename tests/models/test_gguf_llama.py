"""Reading llama.cpp's ``deci`` GGUF files (:mod:`prunelab.models.gguf_llama`): the rotary
row order by hand, per-block widths and removed sublayers read back to the logits of the
model that was written, the reloaded model saves and reloads like any pruned model, and
one-line refusals for what a Llama block cannot express."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

import prunelab
from prunelab import Width
from prunelab.checkpoint.gguf_export import write_gguf
from prunelab.data import TokenBatches
from prunelab.errors import UnsupportedOperationError
from prunelab.models.gguf_llama import interleave_rope_rows, read_deci_layout, split_rope_rows
from prunelab.models.loading import wrap
from prunelab.models.sublayer import SkippedAttention, SkippedMLP, remove_sublayers

from tiny_models import tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def _tiny():
    from checkpoint.test_gguf_export import bpe_tokenizer

    return wrap(tiny_model("llama"), bpe_tokenizer(), spec="tiny-llama")


def _logits(model, ids=IDS):
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_split_rope_rows_undoes_the_interleave():
    # one head of 4 rows: llama.cpp pairs (r0, r2, r1, r3) -> halves (r0, r1 | r2, r3)
    w = np.array([0, 2, 1, 3], dtype=np.float32)
    assert split_rope_rows(w, 1).tolist() == [0, 1, 2, 3]
    w = np.random.default_rng(0).standard_normal((24, 5)).astype(np.float32)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(split_rope_rows(interleave_rope_rows(w, heads), heads), w)


def test_per_block_widths_read_back_to_identical_logits(tmp_path):
    lm = _tiny()
    prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.25, allocation="global"),
                   CALIB, batch_size=2)
    ops = [{"operation": "width", "method": "wanda-sp"}]
    write_gguf(lm, tmp_path / "w.gguf", "f32", operations=ops)
    lay = read_deci_layout(tmp_path / "w.gguf")
    assert lay["ffn"] == [32, 32, 40, 32] and lay["heads"] == [4] * 4 and lay["tied"] is False
    back = prunelab.load(str(tmp_path / "w.gguf"))
    assert [b.mlp.up_proj.out_features for b in back.model.model.layers] == [32, 32, 40, 32]
    assert torch.equal(_logits(back.model), _logits(lm.model))
    assert back.history == ops  # the operations the file records
    # it saves like any per-block-width model and reloads to the same logits
    prunelab.save(back, tmp_path / "ckpt")
    again = prunelab.load(str(tmp_path / "ckpt"), trust_remote_code=True)
    assert torch.equal(_logits(again.model), _logits(lm.model))


def test_removed_sublayers_read_back_as_removed(tmp_path):
    lm = _tiny()
    # block 1 loses its attention, block 2 its MLP (written as a zero 1-channel FFN),
    # block 3 both (deleted by prunelab before writing)
    remove_sublayers(lm, [(1, "attention"), (2, "mlp"), (3, "attention"), (3, "mlp")])
    assert len(lm.model.model.layers) == 3
    write_gguf(lm, tmp_path / "s.gguf", "f32")
    assert read_deci_layout(tmp_path / "s.gguf")["ffn"] == [48, 48, 1]
    back = prunelab.load(str(tmp_path / "s.gguf"))
    layers = back.model.model.layers
    assert isinstance(layers[1].self_attn, SkippedAttention)
    assert isinstance(layers[2].mlp, SkippedMLP)  # the zero FFN is a removed FFN again
    assert torch.equal(_logits(back.model), _logits(lm.model))
    # generation with a KV cache runs through the removed attention
    out = back.model.generate(IDS[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_f16_file_reads_within_half_precision(tmp_path):
    lm = _tiny()
    prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.25, allocation="global"),
                   CALIB, batch_size=2)
    write_gguf(lm, tmp_path / "h.gguf", "f16")
    back = prunelab.load(str(tmp_path / "h.gguf"))
    diff = (_logits(back.model) - _logits(lm.model)).abs().max().item()
    assert 0 < diff < 0.01


def _hand_deci(path, heads, kv, ffn, d=8, hd=4, extra=None):
    """A deci file written by hand with the gguf writer: random weights of the given
    per-block widths (a tied head)."""
    w = gguf.GGUFWriter(str(path), "deci")
    n = len(ffn)
    w.add_block_count(n)
    w.add_embedding_length(d)
    w.add_feed_forward_length(list(ffn))
    w.add_head_count(list(heads))
    w.add_head_count_kv(list(kv))
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-5)
    for k, v in (extra or {}).items():
        w.add_string(k, v)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, d)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(n):
        if heads[i]:
            w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
            for name, rows in (("attn_q", heads[i] * hd), ("attn_k", kv[i] * hd),
                               ("attn_v", kv[i] * hd)):
                w.add_tensor(f"blk.{i}.{name}.weight",
                             rng.standard_normal((max(rows, 1), d)).astype(np.float32))
            w.add_tensor(f"blk.{i}.attn_output.weight",
                         rng.standard_normal((d, heads[i] * hd)).astype(np.float32))
        if ffn[i]:
            w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
            for name, shape in (("ffn_gate", (ffn[i], d)), ("ffn_up", (ffn[i], d)),
                                ("ffn_down", (d, ffn[i]))):
                w.add_tensor(f"blk.{i}.{name}.weight",
                             rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_hand_written_deci_file_gets_each_blocks_widths(tmp_path):
    from prunelab.errors import CorruptCheckpointError
    from prunelab.models.gguf_llama import load_deci

    _hand_deci(tmp_path / "h.gguf", heads=[2, 4, 0], kv=[1, 2, 0], ffn=[6, 0, 10])
    lay = read_deci_layout(tmp_path / "h.gguf")
    assert (lay["heads"], lay["kv_heads"], lay["ffn"], lay["tied"]) == (
        [2, 4, 0], [1, 2, 0], [6, 0, 10], True)
    with pytest.raises(CorruptCheckpointError, match="no usable tokenizer"):
        load_deci(tmp_path / "h.gguf")
    model, tok, ops = load_deci(tmp_path / "h.gguf", tokenizer=False)
    assert tok is None and ops == []
    b = model.model.layers
    assert [b[0].self_attn.q_proj.out_features, b[0].self_attn.k_proj.out_features,
            b[1].self_attn.q_proj.out_features, b[0].mlp.up_proj.out_features,
            b[2].mlp.down_proj.in_features] == [8, 4, 16, 6, 10]
    assert isinstance(b[1].mlp, SkippedMLP) and isinstance(b[2].self_attn, SkippedAttention)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: no output.weight
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("heads,kv,ffn,extra,msg", [
    ([2, 2], [1, 0], [4, 4], None, "linear attention"),
    ([2, 2], [1, 1], [4, 4], {"deci.rope.scaling.type": "yarn"}, "rotary scaling 'yarn'"),
])
def test_what_a_llama_block_cannot_express_is_refused(tmp_path, heads, kv, ffn, extra, msg):
    _hand_deci(tmp_path / "x.gguf", heads, kv, ffn, extra=extra)
    with pytest.raises(UnsupportedOperationError, match=msg):
        read_deci_layout(tmp_path / "x.gguf")


def test_deci_file_is_not_streamed(tmp_path):
    from prunelab.models.loading import convert_gguf

    lm = _tiny()
    remove_sublayers(lm, [(1, "attention")])
    write_gguf(lm, tmp_path / "s.gguf", "f32")
    with pytest.raises(UnsupportedOperationError, match="deci GGUF file .*drop --stream"):
        convert_gguf(tmp_path / "s.gguf")


def test_cli_eval_reads_a_deci_file_like_the_model_it_holds(tmp_path, capsys):
    import json

    from prunelab.cli import cli_main

    lm = _tiny()
    remove_sublayers(lm, [(1, "attention")])
    write_gguf(lm, tmp_path / "s.gguf", "f32")
    prunelab.save(lm, tmp_path / "ckpt")
    got = {}
    for name, spec in (("gguf", tmp_path / "s.gguf"), ("ckpt", tmp_path / "ckpt")):
        out = tmp_path / f"{name}.json"
        rc = cli_main(["--quiet", "eval", "--model", str(spec), "--samples", "2", "--seqlen",
                       "16", "--trust-remote-code", "--json", str(out)])
        assert rc == 0, capsys.readouterr().err
        got[name] = json.loads(out.read_text())
    assert got["gguf"]["perplexity"] == pytest.approx(got["ckpt"]["perplexity"], rel=1e-5)


def _rewrite(src, dst, replace=None, drop=None):
    """A copy of the deci file ``src`` with tensor ``replace[0]`` holding ``replace[1]``
    and tensor ``drop`` left out."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "deci")
    for f in r.fields.values():
        if f.name.startswith("deci."):
            t = f.types
            if t[0] == gguf.GGUFValueType.ARRAY:
                w.add_key_value(f.name, f.contents(), t[0], sub_type=t[-1])
            else:
                w.add_key_value(f.name, f.contents(), t[0])
    for t in r.tensors:
        if t.name != drop:
            data = replace[1] if replace and t.name == replace[0] else np.array(t.data)
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_mis_shaped_or_missing_tensors_are_one_line(tmp_path):
    from prunelab.errors import CorruptCheckpointError
    from prunelab.models.gguf_llama import load_deci

    _hand_deci(tmp_path / "ok.gguf", heads=[2, 2], kv=[1, 1], ffn=[4, 4])
    # block 0 declares 2 heads of 4 but its attn_output holds 4 heads' columns
    _rewrite(tmp_path / "ok.gguf", tmp_path / "shape.gguf",
             replace=("blk.0.attn_output.weight", np.zeros((8, 16), np.float32)))
    with pytest.raises(CorruptCheckpointError, match="shape its block's widths say"):
        load_deci(tmp_path / "shape.gguf", tokenizer=False)
    _rewrite(tmp_path / "ok.gguf", tmp_path / "drop.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(CorruptCheckpointError, match="up_proj"):
        load_deci(tmp_path / "drop.gguf", tokenizer=False)
