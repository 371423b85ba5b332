"""Forward-free weight redundancy (derived from the weight-redundancy pruning idea, WRP:
redundant blocks have small outputs that resemble another block's; no reference code).

From weights alone, no data: for every pair of blocks the cosine similarity of their
flattened attention output projections ``W_O`` and MLP down projections ``W_down``
(``similarity = (cos_O + cos_down) / 2``), and per block the relative projection scale
``scale_i = (||W_O,i||_F / mean_l ||W_O,l||_F + ||W_down,i||_F / mean_l ||W_down,l||_F) / 2``.
Per block ``value = scale_i * (1 - max_{j != i} similarity(i, j))``: a block with small
output weights that resemble another block's is the most removable (lowest value).
Pair entries (``kind: "pair"``) carry the similarity, where high means redundant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.models.linear import weight_out_in
from prunelab.probes.base import PROBES, ProbeResult, config_dict


def _flat(module) -> torch.Tensor:
    return weight_out_in(module).detach().reshape(-1).double().cpu()


def weight_redundancy(o_weights: list[torch.Tensor], down_weights: list[torch.Tensor]):
    """``(similarity [L, L], scale [L], value [L])`` from flattened weights (see module)."""
    def cos_matrix(ws):
        shapes = {w.shape for w in ws}
        if len(shapes) != 1:  # widths differ after pruning: compare Gram-free norms only
            return torch.eye(len(ws), dtype=torch.float64)
        m = torch.stack(ws)
        m = m / m.norm(dim=1, keepdim=True).clamp_min(1e-300)
        return m @ m.t()

    sim = (cos_matrix(o_weights) + cos_matrix(down_weights)) / 2
    o_norm = torch.stack([w.norm() for w in o_weights])
    d_norm = torch.stack([w.norm() for w in down_weights])
    scale = (o_norm / o_norm.mean() + d_norm / d_norm.mean()) / 2
    off = sim.clone()
    off.fill_diagonal_(float("-inf"))
    best = off.max(dim=1).values if len(o_weights) > 1 else torch.zeros(1, dtype=sim.dtype)
    return sim, scale, scale * (1 - best)


@PROBES.register("weight-redundancy", forward=False)
@dataclass(frozen=True)
class WeightRedundancy:
    """Forward-free weight redundancy: similarity and scale of W_O and W_down per block.

    No options: the probe reads only the weights."""

    def run(self, ctx) -> ProbeResult:
        ad = ctx.adapter
        n = ad.num_blocks
        o = [_flat(ad.attn_projections(i)["o"]) for i in range(n)]
        d = [_flat(ad.mlp_projections(i)["down"]) for i in range(n)]
        sim, scale, value = weight_redundancy(o, d)
        off = sim.clone().fill_diagonal_(float("-inf"))
        scores = [{"layers": [i], "value": float(value[i]), "scale": float(scale[i]),
                   "max_similarity": float(off[i].max()) if n > 1 else 0.0} for i in range(n)]
        scores += [{"layers": [i, j], "value": float(sim[i, j]), "kind": "pair"}
                   for i in range(n) for j in range(i + 1, n)]
        return ProbeResult("weight-redundancy", config_dict(self), scores, kind="layer",
                           num_blocks=n, meta={"forward_free": True})
