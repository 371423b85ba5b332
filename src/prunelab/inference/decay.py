"""Learned decay-based KV eviction after Universal Attention (the seed system of prunelab
issue 18): instead of a hand-made rule, each KV head ranks its cached tokens by a small
decay function of key statistics, fitted on calibration data with the base model frozen.

Retention score of cached token ``j`` at a KV head (layer ``l``, head ``g``)::

    s_j = theta . [1, log |k_j|, cos(k_j, mean k), log |v_j|, log(1 + age_j)]

(``|k_j|`` is RoPE-invariant, so the rotated cached keys serve; ``age_j`` counts cache
entries after ``j``.) The ``theta`` are fitted by least squares to distil which tokens
carry attention mass: the target is ``log`` of the mean attention a token receives from
the last ``window`` queries of each calibration window (the queries closest to what
decoding will ask), averaged over the query heads of the group. The softmax attention and
RoPE of the model are untouched: only which entries stay in the cache changes. Without
fitted weights the score is the recency prior ``-log(1 + age)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prunelab.errors import ConfigError
from prunelab.inference.config import PRESSES, Press
from prunelab.inference.scores import attention_rows
from prunelab.registry import check_range

FEATURES = 5


@PRESSES.register("decay")
@dataclass(frozen=True)
class DecayEviction(Press):
    """Evict the cached tokens with the lowest learned retention score (see module
    docstring); the sink (token 0) and the last ``window`` tokens are always kept.
    ``weights``: ``layers x kv_heads x 5`` floats, flat (from :func:`fit_decay`)."""

    ratio: float = 0.5
    window: int = 8
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("window", self.window, 1, None, integer=True)
        if self.weights is not None:
            if len(self.weights) % FEATURES:
                raise ConfigError(f"weights: length must be a multiple of {FEATURES}, "
                                  f"got {len(self.weights)}")
            for w in self.weights:
                check_range("weights", w)


def key_features(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Features ``[B, G, T, 5]`` of cached keys and values ``[B, G, T, D]``."""
    k, v = keys.float(), values.float()
    t = k.shape[2]
    kn = k.norm(dim=-1).clamp_min(1e-6)
    mean = k.mean(2, keepdim=True)
    cos = (k * mean).sum(-1) / (kn * mean.norm(dim=-1).clamp_min(1e-6))
    age = torch.arange(t - 1, -1, -1, device=k.device, dtype=torch.float32)
    age = torch.log1p(age).expand_as(kn)
    return torch.stack([torch.ones_like(kn), kn.log(), cos,
                        v.norm(dim=-1).clamp_min(1e-6).log(), age], -1)


def decay_scores(config: DecayEviction, cache, layers: list[int]) -> dict[int, torch.Tensor]:
    """Retention scores ``{layer: [B, G, T]}`` of the cached tokens."""
    out = {}
    weights = None
    if config.weights is not None:
        groups = cache.layers[layers[0]].keys.shape[1] if layers else 1
        weights = torch.tensor(config.weights).view(-1, groups, FEATURES)
    for i in layers:
        layer = cache.layers[i]
        x = key_features(layer.keys, layer.values)
        if weights is None or i >= weights.shape[0]:
            out[i] = -x[..., 4]
        else:
            out[i] = (x * weights[i].to(x.device)[None, :, None, :]).sum(-1)
    return out


def fit_least_squares(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """Ridge solution ``theta`` ``[G, F]`` of ``x theta ~ y`` per group (``x`` ``[G, N, F]``,
    ``y`` ``[G, N]``), by the normal equations in float64."""
    gram = x.transpose(1, 2) @ x + ridge * torch.eye(x.shape[-1], dtype=x.dtype)
    return torch.linalg.solve(gram, x.transpose(1, 2) @ y[..., None])[..., 0]


@torch.no_grad()
def fit_decay(lm, input_ids: torch.Tensor, ratio: float = 0.5, window: int = 8,
              ridge: float = 1e-3) -> DecayEviction:
    """Fit the decay weights of every layer and KV head on calibration windows
    ``input_ids`` ``[N, T]`` (base model frozen; one forward per window, with the
    queries and keys read from the cache and a hook-free eager recomputation of the
    observer attention). Returns a ready :class:`DecayEviction`."""
    from transformers import DynamicCache

    from prunelab.inference.config import StreamingLLM
    from prunelab.inference.press import press as _press

    n, t = input_ids.shape
    if t <= window + 1:
        raise ConfigError(f"fit_decay: windows of {t} tokens are too short for window "
                          f"{window}")
    from prunelab.inference.kv import evictable_layers

    rows: dict[int, list] = {}
    captured: dict[int, torch.Tensor] = {}
    with _press(lm, StreamingLLM(ratio=0.0)) as session:  # reuse the attention capture
        session.on_attention = lambda module, q, k, kw: captured.__setitem__(
            module.layer_idx, attention_rows(q, k, kw.get("scaling") or module.scaling,
                                             window, kw.get("softcap")).mean(2))
        for row in input_ids.split(1):
            cache = DynamicCache(config=lm.adapter.base.config)
            lm.adapter.base(input_ids=row.to(lm.device), cache=cache, use_cache=True)
            for i in evictable_layers(cache):
                mass, layer = captured[i], cache.layers[i]
                g = layer.keys.shape[1]
                x = key_features(layer.keys, layer.values)[0, :, 1:t - window]  # [G, C, 5]
                m = mass[0].view(g, -1, t).mean(1)[:, 1:t - window]
                rows.setdefault(i, []).append((x, torch.log(m + 1e-6)))
            captured.clear()
    geo = lm.adapter.head_geometry(0)
    weights = torch.zeros(lm.adapter.num_blocks, geo.num_kv_heads, FEATURES)
    weights[..., 4] = -1.0  # layers not fitted (sliding windows) keep the recency prior
    for i, pairs in rows.items():
        x = torch.cat([a for a, _ in pairs], 1).double()  # [G, N*C, 5]
        y = torch.cat([b for _, b in pairs], 1).double()
        weights[i] = fit_least_squares(x, y, ridge).float()
    flat = weights.flatten().tolist()
    return DecayEviction(ratio=ratio, window=window, weights=tuple(flat))
