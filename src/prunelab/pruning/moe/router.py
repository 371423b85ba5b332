"""PrunePath routers: a linear softmax over experts that predicts each expert's share of
the FFN output norm.

Target of token ``x``: ``t_e(x) = ||y_e(x)|| / sum_e' ||y_e'(x)||`` with ``y_e`` expert
``e``'s output (MoEfication, Zhang et al. 2022, arXiv:2110.01786, trains its router to
predict which experts matter from their outputs; here the norm share, so that the
cumulative routing mass is the share of the FFN output a token keeps).

* ``centroid`` (training free): logits ``tau (c_e . x)`` with ``c_e`` the mean of the
  gate rows of expert ``e``'s channels; one temperature ``tau`` per block, the best of a
  log-spaced grid by cross-entropy to the targets (no gradient steps).
* ``fitted``: ``softmax(R x + b)`` fitted by Adam on the soft cross-entropy
  ``-sum_e t_e log r_e`` over the calibration tokens, the base model frozen, started from
  the centroid router. Inputs are standardised per dimension during the fit (folded back
  into ``R`` and ``b``); steps use minibatches drawn with a seeded generator (the whole
  set when it is small), the learning rate decays linearly to zero.
"""

from __future__ import annotations

import torch

FULL_BATCH = 8192  # tokens up to which every step sees every token
MINIBATCH = 4096


@torch.no_grad()
def expert_norms(module, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """``||y_e(x)||`` ``[tokens, experts]`` (float32) of a PrunePath MLP on ``x``
    ``[tokens, hidden]``."""
    rows = []
    for part in x.split(chunk):
        rows.append(torch.stack([module.expert(part, e).float().norm(dim=-1)
                                 for e in range(module.num_experts)], dim=-1))
    return torch.cat(rows)


def norm_shares(norms: torch.Tensor) -> torch.Tensor:
    """Targets ``t`` ``[tokens, experts]``: each row of ``norms`` divided by its sum
    (uniform for a token whose experts all output zero)."""
    total = norms.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(norms, 1.0 / norms.shape[-1])
    return torch.where(total > 0, norms / total.clamp_min(1e-30), uniform)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``-sum_e t_e log softmax(logits)_e``."""
    return -(targets * torch.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


def centroids(gate: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``[E, d]`` mean gate row of each expert's (contiguous) channels."""
    return torch.stack([part.float().mean(dim=0) for part in gate.detach().split(sizes)])


@torch.no_grad()
def centroid_router(cents: torch.Tensor, x: torch.Tensor, targets: torch.Tensor,
                    grid: int = 41) -> tuple[torch.Tensor, float]:
    """``(weight [E, d], tau)``: the centroid router ``tau * cents`` at the temperature of
    a log grid (``10^-2 .. 10^2`` times ``1 / std`` of the raw scores) with the lowest
    cross-entropy to ``targets`` on ``x``."""
    scores = x.float() @ cents.t().float()
    base = 1.0 / float(scores.std().clamp_min(1e-12))
    taus = [base * 10 ** (-2 + 4 * k / (grid - 1)) for k in range(grid)]
    losses = [float(soft_cross_entropy(scores * t, targets)) for t in taus]
    tau = taus[min(range(grid), key=lambda k: (losses[k], k))]
    return cents.float() * tau, tau


def fit_router(x: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None, steps: int = 300, lr: float = 1e-2,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Adam fit of ``softmax(W x + b)`` to ``targets`` ``[tokens, E]`` from ``x``
    ``[tokens, d]``, starting at ``weight`` ``[E, d]`` (and ``bias``). Returns ``(W, b,
    final cross-entropy on every token)``, float32."""
    x = x.detach().float()
    targets = targets.detach().float()
    mean = x.mean(dim=0)
    scale = x.std(dim=0).clamp_min(1e-6)
    z = (x - mean) / scale
    b0 = bias.float() if bias is not None else torch.zeros(weight.shape[0])
    # W x + b = (W * scale) z + (W mean + b): fit in the standardised coordinates
    w = (weight.float() * scale).clone().requires_grad_(True)
    b = (weight.float() @ mean + b0.to(x.device)).clone().requires_grad_(True)
    opt = torch.optim.Adam([w, b], lr=lr)
    g = torch.Generator().manual_seed(int(seed))
    n = z.shape[0]
    for step in range(int(steps)):
        for group in opt.param_groups:
            group["lr"] = lr * (1 - step / steps)
        if n <= FULL_BATCH:
            zb, tb = z, targets
        else:
            idx = torch.randint(0, n, (MINIBATCH,), generator=g).to(z.device)
            zb, tb = z[idx], targets[idx]
        opt.zero_grad(set_to_none=True)
        loss = soft_cross_entropy(zb @ w.t() + b, tb)
        loss.backward()
        opt.step()
    with torch.no_grad():
        w_out = w / scale
        b_out = b - w_out @ mean
        final = float(soft_cross_entropy(x @ w_out.t() + b_out, targets))
    return w_out.detach(), b_out.detach(), final
