"""Muon and Budget Muon (BMuon): MLP channels of all blocks compete for one budget.

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks";
PyTorch's ``torch.optim.Muon``) is steepest descent under the spectral norm: with the
(Nesterov) momentum ``M`` of a weight matrix, the update is ``-lr * NS(M)``, where
``NS(M) ~ U V^T`` (``M = U S V^T``) is computed by a quintic Newton-Schulz iteration
(coefficients 3.4445, -4.775, 2.0315; 5 steps), scaled by ``sqrt(max(1, rows / cols))``,
plus decoupled weight decay. :func:`orthogonalise` uses PyTorch's own iteration
(``torch.optim._muon._zeropower_via_newtonschulz``, present in torch 2.13) and falls back
to the same iteration written here when a torch lacks it.

BMuon (Budget Muon, an unpublished proposal built on Muon). The MLP hidden channels of all
blocks form one pool; channel ``c`` owns its rows ``W_c`` of the producers (gate / up) and
its column of the consumer (down). A budget ``K`` of channels is allocated at every step.

Derivation implemented. The exact allocation problem is ``min_{|S| <= K} L(W_S)``, with
``W_S`` the weights with the channels outside ``S`` removed (``Delta = -W_c`` for those).
Majorise the loss around the current weights with a curvature constant ``h`` (an upper
bound of the Hessian's norm along the channel directions):

    L(W + Delta) <= L(W) + <G, Delta> + (h / 2) ||Delta||^2,

which is tight at ``Delta = 0`` (a minorisation-maximisation / majorise-minimise step:
minimising the bound at the current iterate cannot increase the true objective by more
than the bound's gap). With ``Delta`` removing the channels outside ``S`` the bound is
separable:

    L(W_S) <= L(W) + sum_{c not in S} u_c,     u_c = -<G_c, W_c> + (h / 2) ||W_c||^2,

so its minimiser over ``|S| <= K`` keeps the ``K`` channels of largest ``u_c`` over all
blocks (a global top-K; :func:`allocate`) -- the per-block budgets ``k_b = |S cap b|`` are
what the competition decides. The update is then the steepest descent step under the
spectral norm *restricted to the kept channels*: ``argmin <M, Delta>`` over
``||Delta||_op <= lr`` with ``Delta`` supported on the rows (columns) of ``S`` is
``-lr NS(M_S)``, the orthogonalised momentum of the kept rows (columns) only. Channels
outside ``S`` get no gradient step and decay by ``(1 - lr * outside_decay)`` per step, so
they fade away and the final ``S`` (or ``u``) is the pruning criterion.

Departures from the seed's abstract: ``h`` is a fixed hyperparameter (``curvature``), not
estimated; ``u`` is smoothed by an exponential moving average (``ema``) across steps for a
stable allocation; the bound uses the raw gradient, not the momentum; every block keeps
at least one channel (its best one is reserved; the budget is still met exactly); only
MLP channels compete (attention heads use plain Muon). With ``K >=`` the number of
channels every channel is kept and BMuon's update is Muon's, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from prunelab.errors import UnsupportedOperationError

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)


def _newton_schulz(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5,
                   eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Jordan et al. 2024 (bfloat16, as PyTorch)."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):  # x <- a x + (b X X^T + c (X X^T)^2) x
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalise(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7) -> torch.Tensor:
    """``NS(g) ~ U V^T`` of a 2-D tensor (PyTorch's Muon iteration when available)."""
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz  # noqa: PLC0415 - not in every torch
    except ImportError:  # pragma: no cover - older torch
        return _newton_schulz(g, coefficients, steps, eps)
    return _zeropower_via_newtonschulz(g, coefficients, steps, eps)


def muon_lr(lr: float, shape) -> float:
    """Muon's shape adjustment ``lr sqrt(max(1, rows / cols))`` (PyTorch's default)."""
    return lr * math.sqrt(max(1.0, shape[0] / shape[1]))


@dataclass
class ChannelGroup:
    """One block's MLP channels: producer weights whose *rows* are the channels (gate, up:
    ``[C, d]``) and consumer weights whose *columns* are (down: ``[d, C]``)."""

    rows: list[torch.nn.Parameter]
    cols: list[torch.nn.Parameter]

    @property
    def width(self) -> int:
        return (self.rows[0].shape[0] if self.rows else self.cols[0].shape[1])


def channel_surrogate(group: ChannelGroup, curvature: float) -> torch.Tensor:
    """``u_c = -<G_c, W_c> + (h / 2) ||W_c||^2`` per channel ``[C]`` (float64; parameters
    without a gradient count only their weight term)."""
    u = torch.zeros(group.width, dtype=torch.float64)
    for p, dim in [(p, 1) for p in group.rows] + [(p, 0) for p in group.cols]:
        w = p.detach().double()
        u += 0.5 * curvature * (w * w).sum(dim)
        if p.grad is not None:
            u -= (p.grad.detach().double() * w).sum(dim)
    return u


def allocate(u: list[torch.Tensor], budget: int) -> list[torch.Tensor]:
    """Keep masks per block: every block's best channel, then the best of the rest over all
    blocks until exactly ``min(budget, total)`` channels are kept (ties: lower block,
    lower channel first)."""
    total = sum(len(x) for x in u)
    budget = min(max(budget, len(u)), total)
    keep = [torch.zeros(len(x), dtype=torch.bool) for x in u]
    for b, x in enumerate(u):
        keep[b][int(torch.argmax(x))] = True
    rest = [(-float(x[c]), b, c) for b, x in enumerate(u) for c in range(len(x))
            if not keep[b][c]]
    rest.sort()
    for _, b, c in rest[:budget - len(u)]:
        keep[b][c] = True
    return keep


class BMuon(torch.optim.Optimizer):
    """Muon on 2-D parameters, with the MLP channels of ``groups`` competing for
    ``budget`` channels (see the module docstring). ``budget=None``: every channel kept
    (plain Muon). After each step ``self.keep`` holds the allocation (bool mask per
    group) and ``self.u`` the smoothed surrogate."""

    def __init__(self, params, groups: list[ChannelGroup], budget: int | None, lr: float = 1e-3,
                 weight_decay: float = 0.1, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, curvature: float = 1.0, ema: float = 0.9,
                 outside_decay: float = 1.0):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(params, defaults)
        self.groups = groups
        self.budget = budget
        self.curvature, self.ema, self.outside_decay = curvature, ema, outside_decay
        self.u: list[torch.Tensor] | None = None
        self.keep: list[torch.Tensor] = [torch.ones(g.width, dtype=torch.bool) for g in groups]
        self._role = {}
        for gi, g in enumerate(groups):
            self._role.update({id(p): (gi, 0) for p in g.rows})
            self._role.update({id(p): (gi, 1) for p in g.cols})

    def _allocate(self) -> None:
        total = sum(g.width for g in self.groups)
        if self.budget is None or self.budget >= total:
            self.keep = [torch.ones(g.width, dtype=torch.bool) for g in self.groups]
            return
        new = [channel_surrogate(g, self.curvature) for g in self.groups]
        self.u = new if self.u is None else [self.ema * a + (1 - self.ema) * b
                                             for a, b in zip(self.u, new, strict=True)]
        self.keep = allocate(self.u, self.budget)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._allocate()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, group)
        return loss

    def _update(self, p: torch.nn.Parameter, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - group["momentum"])
        m = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        lr = group["lr"]
        role = self._role.get(id(p))
        keep = None if role is None else self.keep[role[0]]
        p.mul_(1 - lr * group["weight_decay"])
        step = muon_lr(lr, p.shape)
        if keep is None or bool(keep.all()):
            p.add_(orthogonalise(m, steps=group["ns_steps"]), alpha=-step)
            return
        idx, out = keep.nonzero().flatten(), (~keep).nonzero().flatten()
        if role[1] == 0:  # channels are rows
            p[idx] -= step * orthogonalise(m[idx], steps=group["ns_steps"]).to(p.dtype)
            p[out] *= 1 - lr * self.outside_decay
        else:
            p[:, idx] -= step * orthogonalise(m[:, idx], steps=group["ns_steps"]).to(p.dtype)
            p[:, out] *= 1 - lr * self.outside_decay


def mlp_channel_groups(lm) -> list[ChannelGroup]:
    """The MLP channel groups of a loaded model through its adapter (separate
    ``nn.Linear`` gate / up / down projections; fused gate_up is refused)."""
    groups = []
    for i in range(lm.adapter.num_blocks):
        proj = lm.adapter.mlp_projections(i)
        if "gate_up" in proj or not all(isinstance(m, torch.nn.Linear) for m in proj.values()):
            raise UnsupportedOperationError("BMuon needs separate nn.Linear MLP projections")
        groups.append(ChannelGroup([proj[r].weight for r in ("gate", "up") if r in proj],
                                   [proj["down"].weight]))
    return groups
