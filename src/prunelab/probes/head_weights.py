"""Forward-free head scores: the stable rank of each head's QK and OV circuits.

In the residual-stream picture of Elhage et al. 2021 ("A Mathematical Framework for
Transformer Circuits") head ``h`` of a block acts through two ``d x d`` matrices (row-vector
convention ``x W``): the QK circuit ``W_QK = W_Q,h W_K,h^T`` (attention logits
``x_i W_QK x_j^T``) and the OV circuit ``W_OV = W_V,h W_O,h`` (what an attended token
writes). An unpublished proposal takes their stable rank ``||M||_F^2 / ||M||_2^2``
(Rudelson and Vershynin 2007, "Sampling from large matrices"; a
smooth rank in ``[1, head_dim]``; 0 for a zero matrix) as an intrinsic, data-free head
criterion. Here a head whose circuits have a *low* stable rank (a nearly rank-one pattern,
a head that writes into few directions) is read as the more removable one: every score of
:func:`head_stable_ranks` and of the ``stable-rank`` probe is "lower = more removable".
That direction is a hypothesis of the proposal; the probe summary's head correlations test it
against the ablation KL.

Grouped KV heads (GQA/MQA): query head ``h`` reads KV head ``g = h // G`` with
``G = heads / kv_heads`` (Hugging Face's ``repeat_kv``: query heads ``[g G, (g+1) G)``
share KV head ``g``), so ``W_QK(h) = W_Q,h W_K,g^T`` and ``W_OV(h) = W_V,g W_O,h``: the
query heads of a group share ``W_K`` and ``W_V`` but keep their own ``W_Q`` and ``W_O``
columns. A KV group's score (width pruning with ``heads="groups"``) is the mean of its query
heads' scores. RoPE (position-dependent rotations of q and k), q/k norms (Qwen3, Gemma 3)
and projection biases are not folded in: the circuits are the raw weight products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.models.linear import weight_out_in
from prunelab.probes.base import PROBES, ProbeResult, config_dict


def stable_rank(m: torch.Tensor) -> float:
    """``||M||_F^2 / ||M||_2^2`` of a matrix (float64; 0 for a zero matrix)."""
    s = torch.linalg.svdvals(m.double())
    top = float(s[0]) if s.numel() else 0.0
    return float((s * s).sum()) / (top * top) if top > 0 else 0.0


def product_stable_rank(a: torch.Tensor, b: torch.Tensor) -> float:
    """Stable rank of ``a^T b`` for ``a``, ``b`` of shape ``[k, d]`` (``k <= d``), without
    forming the ``d x d`` product: with ``a^T = Q_a R_a`` and ``b^T = Q_b R_b`` (reduced QR,
    ``Q`` orthonormal columns), ``a^T b = Q_a (R_a R_b^T) Q_b^T`` has the singular values of
    the ``k x k`` matrix ``R_a R_b^T``."""
    ra = torch.linalg.qr(a.double().t(), mode="r").R
    rb = torch.linalg.qr(b.double().t(), mode="r").R
    return stable_rank(ra @ rb.t())


def qkv_weights(adapter, index: int) -> tuple[torch.Tensor, ...]:
    """``(W_q [H hd, d], W_k [KV hd, d], W_v [KV hd, d], W_o [d, H hd])`` of block ``index``
    as ``[d_out, d_in]`` float64 copies; a fused ``qkv`` projection is split with the
    family's ``fused_qkv_rows`` (a group's rows: its query heads, its key, its value)."""
    proj = adapter.attn_projections(index)
    geo = adapter.head_geometry(index)
    wo = weight_out_in(proj["o"]).detach().double()
    if "qkv" not in proj:
        return tuple(weight_out_in(proj[r]).detach().double() for r in "qkv") + (wo,)
    w = weight_out_in(proj["qkv"]).detach().double()
    nq = geo.group_size * geo.head_dim
    hd = geo.head_dim
    parts: list[list[torch.Tensor]] = [[], [], []]
    for g in range(geo.num_kv_heads):
        rows = w[adapter.spec.fused_qkv_rows([g], geo).to(w.device)]
        for k, block in enumerate((rows[:nq], rows[nq:nq + hd], rows[nq + hd:])):
            parts[k].append(block)
    return tuple(torch.cat(p) for p in parts) + (wo,)


def head_stable_ranks(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                      wo: torch.Tensor, num_heads: int, num_kv_heads: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query head: stable rank of ``W_QK = W_Q,h W_K,g^T`` and of ``W_OV = W_V,g W_O,h``
    (``g = h // (num_heads / num_kv_heads)``; weights as in :func:`qkv_weights`).
    Returns two ``[num_heads]`` float64 tensors."""
    hd = wq.shape[0] // num_heads
    gs = num_heads // num_kv_heads
    qk, ov = [], []
    for h in range(num_heads):
        g = h // gs
        q_h, k_g = wq[h * hd:(h + 1) * hd], wk[g * hd:(g + 1) * hd]
        v_g, o_h = wv[g * hd:(g + 1) * hd], wo[:, h * hd:(h + 1) * hd]
        qk.append(product_stable_rank(q_h, k_g))  # (q_h^T k_g) = W_QK in x-row convention
        ov.append(product_stable_rank(v_g, o_h.t()))  # v_g^T o_h^T = W_V,g W_O,h
    return torch.tensor(qk, dtype=torch.float64), torch.tensor(ov, dtype=torch.float64)


def combined(qk: torch.Tensor, ov: torch.Tensor) -> torch.Tensor:
    """The combined head score: the geometric mean ``sqrt(sr_QK * sr_OV)``."""
    return (qk * ov).clamp_min(0).sqrt()


def block_head_scores(adapter, index: int) -> dict[str, torch.Tensor]:
    """``{"qk", "ov", "value"}`` per query head of block ``index`` (``value`` combined)."""
    geo = adapter.head_geometry(index)
    qk, ov = head_stable_ranks(*qkv_weights(adapter, index), geo.num_heads, geo.num_kv_heads)
    return {"qk": qk, "ov": ov, "value": combined(qk, ov)}


@PROBES.register("stable-rank", forward=False)
@dataclass(frozen=True)
class StableRank:
    """Forward-free head scores: stable rank of W_Q W_K^T and W_V W_O (low = removable).

    No options: the probe reads only the weights (see :mod:`prunelab.probes.head_weights`
    for the GQA mapping and the direction)."""

    def run(self, ctx) -> ProbeResult:
        ad = ctx.adapter
        scores = []
        for i in range(ad.num_blocks):
            gs = ad.head_geometry(i).group_size
            s = block_head_scores(ad, i)
            scores += [{"layers": [i], "head": h, "kv_head": h // gs, "value": float(s["value"][h]),
                        "qk": float(s["qk"][h]), "ov": float(s["ov"][h])}
                       for h in range(len(s["value"]))]
        return ProbeResult("stable-rank", config_dict(self), scores, kind="head",
                           num_blocks=ad.num_blocks,
                           meta={"forward_free": True,
                                 "value": "sqrt(stable_rank(W_QK) * stable_rank(W_OV))"})
