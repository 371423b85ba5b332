"""Write a loaded model as one GGUF file that llama.cpp runs natively.

GGUF (the file format of llama.cpp, written here with the ``gguf`` package, llama.cpp's own
reference writer) holds the hyperparameters as ``<arch>.*`` keys, the tokenizer as
``tokenizer.*`` keys and the tensors under llama.cpp's names (``blk.N.attn_q.weight``...).
Models whose blocks all have the same widths keep their own architecture (``llama`` for
Llama / Mistral / SmolLM2, ``qwen2`` for Qwen2 / Qwen2.5 with their attention biases,
``gemma3`` for Gemma 3 text models with their per-block sliding-window pattern; a Qwen2
whose hidden size is no longer heads x head size, after slicing, is written as ``llama``:
llama.cpp's ``qwen2`` sizes the attention by the hidden size, its ``llama`` reads the head
size and takes the same biases):
dense models and the uniform results of depth pruning (fewer blocks), uniform width
pruning and sparsity (zeros stored densely). Llama-family models with per-block head, KV
group or FFN widths, or with removed attention / MLP sublayers (sub-block depth search,
static gates), are written as llama.cpp's ``deci`` architecture (the one written for
Llama-3.1-Nemotron-51B), whose width keys are arrays with one entry per block.

Facts followed (llama.cpp ``convert_hf_to_gguf.py`` and ``gguf-py``, read for the names and
layouts, not copied):

- llama.cpp's ``llama`` graph applies rotary embeddings to interleaved pairs of each head's
  dimensions, Hugging Face Llama to its two halves: the rows of ``q_proj`` / ``k_proj`` are
  reordered per head, ``w.reshape(heads, 2, d // 2, in).swapaxes(1, 2)`` (``heads`` = the
  query heads for ``q``, the KV heads for ``k``); Qwen2 uses the halves in both, no reorder;
- 1-D tensors (norms, biases) are stored as float32 whatever the output type;
- a model whose output head is tied to its embeddings stores no ``output.weight``;
- the tokenizer: when the model descends from a GGUF file (every embedded text model does)
  its ``tokenizer.*`` keys are copied as they are, so llama.cpp tokenizes exactly as the
  original file did; otherwise they are built from the Hugging Face ``tokenizer.json``
  (byte-level BPE: vocabulary by id, merges, control tokens, BOS / EOS / padding, chat
  template).

Output types f32 / f16 / bf16 are written here; q8_0 / q6_k / q4_k_m by llama.cpp's own
quantizer (``llama_model_quantize`` through ``llama-cpp-python``) from an f16 file.

What GGUF cannot express is refused with one line that says what to do: non-uniform
models of other families, prunelab's custom modules (low-rank or shared-dictionary
factors, PrunePath routers, gates, token pruners) and linear bridges, elastic checkpoints
before a size is cut, rotary scaling other than the default, and other architectures.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from prunelab._version import __version__
from prunelab.checkpoint.imatrix import IMatrix, read_imatrix
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.io.files import atomic_file, check_output_path
from prunelab.models.bridges import BRIDGE_ATTR
from prunelab.models.custom import custom_modules
from prunelab.models.embedded import EMBEDDED
from prunelab.models.families import original_model_type
from prunelab.models.gguf_llama import (
    BLOCK_NAMES,
    GEMMA3_BLOCK_NAMES,
    TOP_NAMES,
    interleave_rope_rows,
    require_llama_cpp,
)
from prunelab.models.resolve import resolve_embedded

#: Hugging Face ``model_type`` -> GGUF architecture
ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}
#: output type -> (GGML tensor type of 2-D weights, ``general.file_type``)
OUT_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"),
             "bf16": ("BF16", "MOSTLY_BF16")}
@dataclass(frozen=True)
class QuantType:
    """A llama.cpp quantized file type: its ``LLAMA_FTYPE_*`` name, the values per
    quantization block along a row (a weight whose input width is not a multiple falls
    back to another type in llama.cpp's quantizer), and whether llama.cpp refuses it
    without an importance matrix (the lowest-bit IQ types)."""

    ftype: str
    block: int
    needs_imatrix: bool = False


def _q(name: str, block: int, needs: bool = False) -> QuantType:
    return QuantType(f"LLAMA_FTYPE_MOSTLY_{name.upper()}", block, needs)


#: quantized output types (written by llama.cpp's own quantizer), bits roughly descending
QUANT_TYPES: dict[str, QuantType] = {
    "q8_0": _q("q8_0", 32), "q6_k": _q("q6_k", 256), "q5_k_m": _q("q5_k_m", 256),
    "q5_k_s": _q("q5_k_s", 256), "q5_1": _q("q5_1", 32), "q5_0": _q("q5_0", 32),
    "q4_k_m": _q("q4_k_m", 256), "q4_k_s": _q("q4_k_s", 256), "q4_1": _q("q4_1", 32),
    "q4_0": _q("q4_0", 32), "iq4_nl": _q("iq4_nl", 32), "iq4_xs": _q("iq4_xs", 256),
    "q3_k_l": _q("q3_k_l", 256), "q3_k_m": _q("q3_k_m", 256), "q3_k_s": _q("q3_k_s", 256),
    "iq3_m": _q("iq3_m", 256), "iq3_s": _q("iq3_s", 256), "iq3_xs": _q("iq3_xs", 256),
    "iq3_xxs": _q("iq3_xxs", 256, True), "q2_k": _q("q2_k", 256),
    "q2_k_s": _q("q2_k_s", 256, True), "iq2_m": _q("iq2_m", 256, True),
    "iq2_s": _q("iq2_s", 256, True), "iq2_xs": _q("iq2_xs", 256, True),
    "iq2_xxs": _q("iq2_xxs", 256, True), "iq1_m": _q("iq1_m", 256, True),
    "iq1_s": _q("iq1_s", 256, True),
}


def quant_block(out_type: str) -> int:
    """Values per quantization block of ``out_type`` (1 for f32 / f16 / bf16)."""
    if out_type in OUT_TYPES:
        return 1
    if out_type not in QUANT_TYPES:
        raise _refuse(f"output type {out_type!r}: {' | '.join(all_types())}")
    return QUANT_TYPES[out_type].block


def all_types() -> list[str]:
    """Every output type: the float ones, then the quantized ones."""
    return [*OUT_TYPES, *QUANT_TYPES]


@dataclass(frozen=True)
class GGUFPlan:
    """What will be written: the architecture, per-block widths (query heads, KV heads and
    FFN width of each block; 0 where a sublayer was removed), and for each tensor
    ``(llama.cpp name, Hugging Face name or None, rope heads or 0, fill)``: a fill
    ``("zeros" | "ones", shape)`` is a tensor made here (see :func:`plan_gguf`)."""

    arch: str
    hidden: int
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    ffn: tuple[int, ...]
    head_dim: int
    tensors: tuple[tuple[str, str | None, int, tuple | None], ...]
    products: tuple[str, ...] = ()

    @property
    def blocks(self) -> int:
        return len(self.ffn)

    @property
    def uniform(self) -> bool:
        return self.arch != "deci"


def _refuse(why: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(f"GGUF export: {why}")


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    scaling = getattr(config, "rope_scaling", None)
    if kind != "default" or (isinstance(scaling, dict) and
                             scaling.get("rope_type", scaling.get("type")) not in
                             (None, "default")):
        raise _refuse(f"rotary scaling {kind!r} is not written yet (only the default)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


#: custom modules that stand for a removed sublayer (the ``deci`` form expresses them)
SKIPPED = {"skipped_attention", "skipped_mlp", "skipped_norm"}


def plan_gguf(model: torch.nn.Module) -> GGUFPlan:
    """Check that ``model`` (a Hugging Face causal LM) fits a GGUF architecture and list
    its tensors; raise :class:`UnsupportedOperationError` (one line: why, what to do).

    Every block with the same widths and both sublayers: the model's own architecture.
    Per-block widths or removed sublayers (Llama family): llama.cpp's ``deci``, whose
    per-block ``head_count`` / ``head_count_kv`` / ``feed_forward_length`` arrays hold each
    block's widths and whose graph skips the attention of a block with 0 heads. Its graph
    also drops a block's attention output when the block's FFN width is 0, so a block that
    keeps its attention but lost its MLP is written with a 1-channel FFN of zero weights
    (output exactly 0, as the removed MLP's)."""
    cfg = model.config
    model_type = original_model_type(cfg.model_type)  # prunelab's remote-code checkpoints
    arch = ARCHES.get(model_type)
    if arch is None:
        raise _refuse(f"{model_type} models are not written yet ({', '.join(ARCHES)})")
    if arch == "gemma3":
        _check_gemma3(cfg)
    products = _refuse_inexpressible(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads, kv, ffn = _block_widths(model, head_dim)
    uniform = len(set(zip(heads, kv, ffn, strict=True))) == 1 and min(heads) > 0 and min(ffn) > 0
    if not uniform:
        if arch != "llama":
            raise _refuse(f"per-block widths or removed sublayers of a {model_type} model "
                          "are not written yet (Llama family: deci); prune with --allocation "
                          "uniform")
        arch = "deci"
    if arch == "qwen2" and head_dim * heads[0] != cfg.hidden_size:
        # llama.cpp's qwen2 sizes the attention by the hidden size; its llama graph reads
        # the head size from the file and takes the same q / k / v biases (sliced Qwen2)
        arch = "llama"
    params = dict(model.named_parameters())
    names = GEMMA3_BLOCK_NAMES if arch == "gemma3" else BLOCK_NAMES
    tensors: list[tuple[str, str | None, int, tuple | None]] = []
    inside = tuple(p + "." for p in products) + tuple(p + "." for p in _dictionaries(model))
    for path, module in products.items():  # factors multiplied out: one dense weight
        parts = path.split(".")
        for part in ("weight", "bias") if _has_bias(module) else ("weight",):
            params[f"{path}.{part}"] = None
    for name in params:
        if params[name] is not None and name.startswith(inside):
            continue  # a factor or a dictionary atom: in the product
        parts = name.split(".")
        if name.startswith("model.layers."):
            i, inner = int(parts[2]), ".".join(parts[3:-1])
            if inner not in names:
                raise _refuse(f"{name} has no llama.cpp name")
            rope = 0
            if arch in ("llama", "deci") and inner in ("self_attn.q_proj", "self_attn.k_proj"):
                rope = heads[i] if inner.endswith("q_proj") else kv[i]
            fill = ("product", ".".join(parts[:-1]), parts[-1]) if params[name] is None \
                else None
            tensors.append((f"blk.{i}.{names[inner]}.{parts[-1]}", name, rope, fill))
        else:
            top = ".".join(parts[:-1])
            if top not in TOP_NAMES:
                raise _refuse(f"{name} has no llama.cpp name")
            if top == "lm_head" and getattr(cfg, "tie_word_embeddings", False):
                continue
            tensors.append((f"{TOP_NAMES[top]}.{parts[-1]}", name, 0, None))
    d = cfg.hidden_size
    for i, (h, f) in enumerate(zip(heads, ffn, strict=True)):
        if h > 0 and f == 0:  # attention kept, MLP removed: a zero 1-channel FFN
            ffn[i] = 1
            tensors += [(f"blk.{i}.ffn_norm.weight", None, 0, ("ones", (d,))),
                        (f"blk.{i}.ffn_gate.weight", None, 0, ("zeros", (1, d))),
                        (f"blk.{i}.ffn_up.weight", None, 0, ("zeros", (1, d))),
                        (f"blk.{i}.ffn_down.weight", None, 0, ("zeros", (d, 1)))]
    return GGUFPlan(arch, d, tuple(heads), tuple(kv), tuple(ffn), head_dim, tuple(tensors),
                    tuple(products))


#: custom modules that compute ``W x + b`` through factors (low rank, a shared basis, sparse
#: plus low rank): written as the dense product ``W`` (``dense_weight()``)
PRODUCTS = {"low_rank_linear", "shared_basis_linear", "sparse_lowrank_linear"}
#: why the other custom modules have no GGUF form, and what to do instead
INEXPRESSIBLE = {
    "residual_shortcut": "SliceGPT's per-layer rotations map the residual stream between "
                         "blocks, which no llama.cpp graph can: slice with --rotation global "
                         "(a plain model)",
    "stream_shapes": "per-block slicing widths change the residual stream between blocks, "
                     "which no llama.cpp graph can: slice with one width (--widths uniform, "
                     "--rotation global)",
    "prunepath_mlp": "PrunePath routes each token through some of the FFN's experts at run "
                     "time, which llama.cpp cannot: prune FFN width instead (prune width "
                     "--unit ffn) for a smaller file",
    "token_pruner": "token pruning is a vision-encoder runtime, not a llama.cpp model",
}


def _kind(module) -> str | None:
    """A prunelab custom module's kind (also a copy of the class from remote code)."""
    kind = getattr(type(module), "prunelab_kind", None)
    return kind if isinstance(kind, str) and kind != "base" else None


def _refuse_inexpressible(model) -> dict:
    """Refuse, in one line naming why and what to do, what llama.cpp cannot compute; return
    ``{path: module}`` of the factorized linears written as their dense product."""
    if any(isinstance(getattr(m, BRIDGE_ATTR, None), torch.nn.Module)
           for m in model.modules()):  # a bridge class from remote code counts too
        raise _refuse("linear bridges (ghost / lra recovery) map the residual stream over a "
                      "cut, which no llama.cpp graph can: prune with --recovery foldable "
                      "(folded into the weights) or none")
    products = {}
    for path, module in custom_modules(model):
        kind = _kind(module)
        if kind in SKIPPED or kind == "shared_dictionary":
            continue
        if kind in PRODUCTS and callable(getattr(module, "dense_weight", None)):
            products[path] = module
            continue
        why = INEXPRESSIBLE.get(kind, f"prunelab's {kind} modules have no llama.cpp form")
        raise _refuse(why)
    return products


def _dictionaries(model) -> list[str]:
    """Paths of shared dictionaries (their atoms are in the products' dense weights)."""
    return [p for p, m in custom_modules(model) if _kind(m) == "shared_dictionary"]


def _has_bias(module) -> bool:
    return any(n.rsplit(".", 1)[-1] == "bias" and p is not None
               for n, p in module.named_parameters())


@torch.no_grad()
def _product(module, part: str) -> torch.Tensor:
    """The dense weight ``[out, in]`` of a factorized linear, or its bias (its output for a
    zero input)."""
    if part == "weight":
        return module.dense_weight()
    w = module.dense_weight()
    return module(torch.zeros(1, w.shape[1], dtype=w.dtype, device=w.device))[0]


def _check_gemma3(cfg) -> None:
    """What llama.cpp's ``gemma3`` graph fixes that a Gemma 3 config could change: the
    query scale 1 / sqrt(head_dim), no attention soft-capping, default rotary (no scaling)
    in both the global and the sliding layers."""
    head_dim = cfg.head_dim
    if getattr(cfg, "query_pre_attn_scalar", head_dim) != head_dim:
        raise _refuse(f"query_pre_attn_scalar {cfg.query_pre_attn_scalar} is not head_dim "
                      f"{head_dim} (llama.cpp's gemma3 scales queries by 1/sqrt(head_dim))")
    if getattr(cfg, "attn_logit_softcapping", None):
        raise _refuse("attention soft-capping is not in llama.cpp's gemma3 graph")
    for kind, params in _gemma3_rope(cfg).items():
        if params.get("rope_type", "default") != "default":
            raise _refuse(f"rotary scaling {params.get('rope_type')!r} of the {kind} layers "
                          "is not written yet (only the default)")


def _gemma3_rope(cfg) -> dict:
    params = getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(params, dict) or "full_attention" not in params:
        params = {"full_attention": {"rope_theta": getattr(cfg, "rope_theta", 1e6)},
                  "sliding_attention": {"rope_theta": getattr(cfg, "rope_local_base_freq",
                                                              1e4)}}
    return params


def _sliding(model) -> list[bool]:
    """Which blocks use sliding-window attention: each attention's own flag (what the
    forward uses), else the config's ``layer_types``."""
    blocks = model.model.layers
    flags = [getattr(b.self_attn, "is_sliding", None) for b in blocks]
    if all(isinstance(f, bool) for f in flags):
        return flags
    types = list(getattr(model.config, "layer_types", None) or [])
    if len(types) != len(blocks):
        raise _refuse(f"layer_types lists {len(types)} blocks, the model has {len(blocks)}")
    return [t == "sliding_attention" for t in types]


def _gemma3_keys(writer, model) -> None:
    """Gemma 3's own keys: the rotary base of the global and of the sliding layers, the
    window, and which blocks slide (a per-block array, so a depth-pruned stack keeps its
    pattern instead of llama.cpp's default of every sixth block global)."""
    cfg = model.config
    rope = _gemma3_rope(cfg)
    writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
    writer.add_float32("gemma3.rope.freq_base_swa",
                       float(rope["sliding_attention"]["rope_theta"]))
    writer.add_sliding_window(int(cfg.sliding_window))
    writer.add_array("gemma3.attention.sliding_window_pattern", _sliding(model))
    if getattr(cfg, "final_logit_softcapping", None):
        writer.add_float32("gemma3.final_logit_softcapping", float(cfg.final_logit_softcapping))


def _block_widths(model: torch.nn.Module, head_dim: int) -> tuple[list, list, list]:
    """Per block: query heads, KV heads and FFN width, read off the weights (a pruned model
    in memory keeps its original configuration); 0 for a removed sublayer."""
    heads, kv, ffn = [], [], []
    for i, block in enumerate(model.model.layers):
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        for part, module, names in (("attention", attn, ("q_proj", "k_proj")),
                                    ("MLP", mlp, ("up_proj",))):
            if _kind(module) not in SKIPPED and not all(hasattr(module, n) for n in names):
                raise _refuse(f"block {i}'s {part} has no {'/'.join(names)}")
        skipped_attn = _kind(attn) in SKIPPED
        heads.append(0 if skipped_attn else attn.q_proj.out_features // head_dim)
        kv.append(0 if skipped_attn else attn.k_proj.out_features // head_dim)
        ffn.append(0 if _kind(mlp) in SKIPPED else mlp.up_proj.out_features)
    return heads, kv, ffn


def source_gguf(spec: str, depth: int = 32) -> Path | None:
    """The GGUF file ``spec`` descends from: an embedded GGUF model, a ``.gguf`` path, or
    a prunelab checkpoint whose manifest's ``source_model`` leads to one; else ``None``."""
    for _ in range(depth):
        if spec in EMBEDDED:
            if not EMBEDDED[spec].kind.startswith("gguf"):
                return None
            return resolve_embedded(spec)[1]
        path = Path(spec)
        if path.suffix == ".gguf" and path.is_file():
            return path
        manifest = path / "manifest.json"
        if not manifest.is_file():
            return None
        try:
            spec = json.loads(manifest.read_text())["source_model"]["spec"]
        except (ValueError, KeyError, TypeError):
            return None
    return None


def _copy_tokenizer(writer, path: Path, vocab: int) -> bool:
    """Copy the ``tokenizer.*`` keys of the GGUF file ``path``; False when its vocabulary
    is not ``vocab`` tokens (then the caller builds it)."""
    reader = gguf.GGUFReader(path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != vocab:
        return False
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        types = field.types
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, field.contents(), types[0], sub_type=types[-1])
        else:
            writer.add_key_value(field.name, field.contents(), types[0])
    return True


#: a model type -> llama.cpp's pre-tokenizer name, when no GGUF source says it
PRE_TOKENIZERS = {"qwen2": "qwen2"}


def _build_tokenizer(writer, tokenizer, model_type: str, vocab: int) -> list[str]:
    """``tokenizer.*`` keys from a Hugging Face byte-level BPE tokenizer; returns notes."""
    notes = []
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model_type.startswith("gemma"):
        raise _refuse("Gemma's SentencePiece tokenizer is copied from a source GGUF file; "
                      "this model descends from none (export from the embedded gemma3-270m "
                      "or a checkpoint pruned from a GGUF file)")
    if model.get("type") != "BPE":
        raise _refuse(f"a {model.get('type')} tokenizer is not written yet (byte-level BPE)")
    tokens = [f"[PAD{i}]" for i in range(vocab)]
    types = [gguf.TokenType.UNUSED] * vocab
    for text, i in model["vocab"].items():
        if i < vocab:
            tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in spec.get("added_tokens", []):
        if added["id"] < vocab:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = (gguf.TokenType.CONTROL if added.get("special")
                                  else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    pre = PRE_TOKENIZERS.get(model_type)
    if pre is None:
        pre = "default"
        notes.append("tokenizer.ggml.pre is 'default' (no GGUF source names the "
                     "pre-tokenizer): llama.cpp may split some text differently")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(tokenizer, key, None)
        if value is not None:
            add(int(value))
    template = getattr(tokenizer, "chat_template", None)
    if template:
        writer.add_chat_template(template)
    return notes


def _tensor_data(t: torch.Tensor, rope: int, qtype) -> tuple[np.ndarray, object]:
    a = t.detach().to("cpu", torch.float32).numpy()
    if rope:
        a = interleave_rope_rows(a, rope)
    if a.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(a, dtype=np.float32), gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.ascontiguousarray(a.astype(np.float16)), qtype
    return gguf.quants.quantize(np.ascontiguousarray(a), qtype), qtype


def write_gguf(lm, path: str | Path, out_type: str = "f16", overwrite: bool = False,
               name: str | None = None, operations: list | None = None,
               extra: dict[str, str] | None = None, imatrix=None) -> dict:
    """Write ``lm`` (a LoadedModel) to the GGUF file ``path`` (atomic: a failure leaves no
    file) with 2-D weights in ``out_type`` (f32 | f16 | bf16, or a :data:`QUANT_TYPES`
    type through llama.cpp's quantizer, weighted by ``imatrix`` when given: see
    :func:`quantize_gguf`); ``extra``: more string keys for the header.
    Returns what was written: architecture, blocks, output type, tensors, bytes, tokenizer
    source and notes."""
    if out_type in QUANT_TYPES:
        return _write_quantized(lm, path, out_type, overwrite, name, operations, extra,
                                imatrix)
    if out_type not in OUT_TYPES:
        raise _refuse(f"output type {out_type!r}: {' | '.join(all_types())}")
    if imatrix is not None:
        raise ConfigError(f"an importance matrix is used by the quantized types only, not "
                          f"{out_type}")
    model = lm.model
    plan = plan_gguf(model)
    cfg = model.config
    qtype = getattr(gguf.GGMLQuantizationType, OUT_TYPES[out_type][0])
    vocab = model.get_input_embeddings().weight.shape[0]
    params = dict(model.named_parameters())
    notes: list[str] = []
    with atomic_file(path, overwrite=overwrite) as tmp:
        writer = gguf.GGUFWriter(tmp, plan.arch)
        writer.add_name(name or Path(str(lm.spec)).name)
        writer.add_file_type(int(getattr(gguf.LlamaFileType, OUT_TYPES[out_type][1])))
        writer.add_context_length(int(cfg.max_position_embeddings))
        writer.add_embedding_length(plan.hidden)
        writer.add_block_count(plan.blocks)
        one = (lambda v: v[0]) if plan.uniform else list  # deci: one entry per block
        writer.add_feed_forward_length(one(plan.ffn))
        writer.add_head_count(one(plan.heads))
        writer.add_head_count_kv(one(plan.kv_heads))
        if plan.arch == "gemma3":
            _gemma3_keys(writer, model)
        else:
            writer.add_rope_freq_base(_rope_theta(cfg))
        writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        writer.add_rope_dimension_count(plan.head_dim)
        writer.add_vocab_size(int(vocab))
        if plan.arch == "deci" or plan.head_dim * plan.heads[0] != plan.hidden:
            writer.add_key_length(plan.head_dim)
            writer.add_value_length(plan.head_dim)
        writer.add_string("prunelab.version", __version__)
        writer.add_string("prunelab.operations", json.dumps(operations or [], default=str))
        for key, value in (extra or {}).items():
            writer.add_string(key, str(value))
        if plan.products:
            notes.append(f"{len(plan.products)} factorized linears were multiplied out: the "
                         "file stores their dense weights (llama.cpp has no factorized "
                         "linear), so it is no smaller nor faster than the dense model")
        src = source_gguf(str(lm.spec))
        copied = src is not None and _copy_tokenizer(writer, src, vocab)
        if not copied:
            if lm.tokenizer is None:
                raise _refuse("the model has no tokenizer to carry over")
            notes += _build_tokenizer(writer, lm.tokenizer, cfg.model_type, vocab)
        nbytes = 0
        for gguf_name, hf_name, rope, fill in plan.tensors:
            if fill is None:
                t = params[hf_name]
            elif fill[0] == "product":
                t = _product(model.get_submodule(fill[1]), fill[2])
            else:
                t = (torch.ones if fill[0] == "ones" else torch.zeros)(fill[1])
            if plan.arch == "gemma3" and gguf_name.endswith("norm.weight"):
                t = t.detach().float() + 1  # Gemma multiplies by 1 + weight
            data, kind = _tensor_data(t, rope, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=kind)
            nbytes += data.nbytes
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"format": "gguf", "path": str(path), "arch": plan.arch, "blocks": plan.blocks,
            "heads": list(plan.heads), "kv_heads": list(plan.kv_heads), "ffn": list(plan.ffn),
            "out_type": out_type, "tensors": len(plan.tensors), "tensor_bytes": nbytes,
            "bytes": Path(path).stat().st_size,
            "tokenizer": f"copied from {src.name}" if copied else "built from tokenizer.json",
            "notes": notes}


def quantize_gguf(src: str | Path, dst: str | Path, out_type: str,
                  threads: int | None = None, imatrix=None) -> None:
    """Quantize the GGUF file ``src`` into ``dst`` with llama.cpp's own quantizer
    (``llama_model_quantize`` through ``llama-cpp-python``): ``out_type`` is one of
    :data:`QUANT_TYPES`. llama.cpp keeps a tensor whose rows are not a multiple of the
    type's block (32 values for q8_0, 256 for the k-quants) in a fallback type
    (:func:`fallbacks`). ``imatrix``: an :class:`~prunelab.checkpoint.imatrix.IMatrix` or
    the path of an imatrix file; llama.cpp then weighs each column's rounding error by the
    column's mean squared input (the IQ types of :data:`QUANT_TYPES` marked
    ``needs_imatrix`` are refused without one)."""
    kind = QUANT_TYPES.get(out_type)
    if kind is None:
        raise ConfigError(f"quantized type {out_type!r}: {' | '.join(QUANT_TYPES)}")
    if kind.needs_imatrix and imatrix is None:
        raise ConfigError(f"{out_type} needs an importance matrix (llama.cpp refuses it "
                          "without one): give an imatrix")
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, kind.ftype)
    params.nthread = threads or os.cpu_count() or 1
    keep = []  # the ctypes buffers must outlive the call
    if imatrix is not None:
        im = imatrix if isinstance(imatrix, IMatrix) else read_imatrix(imatrix)
        check_imatrix(src, im)
        means = im.means()
        entries = (llama_cpp.llama_model_imatrix_data * (len(means) + 1))()
        for i, (name, values) in enumerate(sorted(means.items())):
            buf = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(buf)
            entries[i].name = name.encode()
            entries[i].data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = buf.size
        entries[len(means)].name = None  # the terminator llama.cpp looks for
        keep.append(entries)
        params.imatrix = entries
    with llama_cpp.suppress_stdout_stderr(disable=False):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise _refuse(f"llama.cpp's quantizer failed on {Path(src).name} ({out_type}, code "
                      f"{rc})")


def check_imatrix(path: str | Path, im) -> None:
    """Refuse an importance matrix that does not fit the GGUF file ``path``: an entry whose
    width is not its weight's input width, or one that names none of the file's block
    weights (another model's matrix)."""
    cols = {t.name: int(t.shape[0]) for t in gguf.GGUFReader(path).tensors
            if len(t.shape) >= 2 and t.name.startswith("blk.")}
    matched = 0
    for name, s in im.sums.items():
        if name in cols:
            matched += 1
            if s.shape[0] != cols[name]:
                raise ConfigError(f"importance matrix entry {name} has {s.shape[0]} values, "
                                  f"the weight {cols[name]} columns: it was made for another "
                                  "model")
    if cols and not matched:
        raise ConfigError(f"the importance matrix names none of {Path(path).name}'s block "
                          "weights: it was made for another model")


def tensor_types(path: str | Path) -> dict[str, int]:
    """How many tensors of each GGML type the GGUF file ``path`` holds."""
    return dict(collections.Counter(t.tensor_type.name
                                    for t in gguf.GGUFReader(path).tensors))


def fallbacks(path: str | Path, out_type: str) -> list[dict]:
    """The weights of the quantized GGUF file ``path`` that llama.cpp could not store in
    ``out_type``'s block type because their input width (columns) is not a multiple of its
    block (:func:`quant_block`): name, columns and the type they got instead."""
    block = quant_block(out_type)
    out = []
    for t in gguf.GGUFReader(path).tensors:
        cols = int(t.shape[0])  # GGUF's ne[0]: the input width
        if len(t.shape) >= 2 and t.tensor_type.name != "F32" and cols % block:
            out.append({"tensor": t.name, "columns": cols, "type": t.tensor_type.name})
    return out


def fallback_note(fell: list[dict], out_type: str) -> str | None:
    """One line naming the tensors that fell back, grouped over blocks
    (``blk.*.ffn_down.weight x24 (1232 columns) -> Q8_0``)."""
    if not fell:
        return None
    groups = collections.Counter(
        (re.sub(r"^blk\.\d+\.", "blk.*.", f["tensor"]), f["columns"], f["type"]) for f in fell)
    parts = [f"{name}{f' x{n}' if n > 1 else ''} ({cols} columns) -> {kind}"
             for (name, cols, kind), n in sorted(groups.items())]
    block = quant_block(out_type)
    hint = (f" (prune FFN widths for the type: --gguf-type {out_type} rounds them to "
            f"{block})" if any(".ffn_down." in f["tensor"] for f in fell) else "")
    return (f"{len(fell)} weight tensors fell back from {out_type}: their input width is "
            f"not a multiple of {block} values: {'; '.join(parts)}{hint}")


def _write_quantized(lm, path, out_type: str, overwrite: bool, name, operations,
                     extra, imatrix=None) -> dict:
    """Write an f16 (bf16 for a bfloat16 model) GGUF beside ``path``, quantize it into
    ``path`` with llama.cpp (atomic), remove the intermediate; report the tensor types,
    and name the weights that fell back (widths not a multiple of the block)."""
    require_llama_cpp()  # before any work
    check_output_path(path, kind="file", overwrite=overwrite)
    plan_gguf(lm.model)  # refusals before writing anything
    half = "bf16" if lm.model.dtype == torch.bfloat16 else "f16"
    path = Path(path)
    fd, mid = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".f16.tmp")
    os.close(fd)
    os.unlink(mid)
    try:
        rep = write_gguf(lm, mid, half, overwrite=True, name=name or Path(str(lm.spec)).name,
                         operations=operations, extra=extra)
        with atomic_file(path, overwrite=overwrite) as tmp:
            quantize_gguf(mid, tmp, out_type, imatrix=imatrix)
    finally:
        Path(mid).unlink(missing_ok=True)
    fell = fallbacks(path, out_type)
    notes = list(rep["notes"])
    if (note := fallback_note(fell, out_type)) is not None:
        notes.append(note)
    rep.update(path=str(path), out_type=out_type, bytes=path.stat().st_size,
               tensor_types=tensor_types(path), fallbacks=fell, intermediate=half,
               notes=notes, imatrix=imatrix is not None,
               quantizer=f"llama.cpp (llama-cpp-python {require_llama_cpp().__version__})")
    rep.pop("tensor_bytes", None)
    return rep


def gguf_string(path: str | Path, key: str) -> str | None:
    """The string value of ``key`` in the GGUF file ``path`` (None: absent or unreadable)."""
    try:
        field = gguf.GGUFReader(path).fields.get(key)
    except (ValueError, OSError, KeyError, IndexError, EOFError):
        return None
    value = None if field is None else field.contents()
    return value if isinstance(value, str) else None
