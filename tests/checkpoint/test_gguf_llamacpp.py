"""GGUF exports run inside llama.cpp (``llama-cpp-python``, built by the test command) and
give the log-probabilities of prunelab's own forward: tiny uniform and ``deci`` models in
the default run, SmolLM2 and Qwen2.5-Coder 0.5B (dense, depth, per-block widths, removed
sublayers) in the slow run."""

from __future__ import annotations

import pytest

import prunelab
from prunelab import Depth, Width
from prunelab.checkpoint.gguf_export import write_gguf
from prunelab.data import TokenBatches
from prunelab.eval.llamacpp import compare_with_llamacpp
from prunelab.models.loading import wrap
from prunelab.models.sublayer import remove_sublayers
from prunelab.pruning.factor.slicing import SliceGPT

from tiny_models import tiny_model, tiny_tokens

pytest.importorskip("llama_cpp", reason="llama-cpp-python is built by scripts/test.sh")

IDS = tiny_tokens(4, 12)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def _tiny(arch="llama"):
    from tiny_models import bpe_tokenizer

    return wrap(tiny_model(arch), bpe_tokenizer(), spec=f"tiny-{arch}")


def _global_width(lm):
    prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.25, allocation="global"),
                   CALIB, batch_size=2)
    return lm


CASES = {
    "llama": lambda: _tiny(),
    "qwen2": lambda: _tiny("qwen2"),
    "depth": lambda: _depth(_tiny()),
    "deci-widths": lambda: _global_width(_tiny()),
    "deci-sublayers": lambda: _sublayers(_tiny()),
    "deci-heads": lambda: _global_heads(_tiny()),
    "sliced-tied-gguf-only": lambda: _sliced_tied(),
    "qwen2-sliced": lambda: _sliced_qwen2(),
}


def _sliced_qwen2():
    """A Qwen2 whose hidden size no longer equals heads x head size: llama.cpp's qwen2
    refuses its attention shapes, so it is written as llama (rotary rows and q / k biases
    reordered)."""
    lm = _tiny("qwen2")
    prunelab.prune(lm, SliceGPT(rotation="global", ratio=0.25, multiple=4), CALIB,
                   batch_size=2)
    assert lm.model.config.hidden_size == 24
    assert lm.model.model.layers[0].self_attn.q_proj.bias is not None
    return lm


def _sliced_tied():
    """Hidden 24 with 3 heads of 8 sliced to 16 (a size Llama's config refuses), the head
    kept tied: llama.cpp reads the head size from the file and the embeddings as the head."""
    from tiny_models import bpe_tokenizer, tiny_tied_model

    lm = wrap(tiny_tied_model(heads=3, hidden=24), bpe_tokenizer(), spec="tiny-tied")
    prunelab.prune(lm, SliceGPT(rotation="global", ratio=1 / 3, multiple=8, keep_tied=True,
                                gguf_only=True), CALIB, batch_size=2)
    assert lm.model.config.hidden_size == 16
    return lm


def _global_heads(lm):
    prunelab.prune(lm, Width(unit="heads", score="wanda-sp", ratio=0.3,
                             allocation="global"), CALIB, batch_size=2)
    heads = [b.self_attn.q_proj.out_features for b in lm.model.model.layers]
    assert len(set(heads)) > 1, heads  # per-block query heads
    return lm


def _depth(lm):
    prunelab.prune(lm, Depth(remove=1, recovery="foldable"), CALIB, batch_size=2)
    return lm


def _sublayers(lm):
    remove_sublayers(lm, [(1, "attention"), (2, "mlp")])
    return lm


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_exports_agree_with_prunelab_inside_llamacpp(case, tmp_path):
    lm = CASES[case]()
    rep = write_gguf(lm, tmp_path / "m.gguf", "f32")
    assert rep["arch"] == ("deci" if case.startswith("deci") else
                           "qwen2" if case == "qwen2" else "llama")
    got = compare_with_llamacpp(lm, tmp_path / "m.gguf", tiny_tokens(3, 16, seed=5),
                                threads=1)
    assert got["max_abs_logprob_diff"] < 1e-3, got
    assert got["perplexity_rel_diff"] < 1e-4, got
    if rep["arch"] == "deci":  # and prunelab reads the file back to the same logits
        import torch

        back = prunelab.load(str(tmp_path / "m.gguf"))
        with torch.no_grad():
            a = lm.model(input_ids=IDS, use_cache=False).logits
            b = back.model(input_ids=IDS, use_cache=False).logits
        assert (a - b).abs().max() < 1e-4


def _real_windows(lm, n=4, seqlen=128):
    from prunelab.data import make_batches

    return make_batches(lm.tokenizer, "wiki-vital:test", seqlen=seqlen, samples=n,
                        mode="test").input_ids


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dense", "depth", "widths", "sublayers"])
def test_smollm2_exports_match_prunelab_perplexity_inside_llamacpp(case, tmp_path):
    lm = prunelab.load("smollm2-135m")
    calib = "wiki-vital:calib"
    if case == "depth":
        prunelab.prune(lm, Depth(remove=6, recovery="foldable"), calib, samples=8, seqlen=128)
    elif case == "widths":
        prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.2, allocation="global"),
                       calib, samples=8, seqlen=128)
    elif case == "sublayers":
        remove_sublayers(lm, [(3, "attention"), (7, "mlp"), (12, "attention"), (20, "mlp")])
    windows = _real_windows(lm)
    rep = write_gguf(lm, tmp_path / "f32.gguf", "f32")
    assert rep["arch"] == ("deci" if case in ("widths", "sublayers") else "llama")
    got = compare_with_llamacpp(lm, tmp_path / "f32.gguf", windows, threads=2)
    assert got["perplexity_rel_diff"] < 0.005, got
    assert got["max_abs_target_logprob_diff"] < 0.05, got
    assert got["mean_abs_logprob_diff"] < 0.01, got
    if rep["arch"] == "deci":  # prunelab reads its deci file back: same logits, same tokens
        import torch

        back = prunelab.load(str(tmp_path / "f32.gguf"))
        text = "Pruning removes 12.5% of the weights; does the model notice?"
        assert back.tokenizer(text).input_ids == lm.tokenizer(text).input_ids
        with torch.no_grad():
            a = lm.model(input_ids=windows[:2], use_cache=False).logits
            b = back.model(input_ids=windows[:2], use_cache=False).logits
        assert (a - b).abs().max() < 1e-3
    write_gguf(lm, tmp_path / "f16.gguf", "f16")
    got = compare_with_llamacpp(lm, tmp_path / "f16.gguf", windows, threads=2)
    assert got["perplexity_rel_diff"] < 0.01, got


@pytest.mark.slow
def test_qwen_depth_pruned_export_matches_inside_llamacpp(tmp_path):
    lm = prunelab.load("qwen2.5-coder-0.5b")
    prunelab.prune(lm, Depth(remove=4, recovery="foldable"), "wiki-vital:calib", samples=8,
                   seqlen=128)
    rep = write_gguf(lm, tmp_path / "q.gguf", "f32")
    assert rep["arch"] == "qwen2" and rep["blocks"] == 20
    got = compare_with_llamacpp(lm, tmp_path / "q.gguf", _real_windows(lm, 2), threads=2)
    assert got["perplexity_rel_diff"] < 0.005, got


@pytest.mark.parametrize("out_type", ["q8_0", "q4_k_m"])
def test_quantized_types_come_from_llamacpps_quantizer(out_type, tmp_path):
    import gguf
    import torch

    from prunelab.checkpoint.gguf_export import tensor_types

    lm = _sublayers(_tiny())  # deci
    rep = write_gguf(lm, tmp_path / "q.gguf", out_type)
    types = tensor_types(tmp_path / "q.gguf")
    assert rep["tensor_types"] == types and rep["out_type"] == out_type
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]  # no intermediate left
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    by_name = {t.name: t.tensor_type.name for t in reader.tensors}
    if out_type == "q8_0":
        # rows of 32 values quantize; ffn_down's rows hold 48 (not a multiple of 32): f16
        assert by_name["blk.0.attn_q.weight"] == "Q8_0"
        assert by_name["blk.0.ffn_down.weight"] == "F16"
    else:  # every row is shorter than a k-quant block of 256: all fall back
        assert not {"Q4_K", "Q5_K", "Q6_K"} & set(types)
    assert by_name["blk.0.attn_norm.weight"] == "F32"
    assert any("fell back" in n for n in rep["notes"])
    # llama.cpp runs it; prunelab reads it back (deci reader, de-quantized by gguf)
    got = compare_with_llamacpp(lm, tmp_path / "q.gguf", tiny_tokens(2, 16, seed=5),
                                threads=1)
    assert got["perplexity_rel_diff"] < 0.05, got
    back = prunelab.load(str(tmp_path / "q.gguf"))
    with torch.no_grad():
        diff = (back.model(input_ids=IDS, use_cache=False).logits
                - lm.model(input_ids=IDS, use_cache=False).logits).abs().max()
    assert 0 < diff < 0.2


def test_cli_writes_q8_0_and_names_the_tensor_types(tmp_path, capsys):
    from prunelab.cli import cli_main

    from tiny_models import bpe_tokenizer, save_tiny_checkpoint

    ckpt = save_tiny_checkpoint("llama", tmp_path / "tiny")
    bpe_tokenizer().save_pretrained(ckpt)
    out = tmp_path / "t.gguf"
    assert cli_main(["export", "--model", str(ckpt), "--format", "gguf", "--outtype", "q8_0",
                     "--out", str(out)]) == 0
    text = capsys.readouterr()
    assert "q8_0 (" in text.out and "Q8_0" in text.out, text.out
    # the 48-value rows of ffn_down, named
    assert "blk.*.ffn_down.weight x4 (48 columns) -> F16" in text.err, text.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf", "tiny"]


@pytest.mark.slow
def test_gemma3_depth_pruned_export_keeps_its_sliding_pattern_inside_llamacpp(tmp_path):
    """Gemma 3 in its own architecture: norms stored plus one, no rotary reorder, and the
    per-block sliding-window pattern, which a depth-pruned stack changes (block 9 of the
    15 left is global where llama.cpp's default pattern would make it sliding: the rotary
    bases differ, so a wrong pattern shows in the log-probabilities)."""
    import gguf
    import torch

    lm = prunelab.load("gemma3-270m")
    windows = _real_windows(lm, 2)
    prunelab.prune(lm, Depth(remove=3, recovery="none", bootstrap=0), "wiki-vital:calib",
                   samples=4, seqlen=64)
    sliding = [b.self_attn.is_sliding for b in lm.model.model.layers]
    assert len(sliding) == 15 and sliding != [(i + 1) % 6 != 0 for i in range(15)]
    rep = write_gguf(lm, tmp_path / "g.gguf", "f32")
    assert rep["arch"] == "gemma3" and rep["tokenizer"] == "copied from gemma3-270m.gguf"
    field = gguf.GGUFReader(tmp_path / "g.gguf").fields
    assert list(field["gemma3.attention.sliding_window_pattern"].contents()) == sliding
    got = compare_with_llamacpp(lm, tmp_path / "g.gguf", windows, threads=2)
    assert got["perplexity_rel_diff"] < 0.005, got
    assert got["max_abs_target_logprob_diff"] < 0.05, got
    # read back by prunelab (transformers' reader plus the pattern): the same logits
    back = prunelab.load(str(tmp_path / "g.gguf"))
    assert [b.self_attn.is_sliding for b in back.model.model.layers] == sliding
    with torch.no_grad():
        a = lm.model(input_ids=windows[:1], use_cache=False).logits
        b = back.model(input_ids=windows[:1], use_cache=False).logits
    assert (a - b).abs().max() < 1e-3
