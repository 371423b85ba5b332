"""Architecture adapters: the only place in prunelab that knows where things live.

An :class:`Adapter` wraps a Hugging Face model and exposes, for every architecture family,
the transformer blocks, the attention projections and head geometry (GQA groups), the MLP
projections (gated or not), the norms, the final norm and the output head, plus the
structural operations every pruning method needs: deleting blocks and slicing KV groups,
query heads and FFN channels while keeping the model runnable and its config consistent.

Architecture differences are data (:class:`FamilySpec` in :mod:`prunelab.models.families`),
not forks: one generic implementation reads the spec.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from prunelab.errors import UnsupportedArchitectureError, UnsupportedOperationError
from prunelab.models.families import (
    FAMILIES,
    INPUT_GROUPS,
    FamilySpec,
    family_for_model_type,
)
from prunelab.models.linear import in_out_features, slice_linear


@dataclass(frozen=True)
class HeadGeometry:
    """Attention geometry of one block: query heads, KV heads and head dimension."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 without GQA)."""
        return self.num_heads // self.num_kv_heads


def pixel_options(module: nn.Module) -> dict:
    """``{"interpolate_pos_encoding": True}`` when ``module``'s forward takes it (ViT's
    position embeddings are fixed to one image size unless interpolated; at that size the
    interpolation is the identity), else ``{}`` (DINOv2 always interpolates)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"interpolate_pos_encoding": True} if "interpolate_pos_encoding" in params else {}


def _get(root: nn.Module, path: str | None) -> nn.Module | None:
    if not path:
        return root if path == "" else None
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _set(root: nn.Module, path: str, value: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = _get(root, parent_path) if parent_path else root
    setattr(parent, name, value)


class Adapter:
    """Generic adapter driven by a :class:`FamilySpec`.

    Block indices are 0-based positions in the current model.
    """

    def __init__(self, model: nn.Module, spec: FamilySpec):
        self.model = model
        self.spec = spec
        self.base = getattr(model, "base_model", model)
        if spec.entry is not None:  # e.g. Whisper's encoder fed log-mel features
            self.base = spec.entry(self.base)

    # ------------------------------------------------------------------ locations
    @property
    def family(self) -> str:
        return self.spec.name

    @property
    def config(self):
        return self.model.config

    @property
    def is_encoder(self) -> bool:
        return self.spec.encoder

    @property
    def is_vision(self) -> bool:
        return self.spec.modality == "vision"

    def model_inputs(self, data: torch.Tensor) -> dict:
        """Keyword arguments of the base model's forward for a batch of ``data``: token
        ids (no KV cache) or, for vision families, ``pixel_values`` (with
        ``interpolate_pos_encoding`` where the family has it, as ViT: any image size)."""
        if self.is_vision:
            return {"pixel_values": data, **pixel_options(self.base)}
        return {"input_ids": data, "use_cache": False}

    def embed_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The patch embeddings (CLS first) of ``pixel_values`` at any image size."""
        emb = self.embeddings()
        return emb(pixel_values, **pixel_options(emb))

    def blocks(self) -> nn.ModuleList:
        """The ``nn.ModuleList`` of transformer blocks."""
        return _get(self.base, self.spec.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks())

    def embeddings(self) -> nn.Module:
        return _get(self.base, self.spec.embed)

    def final_norm(self) -> nn.Module | None:
        return _get(self.base, self.spec.final_norm) if self.spec.final_norm else None

    def head(self) -> nn.Module | None:
        """The output head (``lm_head``), or ``None`` for a bare encoder."""
        get = getattr(self.model, "get_output_embeddings", None)
        return get() if get is not None else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits from the base model's final hidden states (after the final
        norm), exactly as the causal-LM class computes them (including soft-capping)."""
        head = self.head()
        if head is None:
            raise UnsupportedOperationError(f"{self.family}: this model has no LM head")
        logits = head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def block(self, index: int) -> nn.Module:
        return self.blocks()[index]

    def attention(self, index: int) -> nn.Module:
        return _get(self.block(index), self.spec.attn)

    def mlp(self, index: int) -> nn.Module:
        return _get(self.block(index), self.spec.mlp)

    def attn_projections(self, index: int) -> dict[str, nn.Module]:
        """Attention projections of block ``index`` by role (q, k, v, o, or qkv, o)."""
        blk = self.block(index)
        return {role: _get(blk, p) for role, p in self.spec.attn_proj.items()}

    def mlp_projections(self, index: int) -> dict[str, nn.Module]:
        """MLP projections by role (gate, up, down; or up, down)."""
        blk = self.block(index)
        return {role: _get(blk, p) for role, p in self.spec.mlp_proj.items()}

    def norms(self, index: int) -> dict[str, nn.Module]:
        blk = self.block(index)
        found = {p: _get(blk, p) for p in self.spec.norms}
        return {k: v for k, v in found.items() if v is not None}

    def residual_branches(self, index: int) -> dict[str, nn.Module]:
        """``{"attention": m, "mlp": m}``: modules whose output is the block's attention /
        MLP residual contribution (zeroing the output ablates the sublayer)."""
        blk = self.block(index)
        return {"attention": _get(blk, self.spec.attn_branch),
                "mlp": _get(blk, self.spec.mlp_branch)}

    def linears(self, index: int) -> dict[str, nn.Module]:
        """Every prunable linear of block ``index``, keyed by its path inside the block.

        This is how methods select what to prune: never by scanning all Linear modules of
        the model (that would catch a tied ``lm_head`` and so the embeddings).
        """
        blk = self.block(index)
        paths = list(self.spec.attn_proj.values()) + list(self.spec.mlp_proj.values())
        found = {p: _get(blk, p) for p in paths}
        return {p: m for p, m in found.items() if m is not None}  # removed branches: none

    def has_branch(self, index: int, part: str) -> bool:
        """False when block ``index``'s ``part`` ("attention" / "mlp") branch was removed
        (:mod:`prunelab.models.sublayer`): its projections are gone."""
        proj = self.attn_projections(index) if part == "attention" else \
            self.mlp_projections(index)
        return all(m is not None for m in proj.values())

    def first_block_with(self, part: str) -> int:
        """The first block that still has its ``part`` branch (0 when none has)."""
        return next((i for i in range(self.num_blocks) if self.has_branch(i, part)), 0)

    def linear_groups(self, index: int, chosen: dict[str, nn.Module] | None = None
                      ) -> list[dict[str, nn.Module]]:
        """Block ``index``'s linears (or those of ``chosen``, paths as in :meth:`linears`)
        in execution order, grouped by the tensor they read: ``[q, k, v]`` (or ``[qkv]``),
        ``[o]``, ``[gate, up]`` (or ``[gate_up]``), ``[down]``; empty groups left out."""
        chosen = self.linears(index) if chosen is None else chosen
        roles = {**self.spec.attn_proj, **self.spec.mlp_proj}
        groups = []
        for names in INPUT_GROUPS:
            g = {roles[r]: chosen[roles[r]] for r in names if r in roles and roles[r] in chosen}
            if g:
                groups.append(g)
        return groups

    def is_gated(self) -> bool:
        return "gate" in self.spec.mlp_proj or "gate_up" in self.spec.mlp_proj

    def mlp_post_normed(self, index: int) -> bool:
        """True when block ``index`` normalises its MLP output before the residual add
        (gemma2 / gemma3 ``post_feedforward_layernorm``)."""
        norms = self.norms(index)
        return any(n in norms for n in self.spec.post_norms)

    # ------------------------------------------------------------------ geometry
    def head_geometry(self, index: int = 0) -> HeadGeometry:
        """Query heads, KV heads and head dim of block ``index``, read from its weights."""
        cfg = self.config
        hd = self.spec.head_dim(cfg)
        proj = self.attn_projections(index)
        if "qkv" in proj:  # fused: (heads + 2 kv) * hd outputs; o reads heads * hd
            heads = in_out_features(proj["o"])[0] // hd
            kv = (in_out_features(proj["qkv"])[1] // hd - heads) // 2
            return HeadGeometry(heads, kv, hd)
        heads = in_out_features(proj["q"])[1] // hd
        kv = in_out_features(proj["k"])[1] // hd
        return HeadGeometry(heads, kv, hd)

    def ffn_width(self, index: int = 0) -> int:
        return in_out_features(self.mlp_projections(index)["down"])[0]

    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def layer_types(self) -> list[str] | None:
        types = getattr(self.config, "layer_types", None)
        return list(types) if types is not None else None

    # ------------------------------------------------------------------ operations
    def delete_blocks(self, indices) -> list[int]:
        """Delete the blocks at ``indices`` (0-based, current numbering).

        Renumbers ``layer_idx`` of the remaining blocks, and updates
        ``config.num_hidden_layers`` and ``config.layer_types`` (each kept block keeps
        its own attention type). Returns the kept original positions.
        """
        n = self.num_blocks
        drop = sorted({int(i) for i in indices})
        if any(i < 0 or i >= n for i in drop):
            raise UnsupportedOperationError(f"block indices {drop} out of range 0..{n - 1}")
        if len(drop) >= n:
            raise UnsupportedOperationError(f"cannot delete all {n} blocks")
        keep = [i for i in range(n) if i not in drop]
        self.reorder_blocks(keep)
        return keep

    def reorder_blocks(self, order: list[int]) -> None:
        """Make the stack ``[blocks[i] for i in order]`` (deletion, reordering, repeats
        are not allowed: a block object appears once). Keeps config and indices consistent."""
        if len(set(order)) != len(order):
            raise UnsupportedOperationError("a block may appear only once in a new order")
        old = self.blocks()
        types = self.layer_types()
        new = nn.ModuleList([old[i] for i in order])
        _set(self.base, self.spec.blocks, new)
        setattr(self.config, self.spec.layers_field, len(order))
        if types is not None and len(types) == len(old):
            self.config.layer_types = [types[i] for i in order]
        for pos, blk in enumerate(new):
            for module in blk.modules():
                if hasattr(module, "layer_idx"):
                    module.layer_idx = pos

    def slice_kv_groups(self, index: int, keep) -> None:
        """Keep only the KV groups ``keep`` of block ``index`` (a group is one KV head and
        the query heads that share it; a head when the model has no GQA)."""
        geo = self.head_geometry(index)
        keep = sorted(int(g) for g in keep)
        if not keep or keep[-1] >= geo.num_kv_heads or keep[0] < 0:
            raise UnsupportedOperationError(
                f"block {index}: keep groups {keep} invalid for {geo.num_kv_heads} KV groups"
            )
        hd, gs = geo.head_dim, geo.group_size
        proj = self.attn_projections(index)
        if "qkv" in proj:
            rows = self.spec.fused_qkv_rows(keep, geo)
            slice_linear(proj["qkv"], rows, "out")
        else:
            q_rows = _ranges([(g * gs * hd, (g + 1) * gs * hd) for g in keep])
            kv_rows = _ranges([(g * hd, (g + 1) * hd) for g in keep])
            slice_linear(proj["q"], q_rows, "out")
            slice_linear(proj["k"], kv_rows, "out")
            slice_linear(proj["v"], kv_rows, "out")
        o_cols = _ranges([(g * gs * hd, (g + 1) * gs * hd) for g in keep])
        slice_linear(proj["o"], o_cols, "in")
        self._set_heads(index, len(keep) * gs, len(keep), hd)

    def slice_query_heads(self, index: int, keep_per_group) -> None:
        """Keep, inside every KV group ``g``, the query heads ``keep_per_group[g]``
        (indices within the group). Every group must keep the same count."""
        geo = self.head_geometry(index)
        if "qkv" in self.attn_projections(index) or geo.group_size == 1:
            raise UnsupportedOperationError(
                f"{self.family}: query-head pruning inside groups needs GQA/MQA with "
                "separate q/k/v projections (prune whole heads instead)"
            )
        if len(keep_per_group) != geo.num_kv_heads:
            raise UnsupportedOperationError(
                f"block {index}: need one keep list per KV group ({geo.num_kv_heads})"
            )
        counts = {len(k) for k in keep_per_group}
        if len(counts) != 1 or 0 in counts:
            raise UnsupportedOperationError("every KV group must keep the same (>0) query heads")
        hd, gs = geo.head_dim, geo.group_size
        spans = []
        for g, keep in enumerate(keep_per_group):
            for h in sorted(int(x) for x in keep):
                if not 0 <= h < gs:
                    raise UnsupportedOperationError(f"query head {h} not in group of {gs}")
                start = (g * gs + h) * hd
                spans.append((start, start + hd))
        rows = _ranges(spans)
        proj = self.attn_projections(index)
        slice_linear(proj["q"], rows, "out")
        slice_linear(proj["o"], rows, "in")
        new_gs = counts.pop()
        self._set_heads(index, new_gs * geo.num_kv_heads, geo.num_kv_heads, hd)

    def _set_heads(self, index: int, heads: int, kv: int, hd: int) -> None:
        """Write the new head counts into the attention module's attributes that hold
        them (``FamilySpec.head_attributes``); a ``config.`` path gets the module a
        config of its own, so the other blocks keep theirs."""
        attn = self.attention(index)
        values = {"heads": heads, "kv": kv, "groups": heads // kv, "width": heads * hd}
        for path, quantity in self.spec.head_attributes.items():
            owner_path, _, name = path.rpartition(".")
            if owner_path == "config":
                attn.config = copy.copy(attn.config)
                setattr(attn.config, name, values[quantity])
                continue
            owner = _get(attn, owner_path) if owner_path else attn
            if owner is not None and hasattr(owner, name):
                setattr(owner, name, values[quantity])

    def head_attribute_values(self, index: int) -> dict[str, dict[str, int]]:
        """``{module path in the attention ("" = itself): {attribute: value}}`` for every
        head attribute present (``config.<name>`` keys sit on the attention itself)."""
        attn = self.attention(index)
        found: dict[str, dict[str, int]] = {}
        for path in self.spec.head_attributes:
            owner_path, _, name = path.rpartition(".")
            if owner_path == "config":  # read from its config, reported on the attention
                owner_path, name = "", path
                value = getattr(getattr(attn, "config", None), path[len("config."):], None)
            else:
                owner = _get(attn, owner_path) if owner_path else attn
                value = getattr(owner, name, None)
            if isinstance(value, int):
                found.setdefault(owner_path, {})[name] = int(value)
        return found

    def slice_ffn(self, index: int, keep) -> None:
        """Keep only the FFN channels ``keep`` of block ``index``."""
        width = self.ffn_width(index)
        keep = torch.as_tensor(sorted(int(c) for c in keep), dtype=torch.long)
        if len(keep) == 0 or keep[-1] >= width or keep[0] < 0:
            raise UnsupportedOperationError(
                f"block {index}: invalid FFN channels for width {width}")
        proj = self.mlp_projections(index)
        for role in ("gate", "up"):
            if role in proj:
                slice_linear(proj[role], keep, "out")
        if "gate_up" in proj:
            slice_linear(proj["gate_up"], self.spec.gate_up_rows(keep, width), "out")
        slice_linear(proj["down"], keep, "in")

    # ------------------------------------------------------------------ config
    def vanilla_problems(self) -> list[str]:
        """Reasons why the current shapes cannot be written as a plain config (empty when
        a checkpoint of this model loads with plain ``transformers``)."""
        n = self.num_blocks
        geos = {self.head_geometry(i) for i in range(n) if self.has_branch(i, "attention")}
        ffns = {self.ffn_width(i) for i in range(n) if self.has_branch(i, "mlp")}
        problems = []
        if len(geos) > 1:
            problems.append("blocks have different head counts")
        if len(ffns) > 1:
            problems.append("blocks have different FFN widths")
        if len(geos) == 1:
            geo = next(iter(geos))
            msg = self.spec.heads_representable(self.config, geo)
            if msg:
                problems.append(msg)
        if not problems:
            msg = self._config_rejects()
            if msg:
                problems.append(msg)
        return problems

    def _config_rejects(self) -> str:
        """Why transformers' own config validation refuses the current uniform shapes
        (e.g. Gemma 3 wants ``hidden_size % num_attention_heads == 0`` even though its
        ``head_dim`` is explicit); empty when it accepts them or cannot check."""
        cfg = copy.deepcopy(self.config)
        validate = getattr(cfg, "validate", None)
        if not callable(validate):
            return ""
        try:
            setattr(cfg, self.spec.layers_field, self.num_blocks)
            self._write_shapes(cfg)
            validate()
        except Exception as exc:  # noqa: BLE001 - any refusal makes the shapes non-vanilla
            cause = exc.__cause__ or exc
            text = str(cause).strip().splitlines()
            return (f"transformers' {type(cfg).__name__} refuses these shapes"
                    + (f" ({text[-1].strip()})" if text else ""))
        return ""

    def sync_config(self) -> None:
        """Write the current (uniform) shapes into the config.

        Raises :class:`UnsupportedOperationError` when a plain config cannot describe the
        model (non-uniform blocks, or head counts the family derives from hidden size).
        """
        problems = self.vanilla_problems()
        if problems:
            raise UnsupportedOperationError(
                f"{self.family}: the pruned shapes need a custom modeling file ("
                + "; ".join(problems) + ")"
            )
        cfg = self.config
        setattr(cfg, self.spec.layers_field, self.num_blocks)
        self._write_shapes(cfg)

    def _write_shapes(self, cfg) -> None:
        """Write the blocks' (uniform) head geometry and FFN width into ``cfg``; a part
        that no block has any more (every attention or every MLP branch removed) leaves
        its config fields as they are."""
        n = range(self.num_blocks)
        attn = next((i for i in n if self.has_branch(i, "attention")), None)
        mlp = next((i for i in n if self.has_branch(i, "mlp")), None)
        hd = self.spec.head_dim(cfg)
        geo = self.head_geometry(attn) if attn is not None else HeadGeometry(1, 1, hd)
        ffn = self.ffn_width(mlp) if mlp is not None else 1
        if attn is not None and mlp is not None:
            self.spec.write_config(cfg, geo, ffn)
            return
        # the fields of the missing part: those two placeholder writes set differently
        one, two = copy.deepcopy(cfg), copy.deepcopy(cfg)
        self.spec.write_config(one, geo, ffn)
        self.spec.write_config(two, geo if attn is not None else HeadGeometry(2, 2, hd),
                               ffn if mlp is not None else 2)
        a, b = one.to_dict(), two.to_dict()
        keep = {k for k in a if a.get(k) != b.get(k)}
        for k, v in a.items():
            if k not in keep and getattr(cfg, k, None) != v:
                setattr(cfg, k, v)


def _ranges(spans: list[tuple[int, int]]) -> torch.Tensor:
    if not spans:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(a, b) for a, b in spans])


def get_adapter(model: nn.Module) -> Adapter:
    """Adapter for ``model``; a clear error lists the supported architectures."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = family_for_model_type(model_type)
    if spec is None:
        supported = ", ".join(sorted(t for f in FAMILIES for t in f.model_types))
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}; supported: {supported}"
        )
    adapter = Adapter(model, spec)
    if adapter.blocks() is None:
        raise UnsupportedArchitectureError(
            f"{type(model).__name__} ({model_type}) has no blocks at {spec.blocks!r}"
        )
    return adapter
