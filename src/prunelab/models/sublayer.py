"""Remove an attention or MLP sub-block (branch) from a block, for real.

A pre-norm decoder block computes ``h + attn(norm_a(h))`` then ``h + mlp(norm_m(h))``
(Gemma 2 / 3 also normalise each branch's output). Removing a branch replaces the branch
with a module that returns zeros and its norms with the identity, so the block costs
nothing for that branch and its output is exactly the block with the branch zeroed (what
the ``sublayer-ablation`` probe measures). A block that loses both branches is deleted
instead (:meth:`~prunelab.models.adapters.Adapter.delete_blocks`), so a removal of whole
blocks only stays a plain checkpoint; a block keeping one branch is a custom module
(:mod:`prunelab.models.custom`) and its checkpoint loads with ``trust_remote_code=True``.

The removed attention still records its position in a KV cache (one float per token, a
``[batch, 1, tokens, 1]`` entry) so that ``generate`` counts past tokens right even when
block 0 lost its attention (transformers reads the cache length from the first layer).

Used by depth search at sub-layer granularity (BlockPruner, Zhong et al. 2024,
"BlockPruner: Fine-grained Pruning for Large Language Models") and by static sublayer gates.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from prunelab.errors import UnsupportedOperationError
from prunelab.models.custom import PrunelabModule, install, register_module

PARTS = ("attention", "mlp")


@register_module
class SkippedAttention(PrunelabModule):
    """An attention branch removed from its block: returns zeros (and no weights); keeps the
    token count of a KV cache with a one-float entry per token."""

    prunelab_kind = "skipped_attention"

    def __init__(self, layer_idx: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx

    def prunelab_spec(self) -> dict:
        return {"layer_idx": self.layer_idx}

    def forward(self, hidden_states=None, *args, **kwargs):
        if hidden_states is None:
            hidden_states = args[0]
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and self.layer_idx is not None and hasattr(cache, "update"):
            b, t = hidden_states.shape[0], hidden_states.shape[1]
            stub = hidden_states.new_zeros(b, 1, t, 1)
            cache.update(stub, stub, self.layer_idx)
        return torch.zeros_like(hidden_states), None

    def flops_per_token(self) -> int:
        return 0


@register_module
class SkippedMLP(PrunelabModule):
    """An MLP branch removed from its block: returns zeros."""

    prunelab_kind = "skipped_mlp"

    def prunelab_spec(self) -> dict:
        return {}

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states)

    def flops_per_token(self) -> int:
        return 0


@register_module
class SkippedNorm(PrunelabModule):
    """The norm of a removed branch: the identity (its output only feeds the removed branch,
    or is the branch's zero output)."""

    prunelab_kind = "skipped_norm"

    def prunelab_spec(self) -> dict:
        return {}

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states

    def flops_per_token(self) -> int:
        return 0


def branch_paths(adapter, index: int, part: str) -> tuple[str, list[str]]:
    """``(branch path, norm paths)`` inside block ``index`` for ``part`` ("attention" or
    "mlp"): the module whose output is the branch and the norms that only serve it.

    Refuses families that are not pre-norm decoders with ``self_attn`` / ``mlp`` branches
    (GPT-2, GPT-NeoX's parallel residual, OPT, BERT's post-norm)."""
    if part not in PARTS:
        raise UnsupportedOperationError(f"sub-block must be attention or mlp, got {part!r}")
    spec = adapter.spec
    if spec.attn_branch != "self_attn" or spec.mlp_branch != "mlp" or adapter.is_encoder:
        raise UnsupportedOperationError(
            f"{adapter.family}: sub-block removal needs a pre-norm decoder with self_attn / "
            "mlp branches (llama, mistral, qwen2/3, gemma 1-3, phi3)")
    present = set(adapter.norms(index))
    four = "pre_feedforward_layernorm" in present  # gemma2 / gemma3: pre and post norms
    if part == "attention":
        norms = ["input_layernorm"] + (["post_attention_layernorm"] if four else [])
        return spec.attn_branch, norms
    norms = (["pre_feedforward_layernorm", "post_feedforward_layernorm"] if four
             else ["post_attention_layernorm"])
    return spec.mlp_branch, norms


def is_removed(adapter, index: int, part: str) -> bool:
    """True when block ``index``'s ``part`` branch has been removed."""
    branch, _ = branch_paths(adapter, index, part)
    kind = "skipped_attention" if part == "attention" else "skipped_mlp"
    module = adapter.block(index).get_submodule(branch)
    return getattr(type(module), "prunelab_kind", None) == kind


def removed_sublayers(adapter) -> list[tuple[int, str]]:
    """Every ``(block, part)`` whose branch is removed, in stack order."""
    out = []
    for i in range(adapter.num_blocks):
        for part in PARTS:
            try:
                if is_removed(adapter, i, part):
                    out.append((i, part))
            except UnsupportedOperationError:
                return []
    return out


def sublayer_params(adapter, index: int, part: str) -> int:
    """Parameters of block ``index``'s ``part`` branch and its norms (what removal saves)."""
    branch, norms = branch_paths(adapter, index, part)
    blk = adapter.block(index)
    mods = [blk.get_submodule(branch)] + [blk.get_submodule(n) for n in norms]
    return sum(p.numel() for m in mods for p in m.parameters())


def _attention_layer_idx(module: nn.Module, index: int) -> int:
    return int(getattr(module, "layer_idx", index))


def remove_sublayers(lm, parts: Iterable[tuple[int, str]]) -> dict:
    """Remove the ``(block, part)`` branches (0-based current block numbering) from
    ``lm``'s model in place; blocks that lose both branches (now or earlier) are deleted.

    Returns ``{"sublayers": [[i, part], ...], "deleted_blocks": [...], "kept_blocks":
    [...original positions...], "params_removed": n}``."""
    adapter = lm.adapter
    todo = sorted({(int(i), str(p)) for i, p in parts})
    n = adapter.num_blocks
    for i, part in todo:
        if not 0 <= i < n:
            raise UnsupportedOperationError(f"block {i} out of range 0..{n - 1}")
        branch_paths(adapter, i, part)  # refuse before touching anything
    names = {id(m): name for name, m in lm.model.named_modules()}
    removed = 0
    for i, part in todo:
        if is_removed(adapter, i, part):
            continue
        removed += sublayer_params(adapter, i, part)
        branch, norms = branch_paths(adapter, i, part)
        blk = adapter.block(i)
        prefix = names[id(blk)]
        if part == "attention":
            module = SkippedAttention(_attention_layer_idx(blk.get_submodule(branch), i))
        else:
            module = SkippedMLP()
        install(lm.model, f"{prefix}.{branch}", module)
        for norm in norms:
            install(lm.model, f"{prefix}.{norm}", SkippedNorm())
    gone = [i for i in range(n) if all(is_removed(adapter, i, p) for p in PARTS)]
    kept = adapter.delete_blocks(gone) if gone else list(range(n))
    remaining = [[i, p] for i, p in todo if i not in gone]
    return {"sublayers": [[i, p] for i, p in todo], "deleted_blocks": gone,
            "kept_blocks": kept, "partial_blocks": remaining, "params_removed": removed}
