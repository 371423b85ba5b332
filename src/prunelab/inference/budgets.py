"""Budget wrappers over a scoring press: head-wise budgets (AdaKV) and layer-wise budgets
(PyramidKV). The wrapped press (``scorer``) scores the prompt's tokens as it does alone;
the wrapper only decides how many tokens each KV head (AdaKV) or each block (PyramidKV)
keeps, with the same total as the plain press.

* **AdaKV** (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
  Allocation for Efficient LLM Inference"; semantics of kvpress' ``AdaKVPress``): with
  ``keep`` the uniform per-head budget of a block, every KV head first keeps its own top
  ``safe = max(1, int(keep * alpha_safeguard))`` tokens (the scorer's fixed tokens, e.g.
  SnapKV's window, rank first), then the block keeps the ``G * keep`` highest scores of the
  flattened ``[G, L]`` scores (ties: lower head, then earlier token). Heads keep different
  counts ``n_g`` (sum ``G * keep``).
* **PyramidKV** (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
  Information Funneling"; the schedule of kvpress' ``PyramidKVPress``, itself from
  KVCache-Factory): with ``keep`` the uniform budget and ``n`` evictable blocks, ``lo = keep /
  beta``, ``hi = 2 keep - lo``; if ``hi >= L - floor`` then ``hi = L - floor`` and ``lo = 2
  keep - hi``; block ``i`` keeps ``hi - i (hi - lo) / (n - 1)`` (a linear pyramid, lower
  blocks more), unless ``L >= hi >= lo >= floor`` fails, where every block keeps ``keep``
  (kvpress' fallback). kvpress rounds each block's budget; here the budgets are rounded by
  largest remainder so that they sum to exactly ``n * keep``.

Layout of a head-wise cache: prunelab's cache really shrinks, and a dense ``[B, G, T, D]``
tensor cannot hold ragged heads, so a block is padded to ``P = max_g n_g`` entries per head:
head ``g``'s kept tokens in order, then ``P - n_g`` holes (copies of entry 0, never
attended), then the tokens added later. The holes are recorded on the cache
(``cache.prunelab_heads``, ``{block: bool [B, G, P]}``) and :func:`layer_mask` gives that
block's attention a per-head mask; the memory is ``P`` entries per head (between ``keep``
and ``L``), where kvpress' AdaKV keeps all ``L`` and masks in place. PyramidKV's blocks
have different lengths, which the model's one mask (built from block 0's length) does not
describe, so its blocks get their own causal mask too (``None`` holes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Literal

import torch

from prunelab.errors import ConfigError
from prunelab.inference import kv
from prunelab.inference.config import CACHE_BUDGET, PRESSES, Press, SnapKV
from prunelab.registry import check_range, strict_kwargs

#: the presses a budget wrapper can redistribute (they score every prompt token)
SCORERS = ("snapkv", "h2o", "tova", "knorm", "expected-attention")


def _scorer(name: str, ratio: float, items: tuple[str, ...],
            defaults: dict | None = None) -> Press:
    """The scoring press ``name`` at ``ratio`` with ``KEY=VALUE`` ``items`` (values read
    as JSON when they parse, else strings) over the wrapper's own ``defaults``."""
    if name not in SCORERS:
        raise ConfigError(f"scorer must be one of {', '.join(SCORERS)}, got {name!r}")
    cls = PRESSES.get(name)
    opts: dict = dict(defaults or {})
    for item in items:
        key, sep, value = str(item).partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"scorer_options takes KEY=VALUE items, got {item!r}")
        if key == "ratio":
            raise ConfigError("scorer_options: the ratio is the wrapper's own (its ratio)")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value.strip()
        if isinstance(opts[key], int) and not isinstance(opts[key], bool) and \
                typing.get_type_hints(cls).get(key) is float:
            opts[key] = float(opts[key])
    strict_kwargs(cls, opts, f"scorer {name!r}")
    scorer = cls(ratio=ratio, **opts)
    if getattr(scorer, "every", 0):
        raise ConfigError(f"scorer {name!r}: every must be 0 (decode-time eviction keeps one "
                          "budget for every head and block)")
    return scorer


@dataclass(frozen=True)
class Budgeted(Press):
    """Base of the budget wrappers: ``scorer`` scores, the wrapper allocates."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    scorer: Literal["snapkv", "h2o", "tova", "knorm", "expected-attention"] = field(
        default="snapkv", metadata={"help": (
            "adakv / pyramidkv: the press that scores the tokens (its budgets are "
            "redistributed)")})
    scorer_options: tuple[str, ...] = field(default=(), metadata={"help": (
        "adakv / pyramidkv: KEY=VALUE options of the scorer, comma-separated (e.g. "
        "window=16,kernel=7)")})

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_base", _scorer(self.scorer, self.ratio,
                                                  tuple(self.scorer_options),
                                                  self.scorer_defaults()))

    def scorer_defaults(self) -> dict:
        """The wrapper's defaults for its scorer's options (``scorer_options`` win)."""
        return {}

    @property
    def base(self) -> Press:
        """The scoring press (at the wrapper's ratio)."""
        return self._base


@PRESSES.register("adakv")
@dataclass(frozen=True)
class AdaKV(Budgeted):
    """Head-wise budgets (AdaKV): the same number of cached entries per block as the
    scorer alone, given to the KV heads by score (top ``G x keep`` of the block's flattened
    head x token scores), each head keeping at least its top ``alpha_safeguard x keep``
    tokens. Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation for Efficient LLM Inference"; semantics of kvpress' AdaKVPress. Heads are
    padded to the longest head of the block and the holes masked."""

    alpha_safeguard: float = field(default=0.2, metadata={"help": (
        "adakv: share of its uniform budget every KV head keeps in any case (its own top "
        "tokens)")})

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("alpha_safeguard", self.alpha_safeguard, 0.0, 1.0)


@PRESSES.register("pyramidkv")
@dataclass(frozen=True)
class PyramidKV(Budgeted):
    """Layer-wise budgets (PyramidKV): lower blocks keep more tokens, upper blocks fewer, on
    a linear pyramid with the scorer's total (kvpress' schedule: steepness ``beta``, ends
    ``floor`` away from 0 and from the prompt length). Cai et al. 2024, "PyramidKV: Dynamic
    KV Cache Compression based on Pyramidal Information Funneling". With the SnapKV
    scorer and no ``window`` among ``scorer_options``, the window is at most half of
    ``floor`` (32 by default)."""

    beta: float = field(default=20.0, metadata={"help": (
        "pyramidkv: steepness, the top block keeps about keep / beta (>= 1)")})
    floor: int = field(default=64, metadata={"help": (
        "pyramidkv: smallest block budget, and least removed from the bottom block "
        "(kvpress' window_size); else every block keeps the uniform budget")})

    def __post_init__(self) -> None:
        check_range("beta", self.beta, 1.0, None)
        check_range("floor", self.floor, 1, None, integer=True)  # before the scorer's
        super().__post_init__()

    def scorer_defaults(self) -> dict:
        # SnapKV's own window (64) would fill the smallest blocks (floor 64 entries): they
        # would keep nothing but the window (continuation KL 0.0196 against 0.0080 with 32
        # on SmolLM2-135M at 0.5, docs/inference.md); half the floor leaves them half their
        # budget to choose
        if self.scorer != "snapkv":
            return {}
        return {"window": min(SnapKV.window, max(1, self.floor // 2))}


def scoring_config(config: Press, question: int = 0) -> Press:
    """The press that scores the prompt: a wrapper's scorer, else ``config``; with a
    ``question`` of that many tokens ending the prompt (query-aware mode), SnapKV's
    observation window is the question."""
    scorer = config.base if isinstance(config, Budgeted) else config
    if question and isinstance(scorer, SnapKV) and scorer.window != question:
        scorer = dataclasses.replace(scorer, window=question)
    return scorer


def adakv_keep(scores: torch.Tensor, keep: int, fixed: torch.Tensor | None, alpha: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaKV's selection from one block's scores ``[B, G, L]``: ``(idx, holes)``, both
    ``[B, G, P]`` with ``P`` the largest head count; each head's kept token indices in
    order, then holes (``holes`` true, ``idx`` 0). ``fixed`` (bool ``[L]``): tokens every
    head keeps (the scorer's window, sinks...; at most ``keep``). Total kept ``G * keep``
    per batch row."""
    b, g, length = scores.shape
    s = scores.float().clone()
    if fixed is not None:
        s[..., fixed] = float("inf")
    safe = max(1, int(keep * alpha)) if alpha > 0 else 0
    if safe:
        top = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :safe]
        s.scatter_(-1, top, float("inf"))
    flat = torch.sort(s.reshape(b, -1), dim=-1, descending=True, stable=True).indices
    chosen = torch.zeros(b, g * length, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, flat[:, :g * keep], True)
    chosen = chosen.view(b, g, length)
    width = int(chosen.sum(-1).max())
    pos = torch.arange(length, device=scores.device).expand(b, g, -1)
    order = torch.where(chosen, pos, pos + length).sort(-1).values[..., :width]
    holes = order >= length
    return order.masked_fill(holes, 0), holes


def pyramid_budgets(length: int, keep: int, layers: int, beta: float, floor: int
                    ) -> list[int]:
    """PyramidKV's per-block budgets (module docstring): ``layers`` integers summing to
    ``layers * keep``, non-increasing; all ``keep`` where the pyramid does not fit."""
    if layers <= 1:
        return [keep] * layers
    lo = keep / beta
    hi = 2 * keep - lo
    if hi >= length - floor:
        hi = length - floor
        lo = 2 * keep - hi
    if not length >= hi >= lo >= floor:
        return [keep] * layers
    real = [hi - i * (hi - lo) / (layers - 1) for i in range(layers)]
    out = [math.floor(r + 1e-9) for r in real]
    extra = layers * keep - sum(out)
    by_rest = sorted(range(layers), key=lambda i: (-(real[i] - out[i]), i))
    for i in by_rest[:extra]:
        out[i] += 1
    return out


def evict(config: Budgeted, cache, keep: int, scores: dict[int, torch.Tensor],
          protect: int = 0) -> dict:
    """Shrink the evictable blocks of ``cache`` under a budget wrapper (``keep``: the
    uniform budget of one block and head; the last ``protect`` tokens always kept).
    Records the blocks' holes in ``cache.prunelab_heads``. Returns ``{block: kept indices
    [B, G, P]}`` (AdaKV: hole slots hold 0, see ``cache.prunelab_heads``)."""
    scorer = config.base
    layers = kv.evictable_layers(cache)
    if not layers:
        return {}
    length = cache.layers[layers[0]].keys.shape[2]
    if isinstance(config, PyramidKV):
        budgets = pyramid_budgets(length - protect, keep - protect, len(layers), config.beta,
                                  config.floor)
        budgets = [k + protect for k in budgets]
    else:
        budgets = [keep] * len(layers)
    kept, heads = {}, {}
    for i, k in zip(layers, budgets, strict=True):
        layer = cache.layers[i]
        b, g, n, _ = layer.keys.shape
        if n <= k:
            heads[i] = None
            continue
        holes = None
        if isinstance(config, AdaKV) and i in scores:
            fixed = kv.fixed_positions(scorer, n, k, layer.keys.device, protect)
            idx, holes = adakv_keep(scores[i], k, fixed, config.alpha_safeguard)
            if not bool(holes.any()):
                holes = None
        else:
            idx = kv.keep_indices(scorer, n, k, scores.get(i), b, g, layer.keys.device, protect)
        kv.shrink_layer(layer, idx)
        heads[i], kept[i] = holes, idx
    if kept:
        cache.prunelab_heads = heads
    return kept


def kept_entries(cache) -> int:
    """Cached key entries that are not holes, over all blocks, heads and batch rows."""
    heads = getattr(cache, "prunelab_heads", None) or {}
    total = 0
    for i, layer in enumerate(cache.layers):
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.numel() == 0:
            continue
        total += keys.shape[0] * keys.shape[1] * keys.shape[2]
        if heads.get(i) is not None:
            total -= int(heads[i].sum())
    return total


def layer_mask(cache, layer: int, query: torch.Tensor, key: torch.Tensor, mask, impl: str):
    """The attention mask of block ``layer`` on a cache a budget wrapper shrank: causal in
    this block's own cache indices (query ``i`` of ``Q`` sees keys ``<= K - Q + i``) and
    blind to the block's holes, per query head: ``[B, H, Q, K]`` (bool for sdpa, additive
    float for eager). Any other block, or cache: ``mask`` unchanged."""
    heads = getattr(cache, "prunelab_heads", None)
    if not heads or layer not in heads:
        return mask
    b, h, q, _ = query.shape
    g, k = key.shape[1], key.shape[2]
    dev = key.device
    see = torch.arange(k, device=dev)[None, :] <= torch.arange(q, device=dev)[:, None] + (k - q)
    see = see[None, None].expand(b, 1, q, k)
    holes = heads[layer]
    if holes is not None:
        open_ = torch.ones(b, g, k, dtype=torch.bool, device=dev)
        open_[..., :holes.shape[-1]] = ~holes.to(dev)
        see = see & open_.repeat_interleave(h // g, dim=1)[:, :, None, :]
    if impl == "sdpa":
        return see
    return torch.zeros(see.shape, dtype=query.dtype, device=dev).masked_fill(
        ~see, torch.finfo(query.dtype).min)
