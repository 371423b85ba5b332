"""Splitting FFN channels into equal-size experts (MoEfication, Zhang et al. 2022,
"MoEfication: Transformer Feed-forward Layers are Mixtures of Experts", arXiv:2110.01786).

Pure maths on tensors:

* :func:`balanced_sizes`: ``F`` channels into ``E`` experts, sizes differing by at most one
  (all equal when ``E`` divides ``F``).
* :func:`balanced_assign`: channels to clusters under those capacities, each channel going
  to its most similar cluster that still has room (rounds of proposals: every unassigned
  channel proposes to its best open cluster, a cluster keeps the most similar proposals
  up to its room).
* :func:`balanced_kmeans`: spherical k-means (cosine similarity to unit centroids) with the
  balanced assignment, seeded initialisation from distinct channels.
* :func:`weight_features`: the unit-normalised gate rows and up rows of each channel,
  concatenated (the MoEfication "parameter clustering" split).
* :func:`coactivation_features`: each channel's activation magnitudes ``|h_c(x)|`` over
  calibration tokens, unit-normalised, so that the cosine similarity of two channels is
  how strongly they are active on the same tokens (the co-activation split).
* :func:`expert_permutation`: the channel order that makes every cluster contiguous.
"""

from __future__ import annotations

import torch


def balanced_sizes(channels: int, experts: int) -> list[int]:
    """Sizes of ``experts`` clusters of ``channels`` (the first ``channels % experts`` get
    one more)."""
    if experts < 1 or experts > channels:
        raise ValueError(f"cannot split {channels} channels into {experts} experts")
    base, extra = divmod(channels, experts)
    return [base + (1 if e < extra else 0) for e in range(experts)]


def balanced_assign(sim: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Cluster label ``[F]`` of every channel under capacities ``sizes`` (``sum == F``),
    from similarities ``sim`` ``[F, E]`` (higher is closer). Deterministic."""
    f, e = sim.shape
    if sum(sizes) != f or len(sizes) != e:
        raise ValueError(f"sizes {sizes} do not fit {f} channels and {e} clusters")
    labels = torch.full((f,), -1, dtype=torch.long)
    room = torch.tensor(sizes, dtype=torch.long)
    sim = sim.detach().to("cpu", torch.float64)
    while bool((labels < 0).any()):
        free = (labels < 0).nonzero().squeeze(1)
        open_sim = sim[free].masked_fill((room == 0)[None, :], float("-inf"))
        choice = open_sim.argmax(dim=1)
        for c in choice.unique().tolist():
            cand = free[choice == c]
            take = min(int(room[c]), cand.numel())
            best = sim[cand, c].argsort(descending=True, stable=True)[:take]
            labels[cand[best]] = c
            room[c] -= take
    return labels


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def balanced_kmeans(features: torch.Tensor, experts: int, seed: int = 0,
                    iterations: int = 50) -> torch.Tensor:
    """Balanced spherical k-means of the rows of ``features`` ``[F, D]`` into ``experts``
    clusters of :func:`balanced_sizes`; returns the label of each row. Centroids start at
    ``experts`` distinct rows drawn with ``seed``; stops when the labels repeat."""
    x = _unit_rows(features.detach().to(torch.float32))
    f = x.shape[0]
    sizes = balanced_sizes(f, experts)
    g = torch.Generator().manual_seed(int(seed))
    centroids = x[torch.randperm(f, generator=g)[:experts].to(x.device)]
    labels = None
    for _ in range(max(1, iterations)):
        new = balanced_assign(x @ centroids.t(), sizes)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        onehot = torch.zeros(f, experts, dtype=x.dtype, device=x.device)
        onehot[torch.arange(f), labels.to(x.device)] = 1.0
        centroids = _unit_rows(onehot.t() @ x)
    return labels


def weight_features(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """``[F, D]`` features of the channels from their gate rows ``[F, d]`` (and up rows),
    each row unit-normalised, concatenated."""
    parts = [_unit_rows(gate.detach().float())]
    if up is not None:
        parts.append(_unit_rows(up.detach().float()))
    return torch.cat(parts, dim=1)


def coactivation_features(acts: torch.Tensor) -> torch.Tensor:
    """``[F, tokens]`` features from the channel activations ``acts`` ``[tokens, F]``
    (``act(gate x) * up x``): each channel's magnitudes over the tokens, unit-normalised."""
    return _unit_rows(acts.detach().float().abs().t())


def expert_permutation(labels: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """``(perm, sizes)``: channel order putting cluster 0's channels first (ascending
    indices), then cluster 1's, ...; ``sizes[e]`` channels per cluster."""
    labels = labels.to("cpu")
    groups = [(labels == e).nonzero().squeeze(1) for e in range(experts)]
    return torch.cat(groups), [int(g.numel()) for g in groups]
