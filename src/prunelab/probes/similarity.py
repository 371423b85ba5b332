"""Representation-similarity probes on cached block boundaries (no extra forward passes).

* ``block-influence`` (ShortGPT, Men et al. 2024): ``BI_i = mean_t (1 - cos(h_i[t],
  h_{i+1}[t]))`` over all calibration tokens, cosine along the hidden dimension; the
  angular variant reports ``mean_t arccos(cos)/pi``. Low = removable.
* ``span-angular`` (Gromov et al. 2024, "The unreasonable ineffectiveness of the deeper
  layers"): ``d(l, n) = mean_x arccos(cos(h_l[T], h_{l+n}[T]))/pi`` with ``T`` the last
  token of each window; remove ``[l*, l*+n)`` with ``l* = argmin_l d(l, n)``.
* ``cka``: linear CKA (Kornblith et al. 2019) between block boundaries, centred over
  tokens, in the ``d x d`` form ``||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F)``; adjacent
  pairs give one value per block (CKA of its input and output; high = removable), and
  ``all_pairs`` adds every pair of boundaries.

Block influence and span angular store their value per calibration window too
(``windows``: the mean over each window's tokens, or the window's last-token distance) for
:mod:`prunelab.probes.reliability`; CKA is not a mean over windows and has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from prunelab.errors import ConfigError
from prunelab.probes.base import PROBES, ProbeResult, check_range, config_dict


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cosine_similarity(a.double(), b.double(), dim=-1).clamp(-1.0, 1.0)


def block_influence(h_in: torch.Tensor, h_out: torch.Tensor, angular: bool = False) -> float:
    """Mean over tokens of ``1 - cos`` (or ``arccos(cos)/pi``) along the hidden dim.

    ``h_in``, ``h_out``: ``[..., d]``.
    """
    c = _cos(h_in, h_out)
    return float((torch.arccos(c) / math.pi).mean() if angular else (1 - c).mean())


def block_influence_windows(h_in: torch.Tensor, h_out: torch.Tensor,
                            angular: bool = False) -> list[float]:
    """:func:`block_influence` of each window: ``h_in``, ``h_out`` ``[N, T, d]`` -> N
    floats (the mean over a window's T tokens)."""
    c = _cos(h_in, h_out)
    per = torch.arccos(c) / math.pi if angular else 1 - c
    return per.reshape(per.shape[0], -1).mean(1).tolist()


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of ``x`` ``[N, d1]`` and ``y`` ``[N, d2]`` (rows = tokens), float64."""
    x = x.reshape(-1, x.shape[-1]).double()
    y = y.reshape(-1, y.shape[-1]).double()
    x = x - x.mean(0, keepdim=True)
    y = y - y.mean(0, keepdim=True)
    cross = (y.t() @ x).pow(2).sum()
    den = torch.linalg.matrix_norm(x.t() @ x) * torch.linalg.matrix_norm(y.t() @ y)
    return float(cross / den) if den > 0 else 0.0


@PROBES.register("block-influence")
@dataclass(frozen=True)
class BlockInfluence:
    """ShortGPT block influence: mean 1 - cos between a block's input and output.

    ``angular`` reports arccos(cos)/pi instead of 1 - cos as ``value``."""

    angular: bool = field(default=False, metadata={"help": (
        "report arccos(cos)/pi instead of 1 - cos")})

    def run(self, ctx) -> ProbeResult:
        scores = []
        for i in range(ctx.num_blocks):
            h_in, h_out = torch.cat(ctx.boundary(i)), torch.cat(ctx.boundary(i + 1))
            scores.append({"layers": [i], "value": block_influence(h_in, h_out, self.angular),
                           "value_angular": block_influence(h_in, h_out, True),
                           "value_cosine": block_influence(h_in, h_out, False),
                           "windows": block_influence_windows(h_in, h_out, self.angular)})
        return ProbeResult("block-influence", config_dict(self), scores, kind="layer",
                           num_blocks=ctx.num_blocks)


@PROBES.register("span-angular")
@dataclass(frozen=True)
class SpanAngular:
    """Gromov et al.: angular distance between ``h_l`` and ``h_{l+span}`` at the last token."""

    span: int = field(default=1, metadata={"help": "span length n"})

    def __post_init__(self):
        check_range("span", self.span, 1, None, integer=True)

    def run(self, ctx) -> ProbeResult:
        n = self.span
        if n >= ctx.num_blocks:
            raise ConfigError(f"span must be < the number of blocks ({ctx.num_blocks}), got {n}")
        last = [torch.cat([h[:, -1] for h in ctx.boundary(i)]) for i in range(ctx.num_blocks + 1)]
        scores = []
        for start in range(ctx.num_blocks - n + 1):
            per = torch.arccos(_cos(last[start], last[start + n])) / math.pi
            scores.append({"layers": [start, start + n], "value": float(per.mean()),
                           "windows": per.tolist()})
        best = min(scores, key=lambda s: s["value"])
        return ProbeResult("span-angular", config_dict(self), scores, kind="span",
                           num_blocks=ctx.num_blocks, meta={"best_span": best["layers"]})


@PROBES.register("cka")
@dataclass(frozen=True)
class CKA:
    """Linear CKA between block boundaries: adjacent (per block) and, optionally, all pairs."""

    all_pairs: bool = field(default=True, metadata={"help": (
        "CKA between every pair of boundaries too, not only adjacent ones "
        "(--no-all-pairs: adjacent only)")})
    max_tokens: int = field(default=8192, metadata={"help": (
        "tokens per boundary the CKA is computed on")})

    def __post_init__(self):
        check_range("max_tokens", self.max_tokens, 2, None, integer=True)

    def run(self, ctx) -> ProbeResult:
        n = ctx.num_blocks
        states = []
        for i in range(n + 1):
            h = torch.cat(ctx.boundary(i)).reshape(-1, ctx.adapter.hidden_size())
            states.append(h[: self.max_tokens])
        scores = [{"layers": [i], "value": linear_cka(states[i], states[i + 1]), "kind": "layer"}
                  for i in range(n)]
        if self.all_pairs:
            for i in range(n + 1):
                for j in range(i + 1, n + 1):
                    scores.append({"layers": [i, j], "value": linear_cka(states[i], states[j]),
                                   "kind": "boundary-pair"})
        return ProbeResult("cka", config_dict(self), scores, kind="layer", lower_is_removable=False,
                           num_blocks=n, meta={"note": "boundary-pair layers are boundaries "
                                               "0..L (boundary i = input of block i)"})
