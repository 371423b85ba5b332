"""Per-family architecture data: where blocks, projections and norms live.

Paths are relative to ``model.base_model`` (for ``blocks``, ``embed``, ``final_norm``) or
to a block (everything else). Adding a family means adding one :class:`FamilySpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


def _llama_head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def _derived_head_dim(cfg) -> int:
    return cfg.hidden_size // cfg.num_attention_heads


def _write_llama(cfg, geo, ffn: int) -> None:
    cfg.num_attention_heads = geo.num_heads
    cfg.num_key_value_heads = geo.num_kv_heads
    cfg.head_dim = geo.head_dim
    cfg.intermediate_size = ffn


def _derived_representable(name: str) -> Callable:
    def check(cfg, geo) -> str | None:
        if geo.num_heads * geo.head_dim != cfg.hidden_size:
            return (f"{name} derives head_dim from hidden_size / num_heads, so "
                    f"{geo.num_heads} heads of {geo.head_dim} cannot be a plain config")
        return None
    return check


def _gpt2_qkv_rows(keep, geo) -> torch.Tensor:
    hd, width = geo.head_dim, geo.num_heads * geo.head_dim
    parts = [torch.arange(s * width + g * hd, s * width + (g + 1) * hd)
             for s in range(3) for g in keep]
    return torch.cat(parts)


def _neox_qkv_rows(keep, geo) -> torch.Tensor:
    span = 3 * geo.head_dim
    return torch.cat([torch.arange(g * span, (g + 1) * span) for g in keep])


def _grouped_qkv_rows(keep, geo) -> torch.Tensor:
    """Rows of a fused ``[q; k; v]`` projection (Phi-3: all query heads, then the KV
    heads' keys, then their values) that belong to KV groups ``keep``."""
    hd, gs = geo.head_dim, geo.group_size
    k0 = geo.num_heads * hd
    v0 = k0 + geo.num_kv_heads * hd
    parts = [torch.arange(g * gs * hd, (g + 1) * gs * hd) for g in keep]
    parts += [torch.arange(start + g * hd, start + (g + 1) * hd)
              for start in (k0, v0) for g in keep]
    return torch.cat(parts)


def _halves_rows(keep: torch.Tensor, ffn: int) -> torch.Tensor:
    """Rows of a fused ``[gate; up]`` projection (rows ``[0, ffn)`` gate, ``[ffn, 2 ffn)``
    up, split by ``chunk(2)``) that belong to FFN channels ``keep``."""
    return torch.cat([keep, keep + ffn])


def _writer(heads_field: str, ffn_field: str) -> Callable:
    def write(cfg, geo, ffn: int) -> None:
        setattr(cfg, heads_field, geo.num_heads)
        setattr(cfg, ffn_field, ffn)
    return write


# Projection roles in execution order, grouped by the tensor they read: q/k/v (or a fused
# qkv) read the normed hidden state, o the attention mix, gate/up (or a fused gate_up) the
# MLP input, down the activated channels.
INPUT_GROUPS: tuple[tuple[str, ...], ...] = (("q", "k", "v", "qkv"), ("o",),
                                             ("gate", "up", "gate_up"), ("down",))

# Head-count quantities an attention module may store (see FamilySpec.head_attributes).
HEAD_QUANTITIES = ("heads", "kv", "groups", "width")


@dataclass(frozen=True)
class FamilySpec:
    """Where one architecture family keeps its parts, and how its config names shapes.

    Roles: ``attn_proj`` has ``q, k, v, o`` or a fused ``qkv, o``; ``mlp_proj`` has
    ``gate, up, down``, ``up, down`` or a fused ``gate_up, down``.
    ``head_attributes`` maps attribute paths on the attention module to the quantity they
    hold (``heads``, ``kv`` heads, query ``groups`` per KV head, ``width`` = heads x
    head_dim); slicing heads rewrites the ones present. A path ``config.<name>`` means the
    attention reads it from its config: the module gets a config of its own.
    ``post_norms``: block norms applied to the MLP output before the residual add.
    ``cache_kwargs``: keyword arguments that carry a KV cache (the runner passes ``None``).
    ``fused_qkv_rows(keep, geo)`` / ``gate_up_rows(keep, ffn)``: rows of a fused
    projection that belong to the kept KV groups / FFN channels.
    """

    name: str
    model_types: tuple[str, ...]
    blocks: str
    embed: str
    final_norm: str | None
    attn: str
    mlp: str | None
    attn_proj: dict[str, str]
    mlp_proj: dict[str, str]
    norms: tuple[str, ...]
    head_dim: Callable
    write_config: Callable
    head_attributes: dict[str, str] = field(default_factory=dict)
    heads_representable: Callable = field(default=lambda cfg, geo: None)
    fused_qkv_rows: Callable | None = None
    gate_up_rows: Callable | None = None
    post_norms: tuple[str, ...] = ()
    cache_kwargs: tuple[str, ...] = ("cache",)
    encoder: bool = False
    # modules whose output is the attention / MLP residual branch (zeroing it ablates it)
    attn_branch: str = ""
    mlp_branch: str = ""
    # "text" (token ids, a tokenizer) or "vision" (pixel_values, no tokenizer)
    modality: str = "text"
    # config field holding this stack's block count; transformers class to load (default:
    # AutoModel for encoders, AutoModelForCausalLM otherwise)
    layers_field: str = "num_hidden_layers"
    model_class: str = ""
    # optional: base_model -> the module the runner calls as ``entry(input_ids=...)``
    entry: Callable | None = None

    def __post_init__(self) -> None:
        bad = {k: q for k, q in self.head_attributes.items() if q not in HEAD_QUANTITIES}
        if bad:
            raise ValueError(f"{self.name}: head_attributes {bad} not in {HEAD_QUANTITIES}")
        for role, rows in (("qkv", self.fused_qkv_rows), ("gate_up", self.gate_up_rows)):
            if (role in {**self.attn_proj, **self.mlp_proj}) != (rows is not None):
                raise ValueError(f"{self.name}: a fused {role} role and its rows function "
                                 "go together")


LLAMA = FamilySpec(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"),
    blocks="layers", embed="embed_tokens", final_norm="norm",
    attn="self_attn", mlp="mlp",
    attn_proj={"q": "self_attn.q_proj", "k": "self_attn.k_proj",
               "v": "self_attn.v_proj", "o": "self_attn.o_proj"},
    mlp_proj={"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
    norms=("input_layernorm", "post_attention_layernorm",
           "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    head_dim=_llama_head_dim, write_config=_write_llama,
    head_attributes={"num_heads": "heads", "num_key_value_heads": "kv",
                     "num_key_value_groups": "groups"},
    post_norms=("post_feedforward_layernorm",),  # gemma2 / gemma3
    attn_branch="self_attn", mlp_branch="mlp",
)

PHI3 = FamilySpec(
    name="phi3", model_types=("phi3",),
    blocks="layers", embed="embed_tokens", final_norm="norm",
    attn="self_attn", mlp="mlp",
    attn_proj={"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj"},
    mlp_proj={"gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"},
    norms=("input_layernorm", "post_attention_layernorm"),
    head_dim=_llama_head_dim, write_config=_write_llama,
    # Phi3Attention splits qkv at config.num_attention_heads * head_dim
    head_attributes={"num_key_value_heads": "kv", "num_key_value_groups": "groups",
                     "config.num_attention_heads": "heads"},
    fused_qkv_rows=_grouped_qkv_rows, gate_up_rows=_halves_rows,
    attn_branch="self_attn", mlp_branch="mlp",
)

GPT2 = FamilySpec(
    name="gpt2", model_types=("gpt2",),
    blocks="h", embed="wte", final_norm="ln_f", attn="attn", mlp="mlp",
    attn_proj={"qkv": "attn.c_attn", "o": "attn.c_proj"},
    mlp_proj={"up": "mlp.c_fc", "down": "mlp.c_proj"},
    norms=("ln_1", "ln_2"),
    head_dim=_derived_head_dim, write_config=_writer("n_head", "n_inner"),
    head_attributes={"num_heads": "heads", "split_size": "width"}, cache_kwargs=(),
    heads_representable=_derived_representable("gpt2"), fused_qkv_rows=_gpt2_qkv_rows,
    attn_branch="attn", mlp_branch="mlp",
)

GPT_NEOX = FamilySpec(
    name="gpt_neox", model_types=("gpt_neox",),
    blocks="layers", embed="embed_in", final_norm="final_layer_norm",
    attn="attention", mlp="mlp",
    attn_proj={"qkv": "attention.query_key_value", "o": "attention.dense"},
    mlp_proj={"up": "mlp.dense_h_to_4h", "down": "mlp.dense_4h_to_h"},
    norms=("input_layernorm", "post_attention_layernorm"),
    head_dim=_derived_head_dim,
    write_config=_writer("num_attention_heads", "intermediate_size"),
    heads_representable=_derived_representable("gpt_neox"), fused_qkv_rows=_neox_qkv_rows,
    cache_kwargs=("layer_past",),
    attn_branch="attention", mlp_branch="mlp",
)

OPT = FamilySpec(
    name="opt", model_types=("opt",),
    blocks="decoder.layers", embed="decoder.embed_tokens",
    final_norm="decoder.final_layer_norm", attn="self_attn", mlp=None,
    attn_proj={"q": "self_attn.q_proj", "k": "self_attn.k_proj",
               "v": "self_attn.v_proj", "o": "self_attn.out_proj"},
    mlp_proj={"up": "fc1", "down": "fc2"},
    norms=("self_attn_layer_norm", "final_layer_norm"),
    head_dim=_derived_head_dim, write_config=_writer("num_attention_heads", "ffn_dim"),
    head_attributes={"num_heads": "heads"},
    heads_representable=_derived_representable("opt"),
    attn_branch="self_attn", mlp_branch="fc2",
)

BERT = FamilySpec(
    name="bert", model_types=("bert",),
    blocks="encoder.layer", embed="embeddings", final_norm=None,
    attn="attention", mlp=None,
    attn_proj={"q": "attention.self.query", "k": "attention.self.key",
               "v": "attention.self.value", "o": "attention.output.dense"},
    mlp_proj={"up": "intermediate.dense", "down": "output.dense"},
    norms=("attention.output.LayerNorm", "output.LayerNorm"),
    head_dim=_derived_head_dim,
    write_config=_writer("num_attention_heads", "intermediate_size"),
    head_attributes={"self.num_attention_heads": "heads", "self.all_head_size": "width"},
    heads_representable=_derived_representable("bert"), encoder=True,
    # post-LN: zeroing these leaves LayerNorm(residual) in place of LayerNorm(residual + f)
    attn_branch="attention.output.dense", mlp_branch="output.dense",
)

def _write_dinov2(cfg, geo, ffn: int) -> None:
    """Dinov2Config derives the FFN width as ``int(hidden_size * mlp_ratio)`` with an int
    ``mlp_ratio``: only multiples of the hidden size are a plain config."""
    if ffn % cfg.hidden_size:
        raise ValueError(f"Dinov2Config needs the FFN width ({ffn}) to be a multiple of "
                         f"hidden_size {cfg.hidden_size} (int mlp_ratio)")
    cfg.num_attention_heads = geo.num_heads
    cfg.head_dim = geo.head_dim  # the attention reads an explicit head_dim when present
    cfg.mlp_ratio = ffn // cfg.hidden_size
    n = cfg.num_hidden_layers  # backbone stages follow the block count (last one out)
    cfg.stage_names = ["stem"] + [f"stage{i}" for i in range(1, n + 1)]
    cfg.set_output_features_output_indices(out_features=None, out_indices=[n])


def _write_vit(cfg, geo, ffn: int) -> None:
    cfg.num_attention_heads = geo.num_heads
    cfg.head_dim = geo.head_dim  # the attention reads an explicit head_dim when present
    cfg.intermediate_size = ffn


# Vision transformers (pre-LN; the residual adds sit in the block): DINOv2 (Oquab et al.,
# 2023) and ViT (Dosovitskiy et al., 2021). Inputs are pixel_values, blocks see
# [batch, 1 + patches, d] with the CLS token first; no tokenizer.
DINOV2 = FamilySpec(
    name="dinov2", model_types=("dinov2",),
    blocks="encoder.layer", embed="embeddings", final_norm="layernorm",
    attn="attention", mlp="mlp",
    attn_proj={"q": "attention.q_proj", "k": "attention.k_proj",
               "v": "attention.v_proj", "o": "attention.o_proj"},
    mlp_proj={"up": "mlp.fc1", "down": "mlp.fc2"},
    norms=("norm1", "norm2"),
    head_dim=_llama_head_dim, write_config=_write_dinov2,
    head_attributes={"num_attention_heads": "heads"}, encoder=True, cache_kwargs=(),
    attn_branch="attention.o_proj", mlp_branch="mlp.fc2", modality="vision",
)

VIT = FamilySpec(
    name="vit", model_types=("vit",),
    blocks="layers", embed="embeddings", final_norm="layernorm",
    attn="attention", mlp="mlp",
    attn_proj={"q": "attention.q_proj", "k": "attention.k_proj",
               "v": "attention.v_proj", "o": "attention.o_proj"},
    mlp_proj={"up": "mlp.fc1", "down": "mlp.fc2"},
    norms=("layernorm_before", "layernorm_after"),
    head_dim=_llama_head_dim, write_config=_write_vit,
    head_attributes={"num_attention_heads": "heads"}, encoder=True, cache_kwargs=(),
    attn_branch="attention.o_proj", mlp_branch="mlp.fc2", modality="vision",
)



def _whisper_stack(stack: str) -> FamilySpec:
    """Whisper's encoder or decoder stack (pre-LN blocks, ``fc1``/``fc2`` MLP; paths from
    ``WhisperModel``). Head counts derive head_dim from ``d_model``."""
    heads, ffn = f"{stack}_attention_heads", f"{stack}_ffn_dim"
    decoder = stack == "decoder"
    return FamilySpec(
        name=f"whisper-{stack}", model_types=("whisper",),
        blocks=f"{stack}.layers", embed=f"{stack}.embed_tokens" if decoder else
        f"{stack}.conv2", final_norm=f"{stack}.layer_norm", attn="self_attn", mlp=None,
        attn_proj={"q": "self_attn.q_proj", "k": "self_attn.k_proj",
                   "v": "self_attn.v_proj", "o": "self_attn.out_proj"},
        mlp_proj={"up": "fc1", "down": "fc2"},
        norms=("self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm"),
        head_dim=lambda cfg: cfg.d_model // getattr(cfg, heads),
        write_config=_writer(heads, ffn), head_attributes={"num_heads": "heads"},
        heads_representable=_derived_representable(f"whisper {stack}"),
        encoder=not decoder, attn_branch="self_attn", mlp_branch="fc2",
        layers_field=f"{stack}_layers", model_class="WhisperForConditionalGeneration",
        entry=None if decoder else EncoderEntry)


class EncoderEntry(nn.Module):
    """Calls the Whisper encoder as ``entry(input_ids=features)``: the runner's entry
    point takes ``input_ids``, which for the speech encoder are log-mel features."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.encoder = base.encoder

    def forward(self, input_ids=None, use_cache=None, **kwargs):  # noqa: ARG002
        return self.encoder(input_features=input_ids)


WHISPER_ENCODER = _whisper_stack("encoder")
WHISPER_DECODER = _whisper_stack("decoder")

FAMILIES: tuple[FamilySpec, ...] = (LLAMA, PHI3, GPT2, GPT_NEOX, OPT, BERT, DINOV2, VIT,
                                     WHISPER_ENCODER)

#: families with more than one stack: model_type -> {stack: spec}; the first is the default
STACKS: dict[str, dict[str, FamilySpec]] = {
    "whisper": {"encoder": WHISPER_ENCODER, "decoder": WHISPER_DECODER}}


#: model-type prefixes of prunelab's remote-code checkpoints: ``prunelab_bridged_<type>``
#: (bridges, custom modules, per-block widths) and ``prunelab_moe_<type>`` (PrunePath)
REMOTE_PREFIXES = ("prunelab_bridged_", "prunelab_moe_")


def original_model_type(model_type: str | None) -> str | None:
    """``model_type`` without a prunelab remote-code prefix."""
    for prefix in REMOTE_PREFIXES:
        if model_type and model_type.startswith(prefix):
            return model_type[len(prefix):]
    return model_type


def family_for_model_type(model_type: str | None) -> FamilySpec | None:
    """The family that handles ``config.model_type``, or ``None`` (prunelab's remote-code
    checkpoints, ``prunelab_bridged_<type>`` / ``prunelab_moe_<type>``, belong to the
    family of ``<type>``)."""
    model_type = original_model_type(model_type)
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    return None


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)
