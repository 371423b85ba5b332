"""Learned decay-based KV eviction after Universal Attention (an unpublished proposal: a
learned decay subtracted from the attention logits): instead of a hand-made rule, each KV
head ranks its cached tokens by a small decay function of key statistics, fitted on
calibration data with the base model frozen.

Retention score of cached token ``j`` at a KV head (layer ``l``, head ``g``)::

    s_j = theta . [1, log |k_j|, cos(k_j, mean k), log |v_j|, log(1 + age_j)]

(``|k_j|`` is RoPE-invariant, so the rotated cached keys serve; ``age_j`` counts cache
entries after ``j``.) The ``theta`` are fitted by least squares to distil which tokens
carry attention mass: the target is ``log`` of the mean attention a token receives from
the last ``window`` queries of each calibration window (the queries closest to what
decoding will ask), averaged over the query heads of the group.

With ``observe = o > 0`` a sixth feature joins: ``log`` of the attention token ``j``
received from the last ``o`` prompt queries (the observation window, group-averaged, as
SnapKV scores), and the fit looks **ahead**: each calibration window of ``T`` tokens is
cut into a prompt of ``T - horizon`` tokens and a continuation, and the target is the
attention mass the ``horizon`` continuation queries put on each prompt token, which is
what the evicted cache will be asked for. The learned score then weighs what the prompt's
last queries saw against key statistics and age by how well each predicts the future
(with only the sixth feature it is SnapKV's score without smoothing). The softmax attention and
RoPE of the model are untouched: only which entries stay in the cache changes. Without
fitted weights the score is the recency prior ``-log(1 + age)``.

**Blended (``blend``, fitted end-to-end by :func:`prunelab.inference.decay_kl.fit_decay_kl`).**
A family that contains SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for
Before Generation") and H2O as special cases and adds the learned decay prior (Universal
Attention) and recency, with per-layer combination weights ``(lam_l, rho_l)``::

    s_j = (1 - mix) log(snap_j + 1e-8) + mix log(acc_j + 1e-8)
          + lam_l * (theta . x_j) - rho_l * log(1 + age_j)

``snap_j`` is SnapKV's score exactly (the last ``observe`` prompt queries' attention,
summed, max-pooled over ``kernel`` neighbours, averaged over the query heads of the KV
group), ``theta . x_j`` the key-statistics decay prior (``weights``: ``layers x kv_heads x
5``, a predicted log attention; optional) and the last ``window`` tokens are kept (no
separate sink), so ``blend`` all zero (and ``share = recent = mix = 0``) evicts exactly as
``SnapKV(window=window, kernel=kernel)``. ``share`` reserves that fraction of the budget
for SnapKV's own top tokens (what the prompt's last queries ask for, a question's needle,
is never traded for recency) and ``recent`` that fraction for the most recent tokens
(H2O's recent window, Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"); both reserved sets
are taken before the blended score ranks the rest. ``acc_j`` is H2O's score (the attention
accumulated over every prompt query), so ``mix = 1, recent = 0.5, share = 0`` and zero
blend evicts as ``H2O()``. The ``recent``, ``mix`` and ``(lam_l, rho_l)`` are chosen on
calibration windows by the KL of the continuation's next-token distributions under real
eviction (derivative-free search).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from prunelab.errors import ConfigError
from prunelab.inference.base import CACHE_BUDGET, PRESSES, Press
from prunelab.inference.config import StreamingLLM
from prunelab.inference.kv import evictable_layers
from prunelab.inference.scores import (
    ScoreInputs,
    attention_rows,
    group_heads,
    n_removed,
    smooth,
)
from prunelab.registry import check_range

FEATURES = 5


@PRESSES.register("decay")
@dataclass(frozen=True)
class DecayEviction(Press):
    """Evict the cached tokens with the lowest learned retention score (see module
    docstring); the sink (token 0) and the last ``window`` tokens are always kept.
    ``weights``: ``layers x kv_heads x 5`` floats, flat (from :func:`fit_decay`).
    ``blend``: ``layers x 2`` floats ``(lam, rho)`` per layer, flat (from
    :func:`~prunelab.inference.decay_kl.fit_decay_kl`; needs ``observe > 0``): the blended
    SnapKV + decay-prior score of the module docstring (then ``weights`` is the 5-feature
    prior and only the last ``window`` tokens are protected). ``share`` (blend only): the
    fraction of the budget given first to SnapKV's own ranking (its top tokens are kept
    whatever the blend says), ``recent`` the fraction given to the most recent tokens
    (the window included; H2O's recent window), the rest by the blended score. ``mix``:
    the base score is ``(1 - mix) log snap + mix log acc``, ``acc`` H2O's attention
    accumulated over all prompt queries (``mix > 0`` needs every query's attention row
    in the prefill, as H2O)."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    window: int = field(default=8, metadata={"help": 'the last tokens always kept'})
    weights: tuple[float, ...] | None = field(default=None, metadata={"help": (
        "fitted retention weights, layers x kv_heads x 5 (fitted when not given)")})
    observe: int = field(default=0, metadata={"help": (
        "decay: observation window of the attention feature (0: none)")})
    kernel: int = field(default=5, metadata={"help": 'width of the score smoothing (odd)'})
    blend: tuple[float, ...] | None = field(default=None, metadata={"help": (
        "(lam, rho) per layer of the blended score (from the KL fit)")})
    share: float = field(default=0.0, metadata={"help": (
        "decay, blend: fraction of the budget kept by SnapKV's own ranking")})
    recent: float = field(default=0.0, metadata={"help": 'recent window, a fraction of the budget'})
    mix: float = field(default=0.0, metadata={"help": (
        "decay: base score (1 - mix) log snap + mix log acc")})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("window", self.window, 1, None, integer=True)
        check_range("observe", self.observe, 0, None, integer=True)
        check_range("kernel", self.kernel, 1, None, integer=True)
        if self.kernel % 2 == 0:
            raise ConfigError(f"kernel must be odd, got {self.kernel}")
        check_range("share", self.share, 0.0, 1.0)
        check_range("recent", self.recent, 0.0, 1.0)
        check_range("mix", self.mix, 0.0, 1.0)
        if self.blend is not None:
            if not self.observe:
                raise ConfigError("blend needs observe > 0 (the observation window)")
            if len(self.blend) % 2:
                raise ConfigError(f"blend: length must be a multiple of 2 (lam, rho per "
                                  f"layer), got {len(self.blend)}")
            for w in self.blend:
                check_range("blend", w)
        if self.weights is not None:
            f = self.features
            if len(self.weights) % f:
                raise ConfigError(f"weights: length must be a multiple of {f} "
                                  f"({'observe > 0' if f == 6 else 'keys only'}), "
                                  f"got {len(self.weights)}")
            for w in self.weights:
                check_range("weights", w)

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """The retention score of the block's cached tokens (the module docstring), with
        the observation-window attention of this call when ``observe > 0``."""
        g, observed = inputs.groups, None
        if self.observe and self.blend is not None and self.mix:  # SnapKV's and H2O's
            probs = inputs.attention(inputs.query.shape[2])
            observed = torch.stack([snap_scores(probs[:, :, -self.observe:], g, self.kernel),
                                    group_heads(probs.sum(2), g)], -1)
        elif self.observe:
            probs = inputs.attention(self.observe)
            observed = snap_scores(probs, g, self.kernel) if self.blend is not None \
                else observation_scores(probs, g, self.kernel)
        if self.blend is not None:
            return blend_layer(self, inputs.layer, inputs.key, inputs.value, observed)
        return decay_layer(self, inputs.layer, inputs.key, inputs.value, observed)

    def protected(self, length: int, keep: int) -> tuple[int, int]:
        return (1 if self.blend is None else 0), self.window  # the sink, unless blended

    @property
    def features(self) -> int:
        """Features per KV head: 5, or 6 with the observation-window attention as a
        fitted feature (``observe > 0`` without ``blend``)."""
        return FEATURES + (1 if self.observe and self.blend is None else 0)


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


def observation_scores(rows: torch.Tensor, groups: int, kernel: int) -> torch.Tensor:
    """The observation-window feature ``[B, G, T]`` from attention rows ``[B, H, r, T]``:
    mean over the rows, max-pooled over ``kernel`` neighbouring tokens and averaged over
    the query heads of each KV group (SnapKV's score, as a mean)."""
    return group_heads(smooth(rows.mean(2), kernel, "max"), groups)


def with_observed(x: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, G, T, 5]`` with ``log`` of the observed attention ``[B, G, T]`` appended."""
    return torch.cat([x, torch.log(observed.float() + 1e-6)[..., None]], -1)


def decay_layer(config: DecayEviction, layer: int, keys: torch.Tensor,
                values: torch.Tensor, observed: torch.Tensor | None = None) -> torch.Tensor:
    """Retention scores ``[B, G, T]`` of block ``layer``'s cached keys and values
    ``[B, G, T, D]`` (``observed``: its observation-window attention ``[B, G, T]``, needed
    when ``config.observe > 0`` and the weights are fitted): the fitted decay function, or
    the recency prior ``-log(1 + age)`` without weights (or past their layers)."""
    x = key_features(keys, values)
    if config.weights is None:
        return -x[..., 4]
    weights = torch.tensor(config.weights).view(-1, keys.shape[1], config.features)
    if layer >= weights.shape[0]:
        return -x[..., 4]
    if config.observe:
        if observed is None:
            raise ConfigError(f"decay: no observation-window attention for layer {layer}")
        x = with_observed(x, observed)
    return (x * weights[layer].to(x.device)[None, :, None, :]).sum(-1)


def decay_scores(config: DecayEviction, cache, layers: list[int],
                 observed: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """Retention scores ``{layer: [B, G, T]}`` of the cached tokens (``observed``: the
    observation-window attention per layer, needed when ``config.observe > 0``)."""
    if config.blend is not None:
        return blend_scores(config, cache, layers, observed)
    observed = observed or {}
    return {i: decay_layer(config, i, cache.layers[i].keys, cache.layers[i].values,
                           observed.get(i)) for i in layers}


def snap_scores(rows: torch.Tensor, groups: int, kernel: int) -> torch.Tensor:
    """SnapKV's token score ``[B, G, T]`` from attention rows ``[B, H, r, T]``: summed over
    the rows, max-pooled over ``kernel`` neighbours, averaged per KV group (the same
    operations as the ``snapkv`` press, so the ranking is identical)."""
    return group_heads(smooth(rows.sum(2), kernel, "max"), groups)


def blend_layer(config: DecayEviction, layer: int, keys: torch.Tensor,
                values: torch.Tensor, observed: torch.Tensor | None) -> torch.Tensor:
    """Blended scores ``[B, G, T]`` (float64) of block ``layer`` (the module docstring);
    ``observed``: SnapKV's score ``[B, G, T]`` of the block, or ``[B, G, T, 2]`` with H2O's
    accumulated attention (``mix > 0``). Layers past the end of ``blend`` use ``lam = rho
    = 0`` (SnapKV)."""
    if observed is None:
        raise ConfigError(f"decay: no observation-window attention for layer {layer}")
    blend = torch.tensor(config.blend, dtype=torch.float64).view(-1, 2)
    o = observed.double()
    snap = o[..., 0] if o.dim() == 4 else o
    s = torch.log(snap + 1e-8)
    if config.mix:  # H2O's accumulated attention, [..., 1]
        s = (1.0 - config.mix) * s + config.mix * torch.log(o[..., 1] + 1e-8)
    lam, rho = blend[layer].tolist() if layer < blend.shape[0] else (0.0, 0.0)
    if lam or rho:
        x = key_features(keys, values).double()
        if lam and config.weights is not None:
            w = torch.tensor(config.weights, dtype=torch.float64)
            w = w.view(-1, keys.shape[1], FEATURES)
            if layer < w.shape[0]:
                s = s + lam * (x * w[layer].to(x.device)[None, :, None, :]).sum(-1)
        s = s - rho * x[..., 4]
    return _reserve(s, snap, config)


def blend_scores(config: DecayEviction, cache, layers: list[int],
                 observed: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """:func:`blend_layer` of each of ``layers`` of ``cache`` (``observed``: per layer)."""
    observed = observed or {}
    return {i: blend_layer(config, i, cache.layers[i].keys, cache.layers[i].values,
                           observed.get(i)) for i in layers}


def _reserve(s: torch.Tensor, snap: torch.Tensor, config: DecayEviction) -> torch.Tensor:
    """``s`` with SnapKV's top ``share x budget`` tokens and the ``recent x budget`` most
    recent tokens (the protected last ``window`` included) lifted above every other token,
    so the budget keeps them first (reserved slots never exceed ``budget - window``)."""
    t, w = s.shape[-1], config.window
    keep = max(t - n_removed(t, config.ratio), 1)
    room = max(keep - w, 0)
    n = min(int(config.share * keep), room)
    r = min(max(int(config.recent * keep) - w, 0), room - n)
    lift = torch.zeros_like(s)
    if r > 0:
        lift[..., max(t - w - r, 0):t - w] = 1e30
    if n > 0:
        free = snap.double().clone()
        free[..., max(t - w - r, 0):] = float("-inf")
        top = torch.sort(free, dim=-1, descending=True, stable=True).indices[..., :n]
        lift.scatter_(-1, top, 1e30)  # ties toward earlier tokens, as SnapKV's keep_top
    return s + lift


def fit_least_squares(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """Ridge solution ``theta`` ``[G, F]`` of ``x theta ~ y`` per group (``x`` ``[G, N, F]``,
    ``y`` ``[G, N]``), by the normal equations in float64."""
    gram = x.transpose(1, 2) @ x + ridge * torch.eye(x.shape[-1], dtype=x.dtype)
    return torch.linalg.solve(gram, x.transpose(1, 2) @ y[..., None])[..., 0]


@torch.no_grad()
def fit_decay(lm, input_ids: torch.Tensor, ratio: float = 0.5, window: int = 8,
              ridge: float = 1e-3, observe: int = 0, horizon: int = 0,
              kernel: int = 5) -> DecayEviction:
    """Fit the decay weights of every layer and KV head on calibration windows
    ``input_ids`` ``[N, T]`` (base model frozen; one forward per window, with the
    queries and keys read from the cache and a hook-free eager recomputation of the
    observer attention). ``observe > 0`` adds the observation-window feature and
    ``horizon > 0`` fits to the attention of the last ``horizon`` tokens of each window
    on the prompt before them (see the module docstring). Returns a ready
    :class:`DecayEviction`."""
    n, t = input_ids.shape
    check_range("horizon", horizon, 0, None, integer=True)
    check_range("observe", observe, 0, None, integer=True)
    prompt = t - horizon
    if prompt <= max(window, observe) + 1:
        raise ConfigError(f"fit_decay: windows of {t} tokens are too short for window "
                          f"{window}, observe {observe} and horizon {horizon}")
    rows_needed = horizon + observe if horizon else max(window, observe)

    # the press module imports budgets.py, whose presses register after this module's (the
    # order of CLI lists): imported here, not at the top
    from prunelab.inference.press import press as _press  # noqa: PLC0415 - registration order

    rows: dict[int, list] = {}
    captured: dict[int, torch.Tensor] = {}
    with _press(lm, StreamingLLM(ratio=0.0)) as session:  # reuse the attention capture
        session.on_attention = lambda module, q, k, kw: captured.__setitem__(
            module.layer_idx, attention_rows(q, k, kw.get("scaling") or module.scaling,
                                             rows_needed, kw.get("softcap")))
        for row in input_ids.split(1):
            cache = DynamicCache(config=lm.adapter.base.config)
            lm.adapter.base(input_ids=row.to(lm.device), cache=cache, use_cache=True)
            for i in evictable_layers(cache):
                rows.setdefault(i, []).append(
                    _fit_rows(captured[i], cache.layers[i], prompt, window, observe, horizon,
                              kernel))
            captured.clear()
    geo = lm.adapter.head_geometry(0)
    features = FEATURES + (1 if observe else 0)
    weights = torch.zeros(lm.adapter.num_blocks, geo.num_kv_heads, features)
    weights[..., 4] = -1.0  # layers not fitted (sliding windows) keep the recency prior
    for i, pairs in rows.items():
        x = torch.cat([a for a, _ in pairs], 1).double()  # [G, N*C, 5]
        y = torch.cat([b for _, b in pairs], 1).double()
        weights[i] = fit_least_squares(x, y, ridge).float()
    flat = weights.flatten().tolist()
    return DecayEviction(ratio=ratio, window=window, weights=tuple(flat), observe=observe,
                         kernel=kernel)


def _fit_rows(probs: torch.Tensor, layer, prompt: int, window: int, observe: int,
              horizon: int, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[G, C, F]`` and log-attention targets ``[G, C]`` of one calibration
    window, over the prompt tokens ``1 .. prompt - window - 1`` (the sink and the protected
    last ``window`` prompt tokens are always kept, so they are not fitted). ``probs``:
    the captured attention rows ``[1, H, R, T]`` of the window's last ``R`` queries."""
    g = layer.keys.shape[1]
    keys, values = layer.keys[:, :, :prompt], layer.values[:, :, :prompt]
    x = key_features(keys, values)  # [1, G, prompt, 5]
    h = probs.shape[1]

    def pooled(rows: torch.Tensor) -> torch.Tensor:  # [1, H, r, T] -> [G, prompt]
        return rows[0].mean(1).view(g, h // g, -1).mean(1)[:, :prompt]

    if horizon:
        future = probs[:, :, probs.shape[2] - horizon:]
        if observe:
            seen = probs[:, :, probs.shape[2] - horizon - observe:probs.shape[2] - horizon]
            x = with_observed(x, observation_scores(seen[..., :prompt], g, kernel))
        target = pooled(future)
    else:
        if observe:
            x = with_observed(x, observation_scores(probs[:, :, probs.shape[2] - observe:],
                                                    g, kernel))
        target = pooled(probs[:, :, probs.shape[2] - window:])
    cut = slice(1, prompt - window)
    return x[0, :, cut], torch.log(target[:, cut] + 1e-6)
