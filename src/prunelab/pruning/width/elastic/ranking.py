"""Elastic ranking: one learned score per unit, on one scale, good at every budget.

Source: the "differentiable relaxation of the functional unit-ranking problem" of an
unpublished proposal ("elastic transformers"); the goal, one model good at every width, is
MatFormer's (Devvrit et al. 2023, "MatFormer: Nested Transformer for Elastic Inference"),
which trains the nested widths instead of ranking the units of a frozen model. The units are
every KV group (query heads sharing one key/value head; a head without GQA) and every FFN
channel of every block; a unit ``u`` has a score ``s_u`` and a parameter cost ``c_u`` (its
rows / columns of the projections, :func:`prunelab.pruning.width.plan.group_cost` /
``channel_cost``).

Relaxation. Scores are standardised, ``z = (s - mean s) / std s`` (so the temperature has a
fixed meaning). For a removal budget ``b`` (fraction of the units' parameters), the
threshold ``tau_b`` is the cost-weighted quantile of ``z``: with the units in ascending
order and ``k`` the fewest lowest units whose costs cover ``b sum c``, ``tau_b`` is the
midpoint between the ``k``-th and ``k+1``-th sorted scores (:func:`threshold`; sorted values
are differentiable, so ``tau_b`` moves with the scores). The soft keep mask is
``m_u = sigmoid((z_u - tau_b) / T)``; at ``T -> 0`` it is exactly the hard mask that removes
those ``k`` units (:func:`hard_keep`). A unit's mask scales its consumer input columns
(``o_proj`` columns of the group, ``down_proj`` column of the channel), which is what
removing it does when it is 0.

Objective (weights frozen): for budgets ``b`` drawn uniformly from ``[lo, hi]`` each step,
the mean over budgets of ``KL(p_dense || p_masked)`` per token for decoders, or
``1 - cos`` of the mean-pooled embeddings for encoders; Adam on ``s``; ``T`` annealed
geometrically from ``t_start`` to ``t_end``. Initial scores: the log of the weight-only
contribution norm of each unit (magnitude profile), standardised per kind, so heads and
channels start on one scale and the fit moves them.

Departures from the seed: the threshold uses the units' parameter costs (the seed ranks
neurons and heads by count); the scores are static (no per-input routing); a few budgets
per step rather than the full range; only the last-layer output loss (no intermediate
distillation terms).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from prunelab.models.linear import weight_out_in
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.plan import channel_cost, group_cost


# ---------------------------------------------------------------- pure maths
def standardise(s: torch.Tensor) -> torch.Tensor:
    """``(s - mean) / std`` (std floored at 1e-12)."""
    return (s - s.mean()) / s.std().clamp_min(1e-12)


def removed_count(scores: torch.Tensor, costs: torch.Tensor, budget: float) -> int:
    """``k``: the fewest lowest-scored units whose costs reach ``budget * sum(costs)``
    (at most ``n - 1``; 0 for a zero budget)."""
    order = torch.argsort(scores.detach(), stable=True)
    cum = torch.cumsum(costs[order].double(), 0)
    need = budget * float(cum[-1])
    if need <= 0:
        return 0
    return min(int((cum < need * (1 - 1e-12)).sum()) + 1, len(scores) - 1)


def threshold(scores: torch.Tensor, costs: torch.Tensor, budget: float) -> torch.Tensor:
    """``tau_b``: midpoint between the last removed and the first kept score (scalar,
    differentiable in ``scores``); below every score for a zero budget."""
    k = removed_count(scores, costs, budget)
    ordered = torch.sort(scores, stable=True).values
    if k == 0:
        return ordered[0] - 1.0
    return 0.5 * (ordered[k - 1] + ordered[k])


def soft_keep(scores: torch.Tensor, costs: torch.Tensor, budget: float,
              temperature: float) -> torch.Tensor:
    """``sigmoid((z_u - tau_b) / T)`` with ``z`` the standardised scores ``[n]``."""
    z = standardise(scores)
    return torch.sigmoid((z - threshold(z, costs, budget)) / temperature)


def hard_keep(scores: torch.Tensor, costs: torch.Tensor, budget: float) -> torch.Tensor:
    """Bool keep mask removing the :func:`removed_count` lowest-scored units."""
    keep = torch.ones(len(scores), dtype=torch.bool)
    keep[torch.argsort(scores.detach(), stable=True)[:removed_count(scores, costs, budget)]] \
        = False
    return keep


def temperature_at(step: int, steps: int, t_start: float, t_end: float) -> float:
    """Geometric annealing from ``t_start`` (step 0) to ``t_end`` (last step)."""
    if steps <= 1:
        return t_end
    return t_start * (t_end / t_start) ** (step / (steps - 1))


# ---------------------------------------------------------------- units of a model
@dataclass
class Units:
    """Every ranked unit of a model, flat: block ``i`` holds ``heads[i]`` KV groups (0 when
    heads are not ranked: multi-query models) then ``ffn[i]`` channels; ``costs`` ``[n]``
    parameters per unit."""

    heads: list[int]
    ffn: list[int]
    costs: torch.Tensor

    @property
    def n(self) -> int:
        return len(self.costs)

    def spans(self) -> list[tuple[slice, slice]]:
        """Per block ``(heads slice, ffn slice)`` into the flat vector."""
        out, at = [], 0
        for h, f in zip(self.heads, self.ffn, strict=True):
            out.append((slice(at, at + h), slice(at + h, at + h + f)))
            at += h + f
        return out

    def split(self, flat: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        return [{"heads": flat[a], "ffn": flat[b]} for a, b in self.spans()]


def model_units(ad) -> Units:
    """The units of a model through its adapter (heads ranked only when every block has
    more than one KV group)."""
    n = ad.num_blocks
    rank_heads = all(ad.head_geometry(i).num_kv_heads > 1 for i in range(n))
    heads = [ad.head_geometry(i).num_kv_heads if rank_heads else 0 for i in range(n)]
    ffn = [ad.ffn_width(i) for i in range(n)]
    costs = []
    for i in range(n):
        costs += [group_cost(ad, i)] * heads[i] + [channel_cost(ad, i)] * ffn[i]
    return Units(heads, ffn, torch.tensor(costs, dtype=torch.float64))


def initial_scores(ad, units: Units) -> torch.Tensor:
    """Log magnitude-profile norm of each unit, standardised per kind ``[n]`` float32."""
    heads, ffn = [], []
    for i in range(ad.num_blocks):
        if units.heads[i]:
            geo = ad.head_geometry(i)
            col = S.magnitude_columns(weight_out_in(ad.attn_projections(i)["o"]).detach())
            cols = S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim)
            heads.append(S.unit_scores(col.float(), cols, "norm"))
        down = weight_out_in(ad.mlp_projections(i)["down"]).detach()
        ffn.append(S.magnitude_columns(down).float().sqrt())
    parts = {}
    for kind, vals in (("heads", heads), ("ffn", ffn)):
        if vals:
            parts[kind] = standardise(torch.cat(vals).clamp_min(1e-12).log()).split(
                [len(v) for v in vals])
    out = []
    for i in range(ad.num_blocks):
        if units.heads[i]:
            out.append(parts["heads"][len([h for h in units.heads[:i] if h])])
        out.append(parts["ffn"][i])
    return torch.cat(out).float()


# ---------------------------------------------------------------- masking a model
def _column_index(ad, i: int) -> torch.Tensor:
    """For each input column of block ``i``'s ``o_proj``, the KV group it belongs to."""
    geo = ad.head_geometry(i)
    idx = torch.empty(geo.num_heads * geo.head_dim, dtype=torch.long)
    for g, cols in enumerate(S.head_units(geo.num_heads, geo.num_kv_heads, geo.head_dim)):
        idx[cols] = g
    return idx


@contextlib.contextmanager
def masked(lm, units: Units, mask: torch.Tensor):
    """Within the context, every unit's consumer input columns are scaled by its entry of
    ``mask`` ``[n]`` (0 = removed); forward pre-hooks on ``o_proj`` / ``down_proj``, always
    removed on exit. ``mask`` may require grad."""
    ad = lm.adapter
    handles = []

    def scaler(mult_fn):
        def hook(_module, args):
            x = args[0]
            return (x * mult_fn().to(x.dtype).to(x.device), *args[1:])
        return hook

    try:
        for i, (hs, fs) in enumerate(units.spans()):
            if units.heads[i]:
                idx = _column_index(ad, i)
                handles.append(ad.attn_projections(i)["o"].register_forward_pre_hook(
                    scaler(lambda hs=hs, idx=idx: mask[hs][idx])))
            handles.append(ad.mlp_projections(i)["down"].register_forward_pre_hook(
                scaler(lambda fs=fs: mask[fs])))
        yield
    finally:
        for h in handles:
            h.remove()
