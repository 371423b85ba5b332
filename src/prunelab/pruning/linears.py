"""The linears of a block a method works on: selection by ``targets`` / ``ignore`` and the
method's own ``select`` hook, and the attention / MLP containers replayed between groups
(shared by the sparsity and factorization families)."""

from __future__ import annotations

import fnmatch

import torch


def _blocks_prefix(lm) -> str:
    blocks = lm.adapter.blocks()
    return next(name for name, m in lm.model.named_modules() if m is blocks)


def selected_linears(lm, index: int, cfg) -> dict[str, torch.nn.Module]:
    """The block's linears that ``cfg.targets`` / ``cfg.ignore`` (fnmatch patterns on the
    path in the block or in the model) and ``cfg.select(lm, index, linears)`` choose, by
    path in the block (``cfg``: a sparsity or factorization config)."""
    prefix = f"{_blocks_prefix(lm)}.{index}."
    out = {}
    for path, module in lm.adapter.linears(index).items():
        names = (path, prefix + path)
        if cfg.targets and not any(fnmatch.fnmatch(n, p) for n in names for p in cfg.targets):
            continue
        if any(fnmatch.fnmatch(n, p) for n in names for p in cfg.ignore):
            continue
        out[path] = module
    return cfg.select(lm, index, out)


def _lca(paths) -> str:
    """The deepest module path containing every path (``""``: the block itself)."""
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


def branch_containers(lm, index: int) -> list[torch.nn.Module]:
    """The attention and MLP sub-modules of block ``index`` that hold all their
    projections (the block itself excluded): replaying them skips attention."""
    blk = lm.adapter.block(index)
    out = []
    for roles in (lm.adapter.spec.attn_proj, lm.adapter.spec.mlp_proj):
        path = _lca(roles.values()) if roles else ""
        if path:
            out.append(blk.get_submodule(path))
    return out
