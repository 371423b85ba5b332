"""llama.cpp's tensor names (Llama family, Gemma 3), and a reader for its ``deci`` files.

Shared by the GGUF writer (:mod:`prunelab.checkpoint.gguf_export`) and the loader: the
llama.cpp names of a block's tensors (``blk.N.attn_q.weight``...), and the rotary row order
(llama.cpp's ``llama`` / ``deci`` graphs rotate interleaved pairs of each head's dimensions,
Hugging Face Llama its two halves, so ``q`` / ``k`` rows are reordered per head on the way
out and back on the way in).

``deci`` is llama.cpp's architecture for Llama-3.1-Nemotron-51B (NVIDIA's Puzzle / DeciLM
blocks): the same blocks as Llama, with per-block arrays for ``attention.head_count``,
``attention.head_count_kv`` and ``feed_forward_length``; a block with 0 heads has no
attention, a block with FFN length 0 no FFN. ``transformers`` has no reader for it, so
:func:`load_deci` builds the model itself: a Llama model whose blocks get their own
projection shapes and head counts, prunelab's removed-sublayer modules
(:mod:`prunelab.models.sublayer`) where a block has no attention or no FFN (a 1-channel FFN
of zeros, which prunelab writes because llama.cpp's graph drops a block's attention output
when its FFN length is 0, reads back as a removed FFN: both add exactly 0), and every
tensor de-quantized by the ``gguf`` package (any type it reads: f32, f16, bf16, q8_0,
k-quants...). The tokenizer is read from the file's ``tokenizer.*`` keys by transformers.
A model loaded this way saves like any pruned model (per-block widths: remote code).

Refused in one line: Nemotron's "linear attention" blocks (heads without KV heads), rotary
scaling, and any tensor the Llama layout does not name.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from prunelab.errors import ConfigError, CorruptCheckpointError, UnsupportedOperationError
from prunelab.models.adapters import get_adapter
from prunelab.models.custom import install
from prunelab.models.sublayer import SkippedAttention, SkippedMLP, SkippedNorm

#: Hugging Face name inside a block -> llama.cpp name inside ``blk.N``
BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
             "lm_head": "output"}
#: Gemma 3 (llama.cpp's ``gemma3``): four norms per block and q / k norms; llama.cpp's
#: RMS norms multiply by the weight where Gemma's multiply by ``1 + weight``, so every
#: ``*norm.weight`` is stored plus one (the transformers reader subtracts it)
GEMMA3_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def interleave_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's half-split rotary layout -> llama.cpp's interleaved pairs (rows
    reordered within each head; a bias is reordered the same way)."""
    rows = w.shape[0]
    return (w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def split_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`interleave_rope_rows` (llama.cpp -> Hugging Face)."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def require_llama_cpp():
    """The ``llama_cpp`` module (``llama-cpp-python``), or a one-line ConfigError saying how
    to install it (it compiles llama.cpp; the README gives the flags)."""
    try:
        import llama_cpp  # noqa: PLC0415 - optional llama-cpp-python
    except ImportError as exc:
        raise ConfigError("this needs llama-cpp-python: pip install 'prunelab[llamacpp]' (it "
                          "compiles llama.cpp; see the README for the build flags)") from exc
    return llama_cpp


def gguf_architecture(path: str | Path) -> str | None:
    """``general.architecture`` of the GGUF file ``path`` (None when unreadable)."""
    try:
        field = gguf.GGUFReader(path).fields.get("general.architecture")
        return None if field is None else str(field.contents())
    except (ValueError, OSError, KeyError, IndexError, EOFError):
        return None


def _field(fields, key: str, default=None):
    f = fields.get(key)
    return default if f is None else f.contents()


def _per_block(value, n: int, key: str) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n or any(not isinstance(v, int) or v < 0 for v in values):
        raise CorruptCheckpointError(f"deci GGUF: {key} must hold {n} counts >= 0, got "
                                     f"{values[:8]}")
    return [int(v) for v in values]


def read_deci_layout(path: str | Path) -> dict:
    """The hyperparameters of a ``deci`` GGUF file: hidden size, blocks, per-block query
    heads / KV heads / FFN widths, head size, rotary base, norm epsilon, context length,
    tied output head, prunelab's recorded operations (``[]`` when the file has none)."""
    reader = gguf.GGUFReader(path)
    f = reader.fields
    arch = _field(f, "general.architecture")
    if arch != "deci":
        raise UnsupportedOperationError(f"{Path(path).name} is a {arch} GGUF file, not deci")
    n = _field(f, "deci.block_count")
    hidden = _field(f, "deci.embedding_length")
    if not isinstance(n, int) or n < 1 or not isinstance(hidden, int) or hidden < 1:
        raise CorruptCheckpointError(f"deci GGUF {Path(path).name}: block_count / "
                                     "embedding_length missing or not positive")
    heads = _per_block(_field(f, "deci.attention.head_count"), n, "attention.head_count")
    kv = _per_block(_field(f, "deci.attention.head_count_kv", heads), n,
                    "attention.head_count_kv")
    ffn = _per_block(_field(f, "deci.feed_forward_length"), n, "feed_forward_length")
    for i, (h, k) in enumerate(zip(heads, kv, strict=True)):
        if h > 0 and k == 0:
            raise UnsupportedOperationError(
                f"deci GGUF: block {i} has {h} heads and no KV heads (Nemotron's linear "
                "attention), which a Llama block cannot express")
        if h and k and h % k:
            raise CorruptCheckpointError(f"deci GGUF: block {i}: {h} heads are not a "
                                         f"multiple of its {k} KV heads")
    some = next((h for h in heads if h), 0)
    head_dim = _field(f, "deci.attention.key_length", hidden // some if some else 0)
    rope_dim = _field(f, "deci.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedOperationError(f"deci GGUF: rotary over {rope_dim} of {head_dim} "
                                        "head dimensions is not a Llama block")
    scaling = _field(f, "deci.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise UnsupportedOperationError(f"deci GGUF: rotary scaling {scaling!r} is not read "
                                        "yet (only the default)")
    names = {t.name for t in reader.tensors}
    ops = _field(f, "prunelab.operations", "[]")
    try:
        operations = json.loads(ops) if isinstance(ops, str) else []
    except ValueError:
        operations = []
    return {"blocks": n, "hidden": hidden, "heads": heads, "kv_heads": kv, "ffn": ffn,
            "head_dim": int(head_dim),
            "rope_theta": float(_field(f, "deci.rope.freq_base", 10000.0)),
            "rms_eps": float(_field(f, "deci.attention.layer_norm_rms_epsilon", 1e-5)),
            "context": int(_field(f, "deci.context_length", 2048)),
            "tied": "output.weight" not in names, "operations": operations}


def _tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the file, de-quantized to float32, in numpy's (rows, columns) order."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        out[t.name] = np.asarray(gguf.dequantize(t.data, t.tensor_type),
                                 dtype=np.float32).reshape(shape)
    return out


def _hf_name(name: str) -> tuple[int | None, str]:
    """``blk.3.attn_q.weight`` -> ``(3, "self_attn.q_proj.weight")``; top-level names map
    to ``(None, "model.norm.weight")``..."""
    parts = name.split(".")
    if parts[0] == "blk":
        inner = {v: k for k, v in BLOCK_NAMES.items()}.get(parts[2])
        if inner is None:
            raise UnsupportedOperationError(f"deci GGUF: tensor {name} has no Llama name")
        return int(parts[1]), f"{inner}.{parts[-1]}"
    top = {v: k for k, v in TOP_NAMES.items()}.get(".".join(parts[:-1]))
    if top is None:
        raise UnsupportedOperationError(f"deci GGUF: tensor {name} has no Llama name")
    return None, f"{top}.{parts[-1]}"


def load_deci(path: str | Path, dtype: torch.dtype = torch.float32, tokenizer: bool = True):
    """``(model, tokenizer, operations)`` for the ``deci`` GGUF file ``path``: a Hugging
    Face Llama model with each block's own widths (see the module docstring); the
    tokenizer is ``None`` when not asked for."""
    path = Path(path)
    lay = read_deci_layout(path)
    arrays = _tensors(path)
    n, d, hd = lay["blocks"], lay["hidden"], lay["head_dim"]
    per_block: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    top: dict[str, np.ndarray] = {}
    for name, a in arrays.items():
        i, hf = _hf_name(name)
        if i is not None and not 0 <= i < n:
            raise CorruptCheckpointError(f"deci GGUF: tensor {name} beyond {n} blocks")
        (top if i is None else per_block[i])[hf] = a
    if "model.embed_tokens.weight" not in top:
        raise CorruptCheckpointError(f"deci GGUF {path.name}: no token_embd.weight")
    vocab = top["model.embed_tokens.weight"].shape[0]
    heads, kv, ffn = lay["heads"], lay["kv_heads"], lay["ffn"]
    # a 1-channel FFN of zeros is a removed FFN (exactly: both add 0)
    for i, f in enumerate(ffn):
        w = per_block[i]
        if f == 1 and all(not np.any(w.get(f"mlp.{p}_proj.weight", 1.0))
                          for p in ("gate", "up", "down")):
            ffn[i] = 0
            for p in ("gate", "up", "down"):
                w.pop(f"mlp.{p}_proj.weight", None)
            w.pop("post_attention_layernorm.weight", None)
    cfg = transformers.LlamaConfig(
        vocab_size=int(vocab), hidden_size=d, num_hidden_layers=n,
        num_attention_heads=max(max(heads), 1), num_key_value_heads=max(max(kv), 1),
        head_dim=hd, intermediate_size=max(max(ffn), 1), rms_norm_eps=lay["rms_eps"],
        max_position_embeddings=lay["context"], tie_word_embeddings=lay["tied"],
        rope_parameters={"rope_type": "default", "rope_theta": lay["rope_theta"]})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # off the meta device
    ad = get_adapter(model)
    state: dict[str, torch.Tensor] = {}
    for name, a in top.items():
        state[name] = torch.from_numpy(np.array(a)).to(dtype)
    for i in range(n):
        block, w, prefix = model.model.layers[i], per_block[i], f"model.layers.{i}."
        if heads[i] == 0:
            install(model, f"{prefix}self_attn", SkippedAttention(i))
            install(model, f"{prefix}input_layernorm", SkippedNorm())
        else:
            shapes = {"q": (heads[i] * hd, d), "k": (kv[i] * hd, d), "v": (kv[i] * hd, d),
                      "o": (d, heads[i] * hd)}
            for p, (rows, cols) in shapes.items():
                with torch.device("meta"):
                    setattr(block.self_attn, f"{p}_proj",
                            torch.nn.Linear(cols, rows, bias=False, dtype=dtype))
            ad._set_heads(i, heads[i], kv[i], hd)
            for p, h in (("q", heads[i]), ("k", kv[i])):
                key = f"self_attn.{p}_proj.weight"
                if key in w:
                    w[key] = split_rope_rows(w[key], h)
        if ffn[i] == 0:
            install(model, f"{prefix}mlp", SkippedMLP())
            install(model, f"{prefix}post_attention_layernorm", SkippedNorm())
        else:
            with torch.device("meta"):
                for p, (rows, cols) in (("gate", (ffn[i], d)), ("up", (ffn[i], d)),
                                        ("down", (d, ffn[i]))):
                    setattr(block.mlp, f"{p}_proj",
                            torch.nn.Linear(cols, rows, bias=False, dtype=dtype))
        for name, a in w.items():
            state[prefix + name] = torch.from_numpy(np.array(a)).to(dtype)
    if lay["tied"]:
        state.pop("lm_head.weight", None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # a tensor whose shape the per-block widths do not give
        first = (str(exc).strip().splitlines() or ["size mismatch"])[-1].strip()[:160]
        raise CorruptCheckpointError(f"deci GGUF {path.name}: a tensor does not have the "
                                     f"shape its block's widths say ({first})") from exc
    missing = [k for k in missing if not (lay["tied"] and k == "lm_head.weight")]
    if missing or unexpected:
        raise CorruptCheckpointError(
            f"deci GGUF {path.name}: weights do not match its layout (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]})")
    if lay["tied"]:
        model.tie_weights()
    bad = [k for k, t in model.state_dict().items() if t.is_meta]
    if bad:
        raise CorruptCheckpointError(f"deci GGUF {path.name}: no data for {bad[:3]}")
    gone = [i for i in range(n) if heads[i] == 0 and ffn[i] == 0]
    if gone:
        ad.delete_blocks(gone)
    if ad.vanilla_problems():  # per-block widths: saved with a modeling file, like
        model.config.prunelab_widths = {}  # the results of prunelab's width pruning
    model.eval()
    return model, _tokenizer(path) if tokenizer else None, lay["operations"]


def _tokenizer(path: Path):
    try:
        return transformers.PreTrainedTokenizerFast.from_pretrained(path.parent,
                                                                    gguf_file=path.name)
    except Exception as exc:  # tokenizers / transformers raise many kinds for bad keys
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise CorruptCheckpointError(f"deci GGUF {path.name}: no usable tokenizer in its "
                                     f"tokenizer.* keys ({first})") from exc
