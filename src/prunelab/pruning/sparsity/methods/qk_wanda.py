"""QK-Wanda (derived in prunelab from Wanda, Sun et al. 2024): the query and key weights
of a block share one budget, each weight's deletion cost weighted by the activation energy
of the key / query channel it meets in the attention logits (GQA-aware). Maths in
:mod:`prunelab.pruning.sparsity.scores`; this module gathers the block statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prunelab.calib.stats import SumSquares
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.pruning.base import METHODS
from prunelab.pruning.sparsity import scores
from prunelab.pruning.sparsity.config import BlockStage, SparsityConfig
from prunelab.pruning.sparsity.methods.wanda import wanda_weight


def _qk_scores(stage: BlockStage, q, k, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Deletion costs ``(Sq, Sk)`` of block ``stage.index``'s q and k weights from passes
    over the block (the q/k outputs, and their input norms or causal sums)."""
    runner, index, inputs = stage.runner, stage.index, stage.inputs
    _, outs = runner.tap(index, inputs, {"q": q, "k": k})
    geo = stage.lm.adapter.head_geometry(index)
    heads = (geo.num_heads, geo.num_kv_heads, geo.head_dim)
    wq, wk = weight_out_in(q).detach(), weight_out_in(k).detach()
    if variant == "causal":
        _, xs = runner.tap(index, inputs, {"x": q}, what="input")
        a_q = a_k = 0
        for x, qo, ko in zip(xs["x"], outs["q"], outs["k"], strict=True):
            dq, dk = scores.qk_wanda_causal_stats(x, qo, ko)
            a_q, a_k = a_q + dq, a_k + dk
        return scores.qk_wanda_causal_scores(wq, wk, a_q, a_k, *heads)
    ins = runner.collect(index, inputs, {"x": q}, lambda n: SumSquares())["x"][0]
    q_act = sum(o.double().pow(2).reshape(-1, o.shape[-1]).sum(0) for o in outs["q"])
    k_act = sum(o.double().pow(2).reshape(-1, o.shape[-1]).sum(0) for o in outs["k"])
    return scores.qk_wanda_scores(wq, wk, ins.sum_sq, k_act, q_act, *heads)


@METHODS.register("qk-wanda")
@dataclass(frozen=True)
class QKWanda(SparsityConfig):
    """QK-Wanda (derived): query and key weights of a block share one budget, weighted by
    the key / query activation energy of their channel; ``scope="block"`` also prunes V, O
    and the MLP by Wanda. ``variant="unmasked"`` counts every query-key pair of a sequence;
    ``"causal"`` only the pairs the causal mask keeps (key prefix sums, query suffix sums)."""

    scope: str = field(default="qk", metadata={"help": "qk-wanda: qk or block"})
    variant: str = field(default="unmasked", metadata={
        "help": "qk-wanda: unmasked (every query-key pair) or causal (pairs the mask keeps)",
        "flag": "--qk-variant"})

    own_block_passes = True  # prune_group taps the q / k outputs

    def __post_init__(self):
        super().__post_init__()
        if self.scope not in ("qk", "block"):
            raise ConfigError(f"scope must be qk or block, got {self.scope!r}")
        if self.variant not in ("unmasked", "causal"):
            raise ConfigError(f"qk-wanda variant must be unmasked or causal, got "
                              f"{self.variant!r}")
        if self.nm is not None:
            raise ConfigError("qk-wanda prunes q and k under one unstructured budget: give "
                              "sparsity, not pattern")

    def precheck(self, lm):
        if "qkv" in lm.adapter.spec.attn_proj:
            raise UnsupportedOperationError(f"qk-wanda needs separate q/k projections; "
                                            f"{lm.adapter.family} fuses them")

    def select(self, lm, index, linears):
        if self.scope == "block":
            return linears
        qk = {lm.adapter.spec.attn_proj.get(r) for r in ("q", "k")}
        return {p: m for p, m in linears.items() if p in qk}

    def accumulators(self):
        return lambda name: [SumSquares()]

    def prune_group(self, stage, group, sparsity):
        """q and k (when the group holds q) under one budget; the rest by Wanda when
        ``scope="block"``."""
        roles = stage.lm.adapter.spec.attn_proj
        if roles.get("q") in group:
            proj = stage.lm.adapter.attn_projections(stage.index)
            sq, sk = _qk_scores(stage, proj["q"], proj["k"], self.variant)
            mq, mk = scores.shared_budget_masks([sq, sk], sparsity)
            for module, mask in ((proj["q"], mq), (proj["k"], mk)):
                w = weight_out_in(module).detach()
                set_weight_out_in(module, w * mask.to(module.weight.device))
            group = {p: m for p, m in group.items() if p not in (roles["q"], roles["k"])}
        return group if self.scope == "block" else {}

    def prune_weight(self, w, accs, sparsity):
        return wanda_weight(self, w, accs, sparsity)
