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

import json
import math
import typing
from dataclasses import dataclass, field

import torch

from prunelab.errors import ConfigError
from prunelab.inference import kv
from prunelab.inference.base import check_press
from prunelab.inference.config import CACHE_BUDGET, PRESSES, Press, SnapKV
from prunelab.registry import check_range, strict_kwargs


def scorers() -> list[str]:
    """The registered presses a budget wrapper can redistribute: every KV press that
    defines its own ``score`` (a plugin's too), not a wrapper."""
    return [n for n in PRESSES.names() if getattr(PRESSES.get(n), "kind", None) == "kv"
            and PRESSES.get(n).score is not Press.score
            and not issubclass(PRESSES.get(n), Budgeted)]


def _scorer(name: str, ratio: float, items: tuple[str, ...],
            defaults: dict | None = None) -> Press:
    """The scoring press ``name`` at ``ratio`` with ``KEY=VALUE`` ``items`` (values read
    as JSON when they parse, else strings) over the wrapper's own ``defaults``."""
    if name not in scorers():
        raise ConfigError(f"scorer must be one of {', '.join(scorers())} (a KV press that "
                          f"scores), got {name!r}")
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
    check_press(scorer)
    if getattr(scorer, "every", 0):
        raise ConfigError(f"scorer {name!r}: every must be 0 (decode-time eviction keeps one "
                          "budget for every head and block)")
    return scorer


@dataclass(frozen=True)
class Budgeted(Press):
    """Base of the budget wrappers: ``scorer`` scores, the wrapper allocates."""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    scorer: str = field(default="snapkv", metadata={"help": (
        "adakv / pyramidkv: the press that scores the tokens, any KV press with a score "
        "(snapkv, h2o, tova, knorm, expected-attention, decay, streaming-llm or one you "
        "register); its budgets are redistributed")})
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

    @property
    def scoring(self) -> Press:
        return self._base

    def evict(self, cache, keep: int, scores: dict[int, torch.Tensor],
              protect: int = 0) -> dict:
        return evict(self, cache, keep, scores, protect)

    def layer_budgets(self, length: int, keep: int, layers: int) -> list[int]:
        """Tokens kept per head in each of ``layers`` evictable blocks of a ``length``-token
        prompt, ``keep`` each on average (default: ``keep`` in every block)."""
        return [keep] * layers

    def head_select(self, scores: torch.Tensor, keep: int, fixed: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A block's kept indices and holes ``[B, G, P]`` when its heads keep different
        counts (AdaKV); ``None``: every head keeps ``keep`` (its top scores)."""
        return None


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

    def head_select(self, scores: torch.Tensor, keep: int, fixed: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return adakv_keep(scores, keep, fixed, self.alpha_safeguard)


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

    def layer_budgets(self, length: int, keep: int, layers: int) -> list[int]:
        return pyramid_budgets(length, keep, layers, self.beta, self.floor)


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
    budgets = [k + protect for k in config.layer_budgets(length - protect, keep - protect,
                                                          len(layers))]
    kept, heads = {}, {}
    for i, k in zip(layers, budgets, strict=True):
        layer = cache.layers[i]
        b, g, n, _ = layer.keys.shape
        if n <= k:
            heads[i] = None
            continue
        chosen = None
        if i in scores:
            fixed = kv.fixed_positions(scorer, n, k, layer.keys.device, protect)
            chosen = config.head_select(scores[i], k, fixed)
        if chosen is None:
            idx, holes = kv.keep_indices(scorer, n, k, scores.get(i), b, g, layer.keys.device,
                                         protect), None
        else:
            idx, holes = chosen
            if not bool(holes.any()):
                holes = None
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
