"""Closed-form recovery folded into the last kept block before a cut (no extra parameters).

Both need blocks whose MLP (and attention) output is added straight to the residual
stream; families with post-sublayer norms (gemma2, gemma3, bert) are refused.

* ``foldable`` (ReplaceMe, Shopkhoev et al. 2025): with ``m_k`` the MLP output of the last
  kept block ``k`` and ``a_k = h_{k+1} - m_k`` the rest of its output, solve
  ``T = argmin ||m_k T - (Y - a_k)||^2`` (ridge, float64) and fold it into the down
  projection, ``W_down <- T^T W_down`` (and ``b <- b T``). ``Y`` is the dense model's hidden
  state after the removed span.
* ``boundary`` (XMerge-style local reconstruction; derived): re-fit the attention output
  projection and then the MLP down projection of block ``k`` by ridge least squares so the
  block's output matches ``Y``: ``W^T = (Z^T Z + lambda I)^{-1} Z^T (Y - R)``, ``Z`` the
  projection's input, ``R`` the rest of the block's output (bias fitted when present).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.errors import UnsupportedOperationError
from prunelab.lstsq import NormalEquations
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.models.streaming import mark_modified
from prunelab.models.vision import fold_layer_scales
from prunelab.pruning.depth.selection import contiguous_spans

if TYPE_CHECKING:  # annotations only
    from prunelab.probes import ProbeContext
    from prunelab.pruning.depth.config import Depth


def check_additive(adapter, index: int, recovery: str) -> None:
    """Refuse folding into blocks whose branches pass through a norm before the residual."""
    if adapter.is_vision:  # pre-LN ViT / DINOv2: fold LayerScale so branches are additive
        fold_layer_scales(adapter)
        return
    if adapter.is_encoder or adapter.mlp_post_normed(index):
        raise UnsupportedOperationError(
            f"{recovery} recovery needs MLP outputs added straight to the residual stream; "
            f"{adapter.config.model_type} normalises them (use ghost or lra)")


def fit_foldable(runner, index: int, inputs, targets, ridge: float = 1e-6) -> dict:
    """Fit and fold ReplaceMe's ``T`` into block ``index``'s down projection; returns fit
    statistics (``error_before``, ``error_after``: summed squared error at the cut)."""
    ad = runner.adapter
    check_additive(ad, index, "foldable")
    mlp_out = ad.residual_branches(index)["mlp"]
    outs, taps = runner.tap(index, inputs, {"m": mlp_out})
    t, before = foldable_map(outs, taps["m"], targets, ridge)
    fold_map(ad.mlp_projections(index)["down"], t)
    mark_modified(runner, ad.block(index))  # streamed: staged when it leaves memory
    return {"error_before": before, "error_after": _error(runner, index, inputs, targets)}


def foldable_map(outs, mlps, targets, ridge: float = 1e-6) -> tuple[torch.Tensor, float]:
    """ReplaceMe's ``T`` (float64 ``[d, d]``: ``m -> m T``) from a block's outputs
    ``outs``, its MLP outputs ``mlps`` and the dense ``targets`` (one tensor per batch,
    ``[B, T, d]``), and the summed squared error at the cut before the fit."""
    eq = NormalEquations()
    before = 0.0
    for out, m, y in zip(outs, mlps, targets, strict=True):
        out, m, y = _rows(out), _rows(m), _rows(y)  # some families flatten tokens (opt)
        rest = out - m
        eq.update(m, y - rest)
        before += float((out - y).pow(2).sum())
    return eq.solve(ridge), before


def fold_map(down, t: torch.Tensor) -> None:
    """Fold ``T`` into the down projection ``down``: ``W <- T^T W`` (and ``b <- b T``)."""
    w = weight_out_in(down).detach().double()
    set_weight_out_in(down, t.t().to(w.device) @ w)
    if getattr(down, "bias", None) is not None:
        with torch.no_grad():
            down.bias.copy_((down.bias.double() @ t.to(down.bias.device)).to(down.bias.dtype))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., d] -> [tokens, d]`` in float64."""
    return x.reshape(-1, x.shape[-1]).double()


def _error(runner, index, inputs, targets) -> float:
    outs = runner.run_block(index, inputs)
    return sum(float((o.double() - y.double()).pow(2).sum()) for o, y in zip(outs, targets,
                                                                             strict=True))


def _refit_projection(runner, index, inputs, targets, proj, ridge) -> None:
    """Re-fit ``proj`` (a branch's last linear) so the block output matches ``targets``."""
    outs, taps = runner.tap(index, inputs, {"z": proj}, what="input")
    _, outp = runner.tap(index, inputs, {"p": proj})
    has_bias = getattr(proj, "bias", None) is not None
    eq = NormalEquations(affine=has_bias)
    for out, z, p, y in zip(outs, taps["z"], outp["p"], targets, strict=True):
        rest = _rows(out) - _rows(p)
        eq.update(_rows(z), _rows(y) - rest)
    sol = eq.solve(ridge)
    d_in = weight_out_in(proj).shape[1]
    set_weight_out_in(proj, sol[:d_in].t())
    if has_bias:
        with torch.no_grad():
            proj.bias.copy_(sol[d_in].to(proj.bias.dtype))


def fit_boundary(runner, index: int, inputs, targets, ridge: float = 1e-6) -> dict:
    """Re-fit block ``index``'s attention output and down projections (see module)."""
    ad = runner.adapter
    check_additive(ad, index, "boundary")
    before = _error(runner, index, inputs, targets)
    _refit_projection(runner, index, inputs, targets, ad.attn_projections(index)["o"], ridge)
    _refit_projection(runner, index, inputs, targets, ad.mlp_projections(index)["down"], ridge)
    return {"error_before": before, "error_after": _error(runner, index, inputs, targets)}


def recover(lm, cfg: Depth, ctx: ProbeContext, removed: list[int], batch_size: int,
            spans: list | None = None) -> list:
    """Fit ``cfg.recovery`` at every cut of the (already shortened) model, in order;
    returns one record per cut (span, where, fit statistics). ``spans``: repair only these
    half-open ``[s, e)`` spans (recovery in the loop: where the repair helped)."""
    recovery = cfg.recovery
    cuts = {}  # new index of the last kept block before the cut -> dense target
    keep = None if spans is None else {tuple(sp) for sp in spans}
    for s, e in contiguous_spans(removed):
        if keep is not None and (s, e) not in keep:
            continue
        k = s - 1 - sum(1 for r in removed if r < s)
        cuts[k] = (s, e, ctx.boundary(e))
    for k in sorted(cuts):
        recovery.check(lm.adapter, k)
    runner = BlockRunner(lm, ctx.input_ids, batch_size=batch_size)
    runner.capture()
    records = []
    if -1 in cuts:  # span starting at block 0: repair the embeddings' output
        s, e, y = cuts.pop(-1)
        runner.inputs, stats = recovery.at_embeddings(runner, runner.inputs, y)
        records.append({"span": [s, e], "after": "embeddings", **stats})
    if not cuts:
        return records

    def on_block(i, inputs):
        if i in cuts:
            s, e, y = cuts[i]
            stats = recovery.at_block(runner, i, inputs, y)
            records.append({"span": [s, e], "after": f"block {i} (new numbering)", **stats})

    runner.run(on_block=on_block, propagate="modified", until=max(cuts), desc="recovery")
    return records
