"""The tensor-by-tensor GGUF converter (``prunelab.models.gguf_stream``) writes the very
tensors, config and tokenizer of the whole-model path (transformers ``from_pretrained``
+ ``save_pretrained``), in shards with an index, one tensor in memory at a time; a streamed
load reads from those shards. The GGUF files are written here from tiny random models."""

from __future__ import annotations

import json
import weakref

import numpy as np
import pytest
import torch
from safetensors import safe_open

import prunelab
from prunelab.data.batches import TokenBatches
from prunelab.io import shard_writer
from prunelab.models import gguf_stream, loading

from tiny_models import VOCAB, tiny_model, tiny_tokens

gguf = pytest.importorskip("gguf")
Q8 = gguf.GGMLQuantizationType.Q8_0
F16 = gguf.GGMLQuantizationType.F16


def _tokens() -> tuple[list[str], list[str]]:
    """A byte-level vocabulary of ``VOCAB`` tokens: 130 single symbols and one merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())[:VOCAB - 1]
    return chars + [chars[0] + chars[1]], [f"{chars[0]} {chars[1]}"]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    mod, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{_NAMES[mod]}.{suffix}"


def write_tiny_gguf(path, arch: str, untied: bool):
    """Write a tiny ``arch`` (llama / qwen2) model as GGUF: 2-D weights with 32 input
    features in Q8_0, the LM head (``untied``) in F16, the rest F32, q/k rows in llama.cpp
    order for llama. Returns the HF state dict the file encodes."""
    model = tiny_model(arch)
    cfg = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if untied:
        sd["lm_head.weight"] = np.random.default_rng(3).standard_normal(
            (VOCAB, cfg.hidden_size)).astype(np.float32)
    else:
        sd.pop("lm_head.weight", None)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    tokens, merges = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(128)
    w.add_eos_token_id(129)
    for hf, arr in sd.items():
        data = arr
        if arch == "llama" and ".q_proj." in hf:
            data = _permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            data = _permute(arr, cfg.num_key_value_heads)
        if hf == "lm_head.weight":
            w.add_tensor(_gguf_name(hf), data.astype(np.float16), raw_dtype=F16)
        elif data.ndim == 2 and data.shape[1] == 32:
            w.add_tensor(_gguf_name(hf), gguf.quants.quantize(data, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(_gguf_name(hf), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def _read_all(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    out = {}
    for f in files:
        with safe_open(folder / f, "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _old_path(gguf_path, monkeypatch):
    """The whole-model conversion (transformers loads the GGUF, then save_pretrained)."""
    with monkeypatch.context() as m:
        m.setattr(gguf_stream, "convert_gguf_streamed", lambda *a, **k: False)
        return loading.convert_gguf(gguf_path, name="old")


@pytest.mark.parametrize("arch,untied", [("llama", False), ("qwen2", True)])
def test_streamed_conversion_equals_whole_model_path(tmp_path, monkeypatch, arch, untied):
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    encoded = write_tiny_gguf(path, arch, untied)
    old = _old_path(path, monkeypatch)
    new = tmp_path / "new"
    assert gguf_stream.convert_gguf_streamed(path, new, max_shard_bytes=20_000)
    a, b = _read_all(old), _read_all(new)
    assert sorted(a) == sorted(b)
    assert ("lm_head.weight" in b) is untied
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), k
    # F32 tensors come back bit for bit (q/k un-permuted); Q8_0 ones within its step
    for k, v in encoded.items():
        got = b[k].numpy()
        if v.ndim == 1 or v.shape[1] != 32 and k != "lm_head.weight":
            assert np.array_equal(got, v), k
        else:
            assert np.abs(got - v).max() <= np.abs(v).max() / 100, k
    shards = sorted(p.name for p in new.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for f in ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json"):
        assert (old / f).read_text() == (new / f).read_text(), f


def test_one_tensor_in_memory_at_a_time(tmp_path, monkeypatch):
    """Each produced tensor is freed (refcount) before the next is de-quantized."""
    path = tmp_path / "m.gguf"
    encoded = write_tiny_gguf(path, "qwen2", untied=True)
    plan = gguf_stream.plan_gguf(path)
    produce = gguf_stream._produce(plan)
    previous: list[weakref.ref] = []
    alive_at_produce: list[bool] = []

    def tracking(spec):
        alive_at_produce.append(bool(previous) and previous[-1]() is not None)
        t = produce(spec)
        previous.append(weakref.ref(t))
        return t

    (tmp_path / "out").mkdir()
    shard_writer.write_sharded(tmp_path / "out", plan.specs, tracking, 10**9)
    assert len(alive_at_produce) == len(plan.specs) == len(encoded) == 4 * 12 + 3
    assert not any(alive_at_produce)


def test_plan_shards_keeps_order_and_limit():
    specs = [shard_writer.TensorSpec(f"t{i}", (n,)) for i, n in enumerate([3, 3, 10, 1, 1])]
    groups = shard_writer.plan_shards(specs, max_bytes=24)
    assert [[s.name for s in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_chunked_dequantize_equals_gguf_dequantize(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", untied=False)
    monkeypatch.setattr(gguf_stream, "CHUNK_BYTES", 3 * 32 * 4)  # 3 rows per step
    plan = gguf_stream.plan_gguf(path)
    by_name = {t.name: t for t in plan.sources.values()}
    reader = gguf.GGUFReader(str(path))
    assert sorted(by_name) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        got = gguf_stream.dequantize_tensor(path, by_name[t.name])
        assert np.array_equal(got, gguf.dequantize(t.data, t.tensor_type)), t.name


def test_load_stream_reads_the_converted_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen2", untied=True)
    lm = prunelab.load(str(path), stream=True)
    src = tmp_path / "cache" / "converted"
    (folder,) = list(src.iterdir())
    assert lm.source == str(folder) and (folder / "model.safetensors.index.json").is_file()
    assert not (folder / "model.safetensors").exists()
    ids = tiny_tokens(2, 10)
    data = TokenBatches(input_ids=ids, spec="t", seqlen=10, samples=2, seed=0, mode="test",
                        total_windows=2, sha256="0")
    resident = prunelab.load(str(_old_path(path, monkeypatch)))
    assert prunelab.evaluate(lm, data, batch_size=2)["perplexity"] == prunelab.evaluate(
        resident, data, batch_size=2)["perplexity"]
