"""Importance scores for unstructured / N:M pruning, and joint-budget masks.

Weights are ``W: [d_out, d_in]``; calibration statistics arrive precomputed. Scores are
"higher = keep". Sources: magnitude pruning (Han et al. 2015); Wanda (Sun et al. 2024);
QK-Wanda (derived in prunelab from Wanda: a shared query/key budget with
activation-weighted deletion costs, unmasked and causal variants).
"""

from __future__ import annotations

import torch

from prunelab.errors import ConfigError
from prunelab.pruning.sparsity.masks import check_sparsity, prune_count

__all__ = [
    "magnitude_scores",
    "qk_wanda_causal_scores",
    "qk_wanda_causal_stats",
    "qk_wanda_scores",
    "shared_budget_masks",
    "wanda_scores",
]


def magnitude_scores(W: torch.Tensor) -> torch.Tensor:
    """``|W|`` as float32, shape of ``W`` (magnitude pruning, Han et al. 2015)."""
    return W.detach().float().abs()


def wanda_scores(W: torch.Tensor, col_sq_norm: torch.Tensor) -> torch.Tensor:
    """Wanda score ``S_ij = |W_ij| * sqrt(col_sq_norm_j)`` (float32, ``[d_out, d_in]``).

    ``W``: ``[d_out, d_in]``. ``col_sq_norm``: ``[d_in]``, the squared L2 norm of each input
    channel over the calibration tokens (Wanda keeps ``sum_t x_tj^2`` averaged over
    sequences; any positive per-column constant factor leaves the per-row ranking, and so
    the mask, unchanged). Negative entries (round-off) are clamped to 0. Source: Sun et al.
    2024, "A Simple and Effective Pruning Approach for Large Language Models".
    """
    if col_sq_norm.shape != (W.shape[1],):
        raise ConfigError(
            f"col_sq_norm has shape {tuple(col_sq_norm.shape)}, expected ({W.shape[1]},)"
        )
    norm = col_sq_norm.detach().to(device=W.device, dtype=torch.float32).clamp_min(0)
    return W.detach().float().abs() * norm.sqrt()[None, :]


def _check_qk_shapes(fn: str, Wq, Wk, num_heads: int, num_kv_heads: int, head_dim: int,
                     more: dict) -> None:
    """ConfigError unless the head counts are consistent and every shape is as expected."""
    if num_heads < 1 or num_kv_heads < 1 or head_dim < 1 or num_heads % num_kv_heads:
        raise ConfigError(
            f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
        )
    d_in = Wq.shape[1]
    expected = {"Wq": (Wq.shape, (num_heads * head_dim, d_in)),
                "Wk": (Wk.shape, (num_kv_heads * head_dim, d_in)), **more}
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ConfigError(f"{fn}: {name} has shape {tuple(got)}, expected {want}")


def qk_wanda_scores(
    Wq: torch.Tensor,
    Wk: torch.Tensor,
    xq_sq_norm: torch.Tensor,
    k_act_sq_norm: torch.Tensor,
    q_act_sq_norm: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-Wanda deletion costs (unmasked variant), float64, for a shared Q/K budget.

    Shapes: ``Wq [num_heads * head_dim, d_in]``, ``Wk [num_kv_heads * head_dim, d_in]``,
    ``xq_sq_norm [d_in]`` (sum over tokens of the squared block input feeding q/k_proj),
    ``k_act_sq_norm [num_kv_heads * head_dim]`` and ``q_act_sq_norm [num_heads * head_dim]``
    (sum over tokens of the squared key / query projections, per output channel).

    With ``G = num_heads // num_kv_heads`` query heads per KV head, query row
    ``r = h * head_dim + c`` costs ``Sq[r, j] = Wq[r, j]^2 * xq_j * k_act[(h // G) * head_dim
    + c]``, and key row ``r = g * head_dim + c`` costs ``Sk[r, j] = Wk[r, j]^2 * xq_j *
    sum_{h : h // G = g} q_act[h * head_dim + c]``. Returns ``(Sq, Sk)`` in float64, on one
    scale, so :func:`shared_budget_masks` can prune them under one budget. Source: QK-Wanda
    (derived from Wanda); the causal variant is :func:`qk_wanda_causal_scores`.
    """
    d_in = Wq.shape[1]
    _check_qk_shapes("qk_wanda_scores", Wq, Wk, num_heads, num_kv_heads, head_dim, {
        "xq_sq_norm": (xq_sq_norm.shape, (d_in,)),
        "k_act_sq_norm": (k_act_sq_norm.shape, (num_kv_heads * head_dim,)),
        "q_act_sq_norm": (q_act_sq_norm.shape, (num_heads * head_dim,))})
    dev = Wq.device
    group = num_heads // num_kv_heads
    x = xq_sq_norm.detach().to(dev, torch.float64)
    k_act = k_act_sq_norm.detach().to(dev, torch.float64).reshape(num_kv_heads, head_dim)
    q_act = q_act_sq_norm.detach().to(dev, torch.float64).reshape(num_heads, head_dim)
    # Key-channel energy seen by each query row: repeat each KV head for its G query heads.
    k_for_q = k_act.repeat_interleave(group, dim=0).reshape(-1)
    # Query-channel energy seen by each key row: sum the G query heads sharing that KV head.
    q_for_k = q_act.reshape(num_kv_heads, group, head_dim).sum(dim=1).reshape(-1)
    wq = Wq.detach().to(dev, torch.float64)
    wk = Wk.detach().to(dev, torch.float64)
    sq = wq.square() * x[None, :] * k_for_q[:, None]
    sk = wk.square() * x[None, :] * q_for_k[:, None]
    return sq, sk


def qk_wanda_causal_stats(x: torch.Tensor, q_act: torch.Tensor,
                          k_act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's statistics for :func:`qk_wanda_causal_scores`, to be summed over batches.

    ``x [B, T, d_in]``: the input of q/k_proj; ``q_act [B, T, Cq]``, ``k_act [B, T, Ck]``: the
    query / key projections (``Cq = num_heads * head_dim``, ``Ck = num_kv_heads *
    head_dim``). Under the causal mask query ``t`` sees keys ``s <= t`` of its own sequence,
    so deleting a query weight ``(r, j)`` moves the logits ``(t, s <= t)`` by ``-W x_t[j]
    k_s[c]`` and a key weight the logits ``(t >= s, s)`` by ``-W q_t[c] x_s[j]``. Returns
    ``(A_q [d_in, Ck], A_k [d_in, Cq])`` in float64: ``A_q[j, c] = sum_t x_t[j]^2 *
    sum_{s <= t} k_s[c]^2`` (key prefix sums) and ``A_k[j, c] = sum_s x_s[j]^2 *
    sum_{t >= s} q_t[c]^2`` (query suffix sums), sequences summed separately.
    """
    if x.dim() != 3 or q_act.shape[:2] != x.shape[:2] or k_act.shape[:2] != x.shape[:2]:
        raise ConfigError(f"qk_wanda_causal_stats: x {tuple(x.shape)}, q {tuple(q_act.shape)}, "
                          f"k {tuple(k_act.shape)} must share [batch, tokens]")
    x2 = x.detach().to(torch.float64).square().flatten(0, 1)
    k_prefix = k_act.detach().to(torch.float64).square().cumsum(1).flatten(0, 1)
    q_suffix = q_act.detach().to(torch.float64).square().flip(1).cumsum(1).flip(1).flatten(0, 1)
    return x2.t() @ k_prefix, x2.t() @ q_suffix


def qk_wanda_causal_scores(
    Wq: torch.Tensor,
    Wk: torch.Tensor,
    a_q: torch.Tensor,
    a_k: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """QK-Wanda deletion costs, causal variant (float64, one scale for a shared budget).

    ``a_q [d_in, num_kv_heads * head_dim]`` and ``a_k [d_in, num_heads * head_dim]`` from
    :func:`qk_wanda_causal_stats` (summed over batches). Query row ``r = h * head_dim + c``:
    ``Sq[r, j] = Wq[r, j]^2 * a_q[j, (h // G) * head_dim + c]``, the squared change of every
    causal logit of its head; key row ``r = g * head_dim + c``: ``Sk[r, j] = Wk[r, j]^2 *
    sum_{h : h // G = g} a_k[j, h * head_dim + c]``. Without the mask (every pair of a
    sequence) this reduces to :func:`qk_wanda_scores`. Source: QK-Wanda, causal variant
    (key prefix sums / query suffix sums; derived from Wanda).
    """
    d_in = Wq.shape[1]
    _check_qk_shapes("qk_wanda_causal_scores", Wq, Wk, num_heads, num_kv_heads, head_dim, {
        "a_q": (a_q.shape, (d_in, num_kv_heads * head_dim)),
        "a_k": (a_k.shape, (d_in, num_heads * head_dim))})
    dev = Wq.device
    group = num_heads // num_kv_heads
    aq = a_q.detach().to(dev, torch.float64).reshape(d_in, num_kv_heads, head_dim)
    ak = a_k.detach().to(dev, torch.float64).reshape(d_in, num_kv_heads, group, head_dim)
    k_for_q = aq.repeat_interleave(group, dim=1).reshape(d_in, -1)  # [d_in, Cq]
    q_for_k = ak.sum(dim=2).reshape(d_in, -1)  # [d_in, Ck]
    sq = Wq.detach().to(dev, torch.float64).square() * k_for_q.t()
    sk = Wk.detach().to(dev, torch.float64).square() * q_for_k.t()
    return sq, sk


def shared_budget_masks(scores_list: list[torch.Tensor], sparsity: float) -> list[torch.Tensor]:
    """Kept masks (bool, one per input, same shapes) pruning the lowest
    ``floor(total * sparsity)`` scores jointly over all matrices (``total`` = summed numel),
    i.e. one per-layer comparison group spanning several matrices (QK-Wanda: Q and K share
    one budget). Ties: earlier matrix, then lower flat index, is pruned first (float64,
    stable sort).
    """
    s = check_sparsity(sparsity)
    if not scores_list:
        return []
    dev = scores_list[0].device
    flat = torch.cat([t.detach().reshape(-1).to(dev, torch.float64) for t in scores_list])
    keep = torch.ones(flat.numel(), dtype=torch.bool, device=dev)
    k = prune_count(flat.numel(), s)
    if k > 0:
        keep[torch.sort(flat, stable=True).indices[:k]] = False
    masks, start = [], 0
    for t in scores_list:
        masks.append(keep[start:start + t.numel()].reshape(t.shape).to(t.device))
        start += t.numel()
    return masks
