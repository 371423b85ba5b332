"""Per-block slicing widths from measured output KL (``SliceGPT(widths="kl")``).

The energy-share allocation (``widths="spectrum"``, :mod:`.widths`) values a direction by
the share of its boundary's energy; on SmolLM2-135M and Gemma 3 270M that allocation was
worse than one uniform width (benchmarks/results/factorization.md): a block's kept
energy is not what its width costs in output quality. This module measures that cost instead.

**Curves.** On the dense, norm-folded model, for each group ``g`` (block ``g``: its two
boundaries, the attention input ``2g`` and the MLP input ``2g + 1``; group ``L``: the final
norm / head) and each width ``w`` of a grid, the model is run with only that group sliced:
the stream entering block ``g`` is projected on the top ``w`` principal directions of
boundary ``2g`` (``P_a = Q_a[:, :w] Q_a[:, :w]^T``, PCA of the dense boundary covariance,
damped as the slicing is), and the stream after the attention's residual add on the top
``w`` of boundary ``2g + 1`` (``h_mid = P_b (P_a h + attn(P_a h))``), which is what a
per-layer slice of block ``g`` alone keeps when every other boundary stays full width (the
real slice computes boundary ``2g + 1``'s basis on the sliced stream; the curve uses the
dense one). ``f_g(w)`` is the mean per-token ``KL(dense || sliced)`` over the first
``windows`` calibration windows, every position. Each curve is made monotone (a narrower
group never costs less than a wider one: the running maximum from full width down) and is
0 at full width.

**Allocation.** Assuming the groups' costs add (the usual first-order assumption of
layer-wise allocations), start every group at full width and repeatedly narrow by
``multiple`` the group whose step costs the least KL per stored parameter saved (``f_g``
interpolated linearly between grid points, exact parameter counts of
:func:`.widths.params_for_widths`), until the model fits the budget; the grid's lowest
width is each group's floor.

Cost: ``(L + 1) x (levels)`` forward passes over ``windows`` windows, plus one dense pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

from prunelab.log import info, progress
from prunelab.pruning.factor.folding import stream_branches
from prunelab.pruning.factor.subspace import pca_basis
from prunelab.pruning.factor.widths import width_counter


def width_grid(d: int, uniform: int, levels: int, multiple: int) -> list[int]:
    """``levels`` widths below ``d``, evenly spaced from just under ``d`` down to
    ``max(multiple, 2 * uniform - d)`` and rounded to ``multiple`` (``uniform`` itself is
    always one of them), descending and distinct; ``d`` is not included (its cost is 0)."""
    low = max(multiple, 2 * uniform - d)
    if levels < 1 or uniform >= d:
        return [] if uniform >= d else [uniform]
    step = (d - low) / levels
    raw = {int(round((d - step * (i + 1)) / multiple)) * multiple for i in range(levels)}
    raw.add(uniform)
    return sorted((w for w in raw if multiple <= w < d), reverse=True)


def _basis(gram: torch.Tensor, damping: float) -> torch.Tensor:
    """PCA basis (columns by decreasing eigenvalue) of the damped ``gram``, as slicing
    computes it."""
    g = gram.double()
    g = g + damping * g.diagonal().mean() * torch.eye(g.shape[0], dtype=g.dtype,
                                                      device=g.device)
    return pca_basis(g)[0]


def _projector(q: torch.Tensor, width: int) -> torch.Tensor:
    return q[:, :width] @ q[:, :width].t()


@contextmanager
def sliced_group(lm, group: int, projections: Sequence[torch.Tensor]):
    """Run ``lm`` with only ``group`` sliced (see the module docstring): ``projections``
    are ``(P_a, P_b)`` for a block, ``(P_final,)`` for the final group ``L``."""
    ad = lm.adapter
    handles = []
    ps = [p.float() for p in projections]

    def project(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return (x.float() @ p.to(x.device)).to(x.dtype)

    try:
        if group == ad.num_blocks:
            def final_pre(_m, args, kwargs):
                return (project(args[0], ps[0]), *args[1:]), kwargs
            handles.append(ad.final_norm().register_forward_pre_hook(final_pre,
                                                                     with_kwargs=True))
        else:
            seen: dict[str, torch.Tensor] = {}

            def block_pre(_m, args, kwargs):
                if args:
                    h = project(args[0], ps[0])
                    seen["h"] = h
                    return (h, *args[1:]), kwargs
                h = project(kwargs["hidden_states"], ps[0])
                seen["h"] = h
                return args, {**kwargs, "hidden_states": h}

            def owner_out(_m, _args, out):
                y = out[0] if isinstance(out, tuple) else out
                h = seen["h"]
                y = project(h + y, ps[1]) - h
                return (y, *out[1:]) if isinstance(out, tuple) else y

            owner = stream_branches(lm)[2 * group].owner
            handles.append(ad.block(group).register_forward_pre_hook(block_pre,
                                                                     with_kwargs=True))
            handles.append(owner.register_forward_hook(owner_out))
        yield lm
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def kl_curves(lm, grams: list[torch.Tensor], input_ids: torch.Tensor, grid: list[int], *,
              damping: float, batch_size: int) -> list[dict[int, float]]:
    """Per group (``L + 1``) the measured ``{width: KL}`` over ``grid`` (see the module
    docstring); ``grams``: the ``2L + 1`` boundary covariances of the dense folded model."""
    model = lm.model
    device = next(model.parameters()).device
    chunks = [input_ids[s:s + batch_size].to(device)
              for s in range(0, input_ids.shape[0], batch_size)]
    refs = [torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
            for ids in chunks]

    def mean_kl() -> float:
        total, count = 0.0, 0
        for ids, ref in zip(chunks, refs, strict=True):
            out = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
            kl = (ref.exp() * (ref - out)).sum(-1)
            total += float(kl.double().sum())
            count += kl.numel()
        return total / max(count, 1)

    groups = lm.adapter.num_blocks + 1
    curves: list[dict[int, float]] = [{} for _ in range(groups)]
    bases: dict[int, torch.Tensor] = {}
    cells = [(g, w) for g in range(groups) for w in grid]
    for g, w in progress(cells, total=len(cells), desc="slicegpt widths: KL curves"):
        ks = (len(grams) - 1,) if g == groups - 1 else (2 * g, 2 * g + 1)
        for k in ks:
            if k not in bases:
                bases[k] = _basis(grams[k], damping)
        ps = tuple(_projector(bases[k], w) for k in ks)
        with sliced_group(lm, g, ps):
            curves[g][w] = mean_kl()
    return curves


def monotone(curve: dict[int, float], d: int) -> dict[int, float]:
    """``curve`` with ``d -> 0`` added and made non-increasing in the width (the running
    maximum from the widest point down)."""
    out: dict[int, float] = {d: 0.0}
    top = 0.0
    for w in sorted(curve, reverse=True):
        if w >= d:
            continue
        top = max(top, float(curve[w]))
        out[w] = top
    return out


def interpolate(curve: dict[int, float], w: int) -> float:
    """``curve`` (monotone, keys = widths) at ``w``, linear between its points; ``inf``
    below its narrowest point."""
    ws = sorted(curve)
    if w < ws[0]:
        return float("inf")
    if w in curve:
        return curve[w]
    hi = min(x for x in ws if x > w)
    lo = max(x for x in ws if x < w)
    t = (w - lo) / (hi - lo)
    return curve[lo] * (1 - t) + curve[hi] * t


def allocate_for_kl(curves: list[dict[int, float]], sizes: list[int],
                    cost: Callable[[list[int]], int], budget: int, multiple: int
                    ) -> list[int]:
    """Greedy widths (see the module docstring): from ``sizes`` (full widths), narrow by
    ``multiple`` the group with the least KL added per parameter saved until ``cost`` is at
    most ``budget``. ``curves``: monotone, one per group. Raises ``ValueError`` when the
    budget cannot be met above the curves' floors."""
    widths = list(sizes)
    spent = cost(widths)
    while spent > budget:
        best, best_value, best_cost = None, None, None
        for g, w in enumerate(widths):
            step = min(multiple, w - min(curves[g]))
            if step <= 0:
                continue
            trial = list(widths)
            trial[g] = w - step
            c = cost(trial)
            saved = spent - c
            if saved <= 0:
                continue
            value = (interpolate(curves[g], w - step) - interpolate(curves[g], w)) / saved
            if best is None or value < best_value:
                best, best_value, best_cost = g, value, c
        if best is None:
            raise ValueError(f"the parameter budget {budget} cannot be met above the "
                             f"measured widths (reached {spent})")
        widths[best] -= min(multiple, widths[best] - min(curves[best]))
        spent = best_cost
    return widths


def allocate_by_kl(lm, grams: list[torch.Tensor], input_ids: torch.Tensor, *, uniform: int,
                   budget: int, multiple: int, levels: int, windows: int, damping: float,
                   rotation: str, batch_size: int) -> tuple[list[int], list[dict]]:
    """Measure the curves on the first ``windows`` windows and allocate; the widths and the
    curves as ``[{width: KL}]`` (for the report)."""
    d = lm.adapter.hidden_size()
    grid = width_grid(d, uniform, levels, multiple)
    ids = input_ids[:windows] if windows else input_ids
    raw = kl_curves(lm, grams, ids, grid, damping=damping, batch_size=batch_size)
    curves = [monotone(c, d) for c in raw]
    count = width_counter(lm, rotation)
    widths = allocate_for_kl(curves, [d] * len(curves), count, budget, multiple)
    info(f"slicegpt widths (KL curves, {len(grid)} levels x {len(curves)} groups on "
         f"{ids.shape[0]} windows): {min(widths)}..{max(widths)}")
    return widths, [{str(w): round(v, 6) for w, v in sorted(c.items())} for c in raw]


__all__ = ["allocate_by_kl", "allocate_for_kl", "interpolate", "kl_curves", "monotone",
           "sliced_group", "width_grid"]
