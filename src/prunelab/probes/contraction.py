"""Contraction ratio rho per block (derived: prunelab's own finite-difference estimate of
how far a block's map is from the identity; no reference paper or code).

Perturb the cached block input by noise ``eps`` whose norm per token is ``scale`` times the
token's norm (seeded Gaussian direction), run block ``i`` on the clean and perturbed input:
``rho_i = mean_t ||B_i(h + eps)[t] - B_i(h)[t]|| / ||eps[t]||``. A block that is (close to)
the identity has rho = 1; depth pruning ranks blocks by ``|rho_i - 1|`` (closest to 1 =
most removable), optionally blended with block influence by rank. ``value`` is
``|rho - 1|``; ``rho`` is reported beside it, and ``windows_rho`` holds rho per calibration
window (``value = |mean(windows_rho) - 1|``, for :mod:`prunelab.probes.reliability`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prunelab.log import progress
from prunelab.probes.base import PROBES, ProbeResult, check_range, config_dict


def perturbation(h: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """Noise with per-token norm ``scale * ||h[t]||`` in a random direction."""
    noise = torch.randn(h.shape, generator=generator, dtype=torch.float32).to(h)
    noise = noise / noise.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return noise * h.norm(dim=-1, keepdim=True) * scale


def contraction_ratio(clean_out: torch.Tensor, pert_out: torch.Tensor,
                      eps: torch.Tensor) -> torch.Tensor:
    """Per-token ``||pert_out - clean_out|| / ||eps||`` (float64), shape ``[...]``."""
    num = (pert_out.double() - clean_out.double()).norm(dim=-1)
    return num / eps.double().norm(dim=-1).clamp_min(1e-300)


@PROBES.register("contraction")
@dataclass(frozen=True)
class Contraction:
    """Contraction ratio: how much a block scales a small perturbation of its input.

    Relative noise ``scale`` (of each token's norm) and the noise ``seed``."""

    scale: float = field(default=1e-2, metadata={"help": "relative noise (of each token's "
                                                          "norm)"})
    seed: int = field(default=0, metadata={"help": "noise seed"})

    def __post_init__(self):
        check_range("scale", self.scale, 1e-8, 1.0)
        check_range("seed", self.seed, 0, None, integer=True)

    def run(self, ctx) -> ProbeResult:
        gen = torch.Generator().manual_seed(self.seed)
        scores = []
        for i in progress(range(ctx.num_blocks), desc="contraction"):
            clean_in, clean_out = ctx.boundary(i), ctx.boundary(i + 1)
            eps = [perturbation(h, self.scale, gen) for h in clean_in]
            pert_out = ctx.run_stack(i, [i], hidden=[h + e for h, e in zip(clean_in, eps,
                                                                            strict=True)])
            per = [contraction_ratio(c, p, e) for c, p, e in zip(clean_out, pert_out, eps,
                                                                 strict=True)]
            ratios = torch.cat([r.reshape(-1) for r in per])
            rho = float(ratios.mean())
            windows = torch.cat([r.reshape(r.shape[0], -1).mean(1) for r in per]).tolist()
            scores.append({"layers": [i], "value": abs(rho - 1.0), "rho": rho,
                           "windows_rho": windows})
        return ProbeResult("contraction", config_dict(self), scores, kind="layer",
                           num_blocks=ctx.num_blocks)
