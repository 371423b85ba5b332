"""One block's MLP into a :class:`~prunelab.pruning.moe.module.PrunePathMLP`: read the gated
FFN's weights through the adapter, cluster its channels, permute them so each expert is
contiguous, fit the router on the MLP's calibration inputs, measure the selection.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from prunelab.errors import UnsupportedOperationError
from prunelab.pruning.moe.clustering import (
    balanced_kmeans,
    coactivation_features,
    expert_permutation,
    weight_features,
)
from prunelab.pruning.moe.module import PrunePathMLP
from prunelab.pruning.moe.router import (
    centroid_router,
    centroids,
    expert_norms,
    fit_router,
    norm_shares,
)

COACT_TOKENS = 8192  # calibration tokens (drawn with the seed) the co-activation uses
CHECK_TOKENS = 1024  # tokens on which the converted MLP must reproduce the base one
CHECK_RTOL = 1e-3


def activation_name(mlp: nn.Module) -> str | None:
    """The :class:`PrunePathMLP` activation equal (bit for bit on a probe from -8 to 8) to
    ``mlp``'s ``act_fn`` / ``activation_fn``, or ``None``."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    if act is None:
        return None
    probe = torch.linspace(-8.0, 8.0, 4097)
    with torch.no_grad():
        want = act(probe)
        for name in PrunePathMLP.ACTS:
            if torch.equal(want, PrunePathMLP.activation(SimpleNamespace(act=name), probe)):
                return name
    return None


def unsupported_reason(lm, index: int) -> str | None:
    """Why block ``index``'s MLP cannot become experts (``None`` when it can)."""
    ad = lm.adapter
    if not ad.is_gated():
        roles = "/".join(ad.spec.mlp_proj)
        return (f"prunepath needs a gated FFN (gate, up, down); {ad.family} has "
                f"{roles}")
    mlp = ad.mlp(index)
    if getattr(type(mlp), "prunelab_kind", None) == "prunepath_mlp":
        return f"block {index} already has PrunePath experts (use set_mass to change p)"
    if activation_name(mlp) is None:
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        return (f"block {index}: activation {type(act).__name__} is not one of "
                f"{', '.join(PrunePathMLP.ACTS)}")
    return None


def mlp_weights(lm, index: int) -> dict:
    """``gate``, ``up`` ``[F, d]``, ``down`` ``[d, F]`` and their biases (or ``None``),
    ``fused`` (one ``gate_up`` projection) of block ``index``."""
    proj = lm.adapter.mlp_projections(index)
    down = proj["down"]
    out = {"down": down.weight, "down_bias": down.bias, "fused": "gate_up" in proj}
    if out["fused"]:
        gu = proj["gate_up"]
        f = down.weight.shape[1]
        out.update(gate=gu.weight[:f], up=gu.weight[f:],
                   gate_bias=None if gu.bias is None else gu.bias[:f],
                   up_bias=None if gu.bias is None else gu.bias[f:])
    else:
        out.update(gate=proj["gate"].weight, up=proj["up"].weight,
                   gate_bias=proj["gate"].bias, up_bias=proj["up"].bias)
    return out


@torch.no_grad()
def build_module(w: dict, perm: torch.Tensor, sizes: list[int], act: str) -> PrunePathMLP:
    """A :class:`PrunePathMLP` holding the FFN ``w`` with channels in order ``perm``
    (router zero), on the weights' device and dtype."""
    ref = w["down"]
    bias = w["down_bias"] is not None
    m = PrunePathMLP(ref.shape[0], sizes, act=act, fused=w["fused"], bias=bias)
    m = m.to(device=ref.device, dtype=ref.dtype)
    p = perm.to(ref.device)
    if w["fused"]:
        m.gate_up_proj.weight.copy_(torch.cat([w["gate"][p], w["up"][p]]))
        if bias:
            m.gate_up_proj.bias.copy_(torch.cat([w["gate_bias"][p], w["up_bias"][p]]))
    else:
        m.gate_proj.weight.copy_(w["gate"][p])
        m.up_proj.weight.copy_(w["up"][p])
        if bias:
            m.gate_proj.bias.copy_(w["gate_bias"][p])
            m.up_proj.bias.copy_(w["up_bias"][p])
    m.down_proj.weight.copy_(w["down"][:, p])
    if bias:
        m.down_proj.bias.copy_(w["down_bias"])
    m.router.weight.zero_()
    m.router.bias.zero_()
    return m


def _sample(x: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    if x.shape[0] <= count:
        return x
    g = torch.Generator().manual_seed(int(seed))
    return x[torch.randperm(x.shape[0], generator=g)[:count].to(x.device)]


@torch.no_grad()
def channel_labels(w: dict, act: str, x: torch.Tensor, clustering: str, experts: int,
                   seed: int) -> torch.Tensor:
    """Expert label of every FFN channel: balanced k-means of the weight features
    (``kmeans``) or of the co-activation features on calibration inputs ``x``."""
    if clustering == "kmeans":
        feats = weight_features(w["gate"], w["up"])
    else:
        xs = _sample(x, COACT_TOKENS, seed).to(w["gate"].dtype)
        fn = SimpleNamespace(act=act)
        g = nn.functional.linear(xs, w["gate"], w["gate_bias"])
        u = nn.functional.linear(xs, w["up"], w["up_bias"])
        feats = coactivation_features(PrunePathMLP.activation(fn, g) * u)
    return balanced_kmeans(feats, experts, seed=seed)


@torch.no_grad()
def check_dense(module: PrunePathMLP, mlp: nn.Module, x: torch.Tensor, index: int) -> None:
    """Raise when the converted MLP does not reproduce the base one on ``x``."""
    xs = x[:CHECK_TOKENS]
    want, got = mlp(xs).float(), module.dense(xs).float()
    err = float((got - want).norm() / want.norm().clamp_min(1e-12))
    if not err <= CHECK_RTOL:
        raise UnsupportedOperationError(
            f"block {index}: the MLP is not down(act(gate) * up) (relative difference "
            f"{err:.2e} after conversion); prunepath cannot convert it")


def convert_block(lm, index: int, x: torch.Tensor, cfg) -> tuple[PrunePathMLP, dict]:
    """The PrunePath MLP of block ``index`` from its MLP inputs ``x`` ``[tokens, d]`` and
    the method config ``cfg``; returns it with its report row."""
    mlp = lm.adapter.mlp(index)
    act = activation_name(mlp)
    w = mlp_weights(lm, index)
    seed = cfg.seed + index
    labels = channel_labels(w, act, x, cfg.clustering, cfg.experts, seed)
    perm, sizes = expert_permutation(labels, cfg.experts)
    module = build_module(w, perm, sizes, act)
    check_dense(module, mlp, x, index)
    targets = norm_shares(expert_norms(module, x.to(w["down"].dtype)))
    xf = x.float()
    weight, tau = centroid_router(centroids(module_gate(module), sizes), xf, targets)
    bias = torch.zeros(cfg.experts)
    if cfg.router == "fitted" and cfg.router_steps > 0:
        weight, bias, _ = fit_router(xf, targets, weight, bias, steps=cfg.router_steps,
                                     lr=cfg.router_lr, seed=seed)
    with torch.no_grad():
        module.router.weight.copy_(weight)
        module.router.bias.copy_(bias)
    row = {"block": index, "sizes": sizes, "tau": tau, **selection_row(module, x, targets,
                                                                        cfg.mass)}
    return module, row


def module_gate(module: PrunePathMLP) -> torch.Tensor:
    """The (permuted) gate rows ``[F, d]`` of a PrunePath MLP."""
    if module.fused:
        return module.gate_up_proj.weight[:module.ffn]
    return module.gate_proj.weight


@torch.no_grad()
def selection_row(module: PrunePathMLP, x: torch.Tensor, targets: torch.Tensor,
                  mass: float) -> dict:
    """What the router does on the calibration tokens at ``mass``: mean experts per token,
    the FFN FLOPs per token (router included) over the dense FFN's, the relative output
    error ``||y_routed - y|| / ||y||``, the router's cross-entropy to the targets and the
    targets' entropy (its lower bound)."""
    probs = module.route(x)
    module.reset_stats()
    err_num = err_den = 0.0
    for part in x.split(4096):
        sel = module.select(module.route(part), mass)
        routed = module.routed(part, sel).float()
        dense = module.dense(part).float()
        err_num += float((routed - dense).square().sum())
        err_den += float(dense.square().sum())
    row = {"experts_per_token": sum(module.stat_expert_tokens) / max(module.stat_tokens, 1),
           "ffn_flops_ratio": module.flops_per_token() / module.dense_flops(),
           "relative_error": (err_num / err_den) ** 0.5 if err_den > 0 else 0.0,
           "router_cross_entropy": float(-(targets * probs.clamp_min(1e-30).log())
                                         .sum(-1).mean()),
           "target_entropy": float(-(targets * targets.clamp_min(1e-30).log())
                                   .sum(-1).mean())}
    module.reset_stats()
    return row
