"""End-to-end fit of the blended decay press by the continuation KL.

The blended score (see :mod:`prunelab.inference.decay`) is SnapKV's observation-window
score (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation")
plus, per layer, ``lam_l`` times a learned key-statistics decay prior (after Universal
Attention: a per-head function of the cached keys, values and age, fitted by least squares
to the attention the next tokens put on the prompt) minus ``rho_l`` times ``log(1 + age)``.
The ``(lam_l, rho_l)`` are chosen END-TO-END: each calibration window of ``T`` tokens is cut
into a prompt of ``T - horizon`` tokens and a continuation; the prompt's cache is evicted
for real (the cache tensors shrink) under a candidate, the continuation runs on it, and the
objective is the mean KL(full || evicted) of the continuation's next-token distributions,
the quantity the benchmark measures on held-out text. The search is derivative-free: the
``recent`` share of the budget (H2O's recent window) and the ``mix`` of SnapKV's and H2O's
scores (Zhang et al. 2023; one value each for all layers) over a small grid, then from ``lam
= rho = 0`` a shared grid over ``(lam, rho)``, then coordinate passes
over blocks of consecutive layers, a move accepted only when it lowers the calibration KL by
more than ``tol`` (relative). ``share`` (fixed, not fitted) reserves that fraction of the
budget for SnapKV's own top tokens; with ``share = 0`` the search starts at SnapKV exactly,
so the fitted calibration KL is never above SnapKV's. The model's weights, softmax
attention and RoPE are untouched.

Cost: one forward per calibration window (prompt, then continuation on a copy of its
cache), then per candidate one continuation forward per window on the evicted cache (the
prompt's cache is computed once and copied).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from prunelab.errors import ConfigError
from prunelab.eval.divergence import kl_from_logits
from prunelab.inference.config import StreamingLLM
from prunelab.inference.decay import (
    FEATURES,
    DecayEviction,
    blend_scores,
    fit_least_squares,
    key_features,
    snap_scores,
)
from prunelab.inference.kv import budget, evict, evictable_layers
from prunelab.inference.press import press
from prunelab.inference.scores import attention_rows, group_heads
from prunelab.log import Ticker
from prunelab.registry import check_range

LAMS = (0.0, 0.25, 0.5, 1.0, 2.0)
RHOS = (0.0, 0.5, 1.0, 2.0, 4.0)
RECENTS = (0.0, 0.25, 0.5)
MIXES = (0.0, 0.5, 1.0)
SHARES = (0.0, 0.25, 0.5, 0.75)  # the grid when the share is fitted (with needle windows)


def coordinate_search(objective: Callable[[torch.Tensor], float], layers: Sequence[int],
                      n: int, lams: Sequence[float] = LAMS, rhos: Sequence[float] = RHOS,
                      blocks: int = 3, rounds: int = 1, tol: float = 0.0
                      ) -> tuple[torch.Tensor, float, float]:
    """Minimise ``objective(params)`` over ``params`` ``[n, 2]`` (``(lam, rho)`` per layer;
    only rows ``layers`` move) on the grid ``lams x rhos``: first one shared value for all
    ``layers``, then ``rounds`` coordinate passes over ``blocks`` contiguous groups of
    ``layers`` (each group's ``lam`` over ``lams``, then its ``rho`` over ``rhos``). A
    candidate is accepted when it is below ``best * (1 - tol)``. Returns ``(params,
    objective at zero, best objective)``."""
    params = torch.zeros(n, 2, dtype=torch.float64)
    rows = torch.tensor(list(layers), dtype=torch.long)
    start = best = float(objective(params))
    for lam in lams:
        for rho in rhos:
            if lam == 0.0 and rho == 0.0:
                continue
            trial = params.clone()
            trial[rows] = torch.tensor([lam, rho], dtype=torch.float64)
            best, params = _accept(objective, trial, best, params, tol)
    groups = [g for g in torch.tensor_split(rows, min(blocks, len(rows))) if len(g)] \
        if len(rows) else []
    for _ in range(rounds):
        for group in groups:
            for col, grid in ((0, lams), (1, rhos)):
                for v in grid:
                    if bool((params[group, col] == v).all()):
                        continue
                    trial = params.clone()
                    trial[group, col] = v
                    best, params = _accept(objective, trial, best, params, tol)
    return params, start, best


def _accept(objective, trial, best, params, tol):
    val = float(objective(trial))
    return (val, trial) if val < best * (1.0 - tol) else (best, params)


def _copy_cache(cache):
    """A cache whose layers can be shrunk or extended without touching ``cache`` (the
    layers' tensors are replaced, never written in place, by eviction and updates)."""
    new = copy.copy(cache)
    new.layers = [copy.copy(layer) for layer in cache.layers]
    return new


@dataclasses.dataclass
class _Window:
    cache: object
    observed: dict
    cont: torch.Tensor
    ref: torch.Tensor
    prompt: int


class KLCalibration:
    """Calibration windows ``input_ids`` ``[N, T]`` prepared once for the end-to-end fit
    (prompt caches, SnapKV scores, reference logits of the last ``horizon`` tokens and the
    least-squares key-statistics prior); :meth:`fit` then picks the blend per ratio."""

    @torch.no_grad()
    def __init__(self, lm, input_ids: torch.Tensor, horizon: int = 32, observe: int = 32,
                 kernel: int = 5, ridge: float = 1e-3, share: float = 0.0):
        check_range("horizon", horizon, 1, None, integer=True)
        check_range("observe", observe, 1, None, integer=True)
        t = input_ids.shape[1]
        if t - horizon <= observe + 1:
            raise ConfigError(f"fit_decay_kl: windows of {t} tokens are too short for "
                              f"observe {observe} and horizon {horizon}")
        check_range("share", share, 0.0, 1.0)
        self.lm, self.horizon, self.observe, self.kernel = lm, horizon, observe, kernel
        self.share = share
        self.history: dict[float, dict] = {}
        self.windows: list[_Window] = []
        pairs: dict[int, list] = {}
        for row in input_ids.split(1):
            self.windows.append(self._prepare(row.to(lm.device), pairs))
        geo = lm.adapter.head_geometry(0)
        prior = torch.zeros(lm.adapter.num_blocks, geo.num_kv_heads, FEATURES)
        for i, ps in pairs.items():
            x = torch.cat([a for a, _ in ps], 1).double()
            y = torch.cat([b for _, b in ps], 1).double()
            prior[i] = fit_least_squares(x, y, ridge).float()
        self.prior = tuple(prior.flatten().tolist())
        self.layers = evictable_layers(self.windows[0].cache) if self.windows else []

    def _prepare(self, row: torch.Tensor, pairs: dict) -> _Window:
        lm, h, o = self.lm, self.horizon, self.observe
        p = row.shape[1] - h
        rows: dict[int, torch.Tensor] = {}
        prompt = [True]

        def capture(m, q, k, kw) -> None:  # prompt: [1, G, p, 2] (snap, acc); then rows
            probs = attention_rows(q, k, kw.get("scaling") or m.scaling, q.shape[2],
                                   kw.get("softcap"))
            g = k.shape[1]
            rows[m.layer_idx] = torch.stack(
                [snap_scores(probs[:, :, -o:], g, self.kernel),
                 group_heads(probs.sum(2), g)], -1) if prompt[0] else probs

        with press(lm, StreamingLLM(ratio=0.0)) as session:  # reuse the attention capture
            session.on_attention = capture
            cache = DynamicCache(config=lm.adapter.base.config)
            lm.adapter.base(input_ids=row[:, :p], cache=cache, use_cache=True)
            layers = evictable_layers(cache)
            g = cache.layers[layers[0]].keys.shape[1] if layers else 1
            observed = {i: rows[i] for i in layers}
            prompt[0] = False
            out = lm.adapter.base(input_ids=row[:, p:], cache=_copy_cache(cache),
                                  use_cache=True)
        ref = lm.adapter.logits(out.last_hidden_state[0]).float()
        for i in layers:  # least-squares prior: log of the continuation's mass per token
            hh = rows[i].shape[1]
            mass = rows[i][0, :, :, :p].mean(1).view(g, hh // g, p).mean(1)  # [G, p]
            x = key_features(cache.layers[i].keys, cache.layers[i].values)[0]
            cut = slice(1, max(p - o, 2))
            pairs.setdefault(i, []).append((x[:, cut], torch.log(mass[:, cut] + 1e-6)))
        return _Window(cache, observed, row[:, p:], ref, p)

    def config(self, ratio: float, params: torch.Tensor | None = None,
               recent: float = 0.0, mix: float = 0.0,
               share: float | None = None) -> DecayEviction:
        """The press at ``ratio`` with blend ``params`` ``[layers, 2]`` (zero, with
        ``share = recent = mix = 0``: SnapKV); ``share`` None: the calibration's own."""
        n = self.lm.adapter.num_blocks
        params = torch.zeros(n, 2) if params is None else params
        share = self.share if share is None else share
        return DecayEviction(ratio=ratio, window=self.observe, observe=self.observe,
                             kernel=self.kernel, weights=self.prior, share=share,
                             recent=recent, mix=mix,
                             blend=tuple(float(v) for v in params.flatten()))

    @torch.no_grad()
    def objective(self, cfg: DecayEviction) -> float:
        """Mean continuation KL(full || evicted) over the windows under ``cfg``."""
        total = 0.0
        for w in self.windows:
            cache = _copy_cache(w.cache)
            layers = evictable_layers(cache)
            evict(cfg, cache, budget(cfg, w.prompt), blend_scores(cfg, cache, layers,
                                                                  w.observed))
            pos = torch.arange(w.prompt, w.prompt + w.cont.shape[1], device=w.cont.device)
            out = self.lm.adapter.base(input_ids=w.cont, cache=cache, use_cache=True,
                                       position_ids=pos[None])
            logits = self.lm.adapter.logits(out.last_hidden_state[0]).float()
            total += float(kl_from_logits(w.ref, logits).mean())
        return total / max(len(self.windows), 1)

    def fit(self, ratio: float, lams: Sequence[float] = LAMS,
            rhos: Sequence[float] = RHOS, blocks: int = 3, rounds: int = 1,
            tol: float = 0.01, recents: Sequence[float] = RECENTS,
            mixes: Sequence[float] = MIXES,
            shares: Sequence[float] | None = None) -> DecayEviction:
        """The blended press at ``ratio``: first ``recent`` and ``mix`` (one value each
        for all layers, over ``recents x mixes``, blend zero; with ``shares``, over
        ``shares x recents x mixes``: the share of the budget reserved for SnapKV's top
        tokens is then fitted too, else it is the calibration's ``share``), then the
        ``(lam, rho)`` per layer that minimise the calibration KL
        (:func:`coordinate_search`); ``history[ratio]`` records the KL of SnapKV
        (computed, share 0), with the chosen ``share`` / ``mix`` / ``recent`` and zero
        blend, and of the result."""
        check_range("ratio", ratio, 0.0, 0.99)
        if shares is not None:
            shares = tuple(shares)
            if not shares:
                raise ConfigError("fit: shares must name at least one value")
            for v in shares:
                check_range("share", v, 0.0, 1.0)
        n = self.lm.adapter.num_blocks
        grid = len(shares) if shares is not None else 1
        groups = min(blocks, len(self.layers))
        ticker = Ticker(1 + grid * len(recents) * len(mixes) + len(lams) * len(rhos)
                        + rounds * groups * (len(lams) + len(rhos)),
                        f"fit at ratio {ratio}: KL evaluations")

        def objective(cfg: DecayEviction) -> float:
            val = self.objective(cfg)
            ticker.tick()
            return val

        snap = self.config(ratio, share=0.0)
        history = {"kl_snapkv": objective(snap)}
        (share, recent, mix), best = (self.share, 0.0, 0.0), None
        for h in (shares if shares is not None else (self.share,)):
            for r in recents:
                for x in mixes:
                    val = (history["kl_snapkv"] if h == r == x == 0.0
                           else objective(self.config(ratio, recent=r, mix=x, share=h)))
                    if best is None or val < best * (1.0 - tol):
                        (share, recent, mix), best = (h, r, x), val
        history["kl_zero_blend"] = best  # at the chosen mix / recent (mix 1, recent 0.5: H2O)
        params, start, best = coordinate_search(
            lambda p: objective(self.config(ratio, p, recent, mix, share)),
            self.layers, n, lams, rhos, blocks, rounds, tol)
        history.update(share=share, recent=recent, mix=mix, kl_fitted=best,
                       blend=params[self.layers].tolist())
        self.history[ratio] = history
        return self.config(ratio, params, recent, mix, share)


def fit_decay_kl(lm, input_ids: torch.Tensor, ratio: float = 0.5, horizon: int = 32,
                 observe: int = 32, kernel: int = 5, share: float = 0.0,
                 **search) -> DecayEviction:
    """Fit the blended decay press end-to-end on calibration windows ``input_ids``
    ``[N, T]`` (see the module docstring; ``share``: the budget fraction reserved for
    SnapKV's own top tokens, fixed, not fitted); ``search``: options of
    :meth:`KLCalibration.fit` (``lams``, ``rhos``, ``blocks``, ``rounds``, ``tol``)."""
    return KLCalibration(lm, input_ids, horizon, observe, kernel,
                         share=share).fit(ratio, **search)
