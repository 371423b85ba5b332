"""GGUF export (:mod:`prunelab.checkpoint.gguf_export`): files that transformers' own GGUF
reader loads back to identical logits (float32), the rotary row order by hand, the output
types as the ``gguf`` reader sees them, and one-line refusals that leave no file."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers as tf

import prunelab
from prunelab import Depth, Width
from prunelab.checkpoint.gguf_export import plan_gguf, write_gguf
from prunelab.data import TokenBatches
from prunelab.errors import UnsupportedOperationError
from prunelab.models.gguf_llama import interleave_rope_rows
from prunelab.models.loading import wrap

from tiny_models import VOCAB, bpe_tokenizer, save_tiny_checkpoint, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def loaded(arch="llama"):
    return wrap(tiny_model(arch), bpe_tokenizer(), spec=f"tiny-{arch}")


def reload_logits(path, ids=IDS):
    model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits, model


def logits(lm, ids=IDS):
    with torch.no_grad():
        return lm.model(input_ids=ids, use_cache=False).logits


def test_rope_rows_interleave_the_two_halves_of_each_head():
    # one head of 4 rows (d/2 = 2): halves (r0, r1 | r2, r3) -> pairs (r0, r2, r1, r3)
    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    assert interleave_rope_rows(w, 1)[:, 0].tolist() == [0, 4, 2, 6]
    # two heads: each head reordered in place
    w = np.arange(8, dtype=np.float32)
    assert interleave_rope_rows(w, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_f32_file_reloads_with_identical_logits(arch, tmp_path):
    lm = loaded(arch)
    if arch == "qwen2":  # attention biases: stored float32, never reordered
        assert lm.model.model.layers[0].self_attn.q_proj.bias is not None
    rep = write_gguf(lm, tmp_path / "m.gguf", "f32")
    assert rep["arch"] == ("qwen2" if arch == "qwen2" else "llama") and rep["blocks"] == 4
    assert rep["tokenizer"] == "built from tokenizer.json"
    got, again = reload_logits(tmp_path / "m.gguf")
    assert torch.equal(got, logits(lm))
    # the tokenizer keys describe the same vocabulary
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == VOCAB and tokens[65] == "A" and tokens[128] == "<s>"
    assert reader.fields["tokenizer.ggml.bos_token_id"].contents() == 128
    assert reader.fields["general.architecture"].contents() == rep["arch"]


def test_depth_and_uniform_width_results_keep_their_architecture(tmp_path):
    lm = loaded()
    prunelab.prune(lm, Depth(remove=1, recovery="foldable"), CALIB, batch_size=2)
    rep = write_gguf(lm, tmp_path / "d.gguf", "f32", operations=lm.history)
    got, again = reload_logits(tmp_path / "d.gguf")
    assert rep["blocks"] == 3 and again.config.num_hidden_layers == 3
    assert torch.equal(got, logits(lm))
    ops = json.loads(gguf.GGUFReader(tmp_path / "d.gguf")
                     .fields["prunelab.operations"].contents())
    assert ops[-1]["operation"] == "prune-depth"

    lm = loaded()
    prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.25, allocation="uniform",
                             round_to=4), CALIB, batch_size=2)
    widths = {b.mlp.up_proj.out_features for b in lm.model.model.layers}
    assert len(widths) == 1 and widths.pop() == 36  # 48 less a quarter, every block
    write_gguf(lm, tmp_path / "w.gguf", "f32")
    got, again = reload_logits(tmp_path / "w.gguf")
    assert again.config.intermediate_size == 36
    assert torch.equal(got, logits(lm))


@pytest.mark.parametrize("out_type,ggml", [("f16", "F16"), ("bf16", "BF16")])
def test_half_types_hold_the_rounded_weights(out_type, ggml, tmp_path):
    lm = loaded()
    write_gguf(lm, tmp_path / "h.gguf", out_type)
    reader = gguf.GGUFReader(tmp_path / "h.gguf")
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.ffn_up.weight"] == ggml and kinds["token_embd.weight"] == ggml
    assert kinds["blk.0.attn_norm.weight"] == "F32"  # 1-D tensors stay float32
    assert "output.weight" in kinds  # the tiny llama does not tie its head
    up = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    want = lm.model.model.layers[0].mlp.up_proj.weight.detach()
    half = torch.float16 if out_type == "f16" else torch.bfloat16
    got = torch.from_numpy(gguf.dequantize(up.data, up.tensor_type).copy()).reshape(want.shape)
    assert torch.equal(got, want.to(half).float())
    dense, _ = reload_logits(tmp_path / "h.gguf")
    assert (dense - logits(lm)).abs().max() < 0.05


def test_per_block_widths_and_removed_sublayers_plan_deci():
    lm = loaded()
    prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.25, allocation="global"),
                   CALIB, batch_size=2)
    assert [b.mlp.up_proj.out_features for b in lm.model.model.layers] == [32, 32, 40, 32]
    plan = plan_gguf(lm.model)
    assert plan.arch == "deci" and plan.ffn == (32, 32, 40, 32)
    assert plan.heads == (4,) * 4 and plan.kv_heads == (2,) * 4
    # sublayers removed: block 1 without attention, block 2 without MLP
    from prunelab.models.sublayer import remove_sublayers

    lm = loaded()
    remove_sublayers(lm, [(1, "attention"), (2, "mlp")])
    plan = plan_gguf(lm.model)
    assert plan.arch == "deci" and plan.heads == (4, 0, 4, 4) and plan.kv_heads == (2, 0, 2, 2)
    # attention kept, MLP gone: a 1-channel FFN of zeros (llama.cpp's deci graph drops a
    # block's attention output when its FFN width is 0)
    assert plan.ffn == (48, 48, 1, 48)
    names = {t[0]: t for t in plan.tensors}
    assert "blk.1.attn_q.weight" not in names and "blk.1.attn_norm.weight" not in names
    assert names["blk.2.ffn_down.weight"][3] == ("zeros", (32, 1))
    assert names["blk.2.ffn_norm.weight"][3] == ("ones", (32,))
    # other families keep to uniform shapes
    lm = loaded("qwen2")
    prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.25, allocation="global"),
                   CALIB, batch_size=2)
    with pytest.raises(UnsupportedOperationError, match="qwen2 model .*--allocation uniform"):
        plan_gguf(lm.model)


def test_refusals_name_the_reason():
    lm = loaded()
    prunelab.prune(lm, Depth(remove=1, recovery="ghost"), CALIB, batch_size=2)
    with pytest.raises(UnsupportedOperationError, match="linear bridges"):
        plan_gguf(lm.model)
    with pytest.raises(UnsupportedOperationError, match="phi3 models are not written"):
        plan_gguf(tiny_model("phi3"))


def test_cli_writes_a_file_and_refuses_in_one_line(tmp_path, capsys):
    from prunelab.cli import cli_main

    ckpt = save_tiny_checkpoint("llama", tmp_path / "tiny")
    bpe_tokenizer().save_pretrained(ckpt)
    out = tmp_path / "tiny.gguf"
    assert cli_main(["--quiet", "export", "--model", str(ckpt), "--format", "gguf",
                     "--outtype", "f32", "--out", str(out)]) == 0
    got, _ = reload_logits(out)
    with torch.no_grad():
        want = tf.AutoModelForCausalLM.from_pretrained(
            ckpt, attn_implementation="eager")(input_ids=IDS, use_cache=False).logits
    assert torch.equal(got, want)
    before = out.read_bytes()
    for args, msg in ((["--out", str(out)], "exists"),
                      (["--out", str(tmp_path / "x.bin")], "must end in .gguf"),
                      (["--out", str(tmp_path / "y.gguf"), "--outtype", "q4"], "f32 | f16"),
                      (["--out", str(tmp_path / "y.gguf"), "--budget", "keep-units:0.5"],
                       "--budget cuts an elastic")):
        capsys.readouterr()
        rc = cli_main(["--quiet", "export", "--model", str(ckpt), "--format", "gguf", *args])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert rc == 2 and len(err) == 1 and msg in err[0], (args, err)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny", "tiny.gguf"]


def test_cli_refusal_leaves_no_file(tmp_path, capsys):
    from prunelab.cli import cli_main

    ckpt = save_tiny_checkpoint("gemma3_text", tmp_path / "g")
    rc = cli_main(["--quiet", "export", "--model", str(ckpt), "--format", "gguf", "--out",
                   str(tmp_path / "g.gguf")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: GGUF export:"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]


def test_quantized_type_without_llama_cpp_is_one_line_before_loading(tmp_path, capsys,
                                                                    monkeypatch):
    import sys

    from prunelab.cli import cli_main

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    model = tmp_path / "ckpt"
    model.mkdir()  # exists, but holds no checkpoint: loading it would fail otherwise
    rc = cli_main(["--quiet", "export", "--model", str(model), "--format",
                   "gguf", "--outtype", "q8_0", "--out", str(tmp_path / "q.gguf")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    # refused before the model is loaded
    assert rc == 2 and len(err) == 1 and "llama-cpp-python" in err[0], err
    # a --model that names nothing is said first (the user's own mistake)
    rc = cli_main(["--quiet", "export", "--model", str(tmp_path / "nowhere"), "--format",
                   "gguf", "--outtype", "q8_0", "--out", str(tmp_path / "q.gguf")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "does not exist" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_gemma3_plan_names_norms_and_refusals():
    import dataclasses

    model = tiny_model("gemma3_text")
    plan = plan_gguf(model)
    assert plan.arch == "gemma3" and plan.uniform
    names = {t[0]: t for t in plan.tensors}
    for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "attn_q_norm",
              "attn_k_norm"):
        assert f"blk.0.{n}.weight" in names, n
    assert all(t[2] == 0 for t in plan.tensors)  # NEOX rotary: no row reorder
    from prunelab.checkpoint.gguf_export import _check_gemma3, _sliding

    assert _sliding(model) == [b.self_attn.is_sliding for b in model.model.layers]
    cfg = dataclasses.replace(model.config) if dataclasses.is_dataclass(model.config) \
        else model.config
    cfg.query_pre_attn_scalar = cfg.head_dim * 2
    with pytest.raises(UnsupportedOperationError, match="query_pre_attn_scalar"):
        _check_gemma3(cfg)
    cfg.query_pre_attn_scalar = cfg.head_dim
    cfg.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedOperationError, match="soft-capping"):
        _check_gemma3(cfg)
    # removed sublayers have no gemma3 form
    from prunelab.models.sublayer import remove_sublayers

    lm = wrap(tiny_model("gemma3_text"), None, spec="tiny-gemma")
    remove_sublayers(lm, [(1, "mlp")])
    with pytest.raises(UnsupportedOperationError, match="gemma3_text model .*uniform"):
        plan_gguf(lm.model)
