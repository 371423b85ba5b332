"""The residual stream of a pre-norm decoder: who reads it, who writes it, and norm folding.

Residual-stream slicing (SliceGPT, Ashkboos et al., ICLR 2024) rotates every linear that
reads or writes the stream. It first needs the norms that read the stream to be free of
weights: an RMSNorm ``y = w * h / rms(h)`` read by ``W`` equals a weight-free norm read by
``W diag(w)`` (Gemma's ``(1 + w) * h / rms(h)`` folds ``1 + w``). The final norm folds into
the output head, so a head tied to the embeddings is untied first.

Supported: the pre-norm RMSNorm decoders (llama, mistral, qwen2, qwen3, phi3 with its fused
``qkv_proj`` / ``gate_up_proj``, gemma, gemma2, gemma3_text with norms on the branch
outputs). LayerNorm families would also need the stream mean-centred; they are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prunelab.checkpoint.remote import has_bridges, has_custom_modules
from prunelab.errors import UnsupportedOperationError
from prunelab.models.families import original_model_type

RMS_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
OFFSET_NORM_TYPES = ("gemma", "gemma2", "gemma3_text")  # norm weight used as 1 + w
POST_NORM_TYPES = ("gemma2", "gemma3_text")  # branch outputs normed before the residual add
LAYERNORM_TYPES = ("gpt2", "gpt_neox", "opt")


def base_type(model: nn.Module) -> str:
    """``config.model_type`` without prunelab's remote-code prefix."""
    return original_model_type(str(getattr(model.config, "model_type", "")))


def check_sliceable(lm, method: str = "slicegpt") -> None:
    """Raise :class:`UnsupportedOperationError` (one line) unless ``lm``'s residual stream
    can be sliced."""
    mt = base_type(lm.model)
    if mt == "bert":
        raise UnsupportedOperationError(
            f"{method}: bert is a post-LayerNorm encoder; residual-stream slicing needs a "
            "pre-norm decoder")
    if mt in LAYERNORM_TYPES:
        raise UnsupportedOperationError(
            f"{method}: {mt} uses LayerNorm (the stream would need mean-centring, not "
            f"implemented); supported: {', '.join(RMS_TYPES)}")
    if mt not in RMS_TYPES:
        raise UnsupportedOperationError(f"{method}: {mt} is not supported; supported: "
                                        f"{', '.join(RMS_TYPES)}")
    if has_custom_modules(lm.model) or has_bridges(lm.model):
        raise UnsupportedOperationError(
            f"{method}: the model already holds prunelab custom modules or bridges; slice "
            "the model before factorizing or bridging it")


@dataclass
class Branch:
    """One residual branch: ``norm`` reads the stream, ``readers`` read the norm's output,
    ``writer`` writes the branch output, ``post_norm`` (Gemma 2/3) norms it before the
    residual add, ``owner`` is the module whose output is the residual contribution."""

    kind: str  # "attention" or "mlp"
    block: int
    norm: nn.Module
    readers: list[nn.Module]
    writer: nn.Module
    post_norm: nn.Module | None
    owner: nn.Module


def stream_branches(lm) -> list[Branch]:
    """Every residual branch of ``lm`` in execution order (attention 0, MLP 0, ...)."""
    ad = lm.adapter
    post = base_type(lm.model) in POST_NORM_TYPES
    out: list[Branch] = []
    for i in range(ad.num_blocks):
        blk = ad.block(i)
        attn, mlp = ad.attn_projections(i), ad.mlp_projections(i)
        a_post = blk.post_attention_layernorm if post else None
        a_reader = [attn[r] for r in ("q", "k", "v", "qkv") if r in attn]
        out.append(Branch("attention", i, blk.input_layernorm, a_reader, attn["o"], a_post,
                          a_post if post else ad.attention(i)))
        m_norm = blk.pre_feedforward_layernorm if post else blk.post_attention_layernorm
        m_post = blk.post_feedforward_layernorm if post else None
        m_reader = [mlp[r] for r in ("gate", "up", "gate_up") if r in mlp]
        out.append(Branch("mlp", i, m_norm, m_reader, mlp["down"], m_post,
                          m_post if post else ad.mlp(i)))
    return out


def stream_boundaries(lm) -> list[nn.Module]:
    """The norms that read the residual stream, in execution order, the final norm last
    (the inputs of these modules are the stream at each slicing boundary)."""
    return [b.norm for b in stream_branches(lm)] + [lm.adapter.final_norm()]


# ---------------------------------------------------------------------- weight surgery
def _param(like: torch.Tensor, value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value.to(device=like.device, dtype=like.dtype).contiguous(),
                        requires_grad=like.requires_grad)


@torch.no_grad()
def rotate_inputs(module: nn.Module, r: torch.Tensor) -> None:
    """A reader ``W`` (``[out, d]``) becomes ``W r`` (``r``: ``[d, d_new]``)."""
    w = module.weight
    module.weight = _param(w, w.double() @ r.to(w.device, torch.float64))
    if isinstance(module, nn.Linear):
        module.in_features = r.shape[1]
    elif isinstance(module, nn.Embedding):
        module.embedding_dim = r.shape[1]


@torch.no_grad()
def scale_inputs(module: nn.Module, scale: torch.Tensor) -> None:
    """A reader ``W`` becomes ``W diag(scale)``."""
    w = module.weight
    module.weight = _param(w, w.double() * scale.to(w.device, torch.float64))


@torch.no_grad()
def cut_inputs(module: nn.Module, width: int) -> None:
    """Keep a reader's first ``width`` input columns (an embedding's first channels)."""
    module.weight = _param(module.weight, module.weight[:, :width])
    if isinstance(module, nn.Linear):
        module.in_features = width
    elif isinstance(module, nn.Embedding):
        module.embedding_dim = width


@torch.no_grad()
def cut_outputs(module: nn.Module, width: int) -> None:
    """Keep a writer's first ``width`` outputs (and bias entries)."""
    module.weight = _param(module.weight, module.weight[:width])
    if getattr(module, "bias", None) is not None:
        module.bias = _param(module.bias, module.bias[:width])
    module.out_features = width


@torch.no_grad()
def rotate_outputs(module: nn.Module, r: torch.Tensor) -> None:
    """A writer ``W`` (``[d, in]``) becomes ``r^T W`` and its bias ``r^T b``."""
    w = module.weight
    rt = r.to(w.device, torch.float64).t()
    module.weight = _param(w, rt @ w.double())
    if getattr(module, "bias", None) is not None:
        module.bias = _param(module.bias, rt @ module.bias.double())
    module.out_features = r.shape[1]


def is_offset_norm(lm) -> bool:
    return base_type(lm.model) in OFFSET_NORM_TYPES


def norm_scale(lm, norm: nn.Module) -> torch.Tensor:
    """The per-channel scale a norm applies after normalising (float64)."""
    w = norm.weight.detach().double()
    return 1.0 + w if is_offset_norm(lm) else w


@torch.no_grad()
def set_norm_scale(lm, norm: nn.Module, value: float, width: int) -> None:
    """Make ``norm`` apply the constant scale ``value`` over ``width`` channels."""
    w = norm.weight
    const = value - 1.0 if is_offset_norm(lm) else value
    norm.weight = _param(w, torch.full((width,), const, dtype=torch.float64))


@torch.no_grad()
def set_norm_vector(lm, norm: nn.Module, scale: torch.Tensor) -> None:
    """Make ``norm`` apply the per-channel scale ``scale`` (its width ``len(scale)``)."""
    w = norm.weight
    norm.weight = _param(w, scale.double() - 1.0 if is_offset_norm(lm) else scale.double())


def head_is_tied(lm) -> bool:
    """Whether the output head shares its tensor with the embeddings."""
    return lm.adapter.head().weight.data_ptr() == lm.adapter.embeddings().weight.data_ptr()


@torch.no_grad()
def untie_head(lm) -> bool:
    """Give the output head its own tensor when it shares the embeddings'; ``True`` when
    it was tied."""
    head = lm.adapter.head()
    tied = head_is_tied(lm)
    if tied:
        head.weight = nn.Parameter(head.weight.detach().clone(),
                                   requires_grad=head.weight.requires_grad)
    lm.model.config.tie_word_embeddings = False
    text = getattr(lm.model.config, "get_text_config", None)
    if callable(text):
        text().tie_word_embeddings = False
    return tied


@torch.no_grad()
def fold_norms(lm, keep_final: bool = False) -> None:
    """Fold every stream-reading norm's scale into its readers (the final norm's into the
    untied head) and leave the norms weight-free. The logits do not change.
    ``keep_final``: the final norm keeps its scale and a tied head stays tied."""
    if not keep_final:
        untie_head(lm)
    d = lm.adapter.hidden_size()
    for br in stream_branches(lm):
        scale = norm_scale(lm, br.norm)
        for reader in br.readers:
            scale_inputs(reader, scale)
        set_norm_scale(lm, br.norm, 1.0, d)
    if keep_final:
        return
    final = lm.adapter.final_norm()
    scale_inputs(lm.adapter.head(), norm_scale(lm, final))
    set_norm_scale(lm, final, 1.0, d)


@torch.no_grad()
def rescale_embedding(lm, new_width: int) -> None:
    """Gemma multiplies the embeddings by ``sqrt(hidden_size)``: when the width becomes
    ``new_width`` keep the product the same (weights scaled, scale buffer rewritten)."""
    emb = lm.adapter.embeddings()
    scale = getattr(emb, "embed_scale", None)
    if scale is None:
        return
    new = float(new_width) ** 0.5
    ratio = float(scale) / new
    emb.weight.mul_(ratio)
    emb.embed_scale.fill_(new)
    if hasattr(emb, "scalar_embed_scale"):
        emb.scalar_embed_scale = new
