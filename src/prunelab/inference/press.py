"""``press(lm, config)``: run a loaded model under an inference-time press.

Inside the context the model's weights are untouched; three things are swapped and put
back on exit (``try/finally``): the attention implementation name of its configs (a
registered wrapper around the same eager / sdpa function, which lets the press read the
queries and keys of every block), the base model's ``forward`` (which tracks the original
sequence length, passes explicit position ids and shrinks the cache after the prefill and
during decoding) and, for prefill presses, block hooks that shorten the sequence.

Positions: the cache stores rotated keys, so evicted entries take nothing else with them;
the position ids of new tokens continue from the original length (the number of tokens
seen), never from the shrunken cache length. The causal mask is built in cache-index space
(query offset = cache length), which is correct because kept entries stay in order.

A cache the press compressed remembers the tokens it has seen (``prunelab_seen``) and
refuses, with :class:`~prunelab.errors.PressedCacheError`, to be continued outside a press:
there the model would number the new tokens from the shrunken cache length (wrong RoPE
positions, silently). Continued inside any press (the same or a new ``with`` block), the
new tokens get the right positions.

Works with ``model.generate`` (batch of equal-length prompts; padding is refused) and with
prunelab's evaluator: a forward without a cache (``use_cache=False``) is run as the
prefill of its first :meth:`Session.split` tokens under the press (``context`` fraction or
all but the last ``continuation`` tokens), then the rest (the continuation) on the pressed
cache; for prefill presses the dropped prompt positions report their hidden state at the
pruning block (after the final norm).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.inference import budgets, kv
from prunelab.inference.base import PRESSES, Press, check_press, check_scores
from prunelab.inference.guard import (
    _STEPPING,
    PressedDynamicCache,  # noqa: F401 (re-exported)
    _mark_pressed,
    _PressedCache,
)
from prunelab.inference.prefill import TokenPruner
from prunelab.inference.scores import ScoreInputs, attention_rows
from prunelab.models.loading import LoadedModel, wrap
from prunelab.registry import check_range

_PREFIX = "prunelab_press_"
_SESSIONS: dict[int, Session] = {}
_BYPASS_BASE = {"opt"}
_NO_PREFILL = {"gpt2"}


def _wrapped(impl: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        session = _SESSIONS.get(id(module))
        if session is not None:
            session.on_attention(module, query, key, {**kwargs, "value": value})
            if session.phase is not None:  # a step on session.cache: its holes, if any
                attention_mask = budgets.layer_mask(session.cache, module.layer_idx, query,
                                                    key, attention_mask, impl)
        if impl == "eager":  # the model's own eager function (softcapping, sinks, ...)
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = AttentionInterface._global_mapping[impl]
        return fn(module, query, key, value, attention_mask, **kwargs)
    return attention


for _impl, _mask in (("eager", eager_mask), ("sdpa", sdpa_mask)):
    AttentionInterface.register(_PREFIX + _impl, _wrapped(_impl))
    AttentionMaskInterface.register(_PREFIX + _impl, _mask)


def active_session(lm) -> Session | None:
    """The press session active on ``lm`` (a ``LoadedModel``), or ``None``."""
    try:
        return _SESSIONS.get(id(lm.adapter.attention(0)))
    except (AttributeError, IndexError, TypeError):
        return None


class Session:
    """The state of one press on one model (returned by :func:`press`). ``report`` holds
    what the last prefill did (tokens kept, discarded mass per head, cache bytes)."""

    def __init__(self, lm, config: Press, context: float = 0.5,
                 continuation: int | None = None):
        self.lm, self.config, self.context = lm, config, context
        self.continuation = continuation
        self.base = lm.adapter.base
        self.groups = lm.adapter.head_geometry(0).num_kv_heads
        self.phase: str | None = None
        self.cache = None
        self.seen = self.steps = 0
        self.budget: int | None = None
        self.scores: dict[int, torch.Tensor] = {}
        self.report: dict = {}
        self.question = 0  # query-aware: the prompt's last tokens are the question
        self.pruner: TokenPruner | None = None
        self.rope: dict[int, tuple] = {}  # block -> the (cos, sin) of its last forward
        self._undo: list = []

    # ----------------------------------------------------------------- install
    def install(self) -> None:
        lm, cfg = self.lm, self.config
        check_press(cfg)
        if lm.adapter.is_encoder:
            raise UnsupportedOperationError("press: encoder models have no KV cache")
        if getattr(lm.model.config, "model_type", "") in _BYPASS_BASE:
            raise UnsupportedOperationError(
                f"press: {lm.model.config.model_type} is not supported (its causal-LM "
                "class calls the decoder directly, bypassing the base model's forward)")
        nblocks = lm.adapter.num_blocks
        if cfg.kind == "prefill":
            if cfg.layer >= nblocks:
                raise UnsupportedOperationError(
                    f"press: layer {cfg.layer} does not exist (0..{nblocks - 1})")
            if getattr(lm.model.config, "model_type", "") in _NO_PREFILL:
                raise UnsupportedOperationError(
                    f"press: prefill token pruning does not support "
                    f"{lm.model.config.model_type} (its base model reshapes the output to "
                    "the input length)")
            if any(t != "full_attention" for t in (lm.adapter.layer_types() or [])):
                raise UnsupportedOperationError(
                    "press: prefill token pruning needs full-attention blocks only")
        cfg.scoring.check(lm)
        if any(id(lm.adapter.attention(i)) in _SESSIONS for i in range(nblocks)):
            raise UnsupportedOperationError("press: a press is already active on this model")
        configs = {id(c): c for c in [lm.model.config] + [
            getattr(lm.adapter.attention(i), "config", lm.model.config)
            for i in range(nblocks)]}.values()
        for c in configs:
            impl = c._attn_implementation
            if impl not in ("eager", "sdpa"):
                raise UnsupportedOperationError(
                    f"press: attention implementation {impl!r} is not supported "
                    "(load with eager or sdpa)")
        try:
            for c in configs:
                old = c._attn_implementation
                c._attn_implementation = _PREFIX + old
                self._undo.append(lambda c=c, old=old: setattr(c, "_attn_implementation", old))
            for i in range(nblocks):
                key = id(lm.adapter.attention(i))
                _SESSIONS[key] = self
                self._undo.append(lambda key=key: _SESSIONS.pop(key, None))
            had = "forward" in self.base.__dict__
            old_forward = self.base.__dict__.get("forward")
            self._orig = self.base.forward
            self.base.forward = self._forward
            self._undo.append(lambda: setattr(self.base, "forward", old_forward) if had
                              else self.base.__dict__.pop("forward", None))
            if cfg.kind == "prefill":  # also at ratio 0: the hooks run and keep everything
                self.pruner = TokenPruner(self, cfg)
                self._undo.append(self.pruner.remove)
            for i in range(nblocks):  # the rotary (cos, sin) of each block, for the scores
                hook = lm.adapter.attention(i).register_forward_pre_hook(
                    lambda mod, args, kw, i=i: self._keep_rope(i, kw), with_kwargs=True)
                self._undo.append(hook.remove)
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.cache = None
        self.scores = {}
        self.rope = {}

    @property
    def scorer(self) -> Press:
        """The press scoring the prompt (a budget wrapper's scorer; query-aware: the press
        for the question, e.g. SnapKV's window is the question)."""
        scorer = self.config.scoring
        return scorer.for_question(self.question) if self.question else scorer

    def _keep_rope(self, layer: int, kwargs: dict) -> None:
        if self.phase is not None:
            self.rope[layer] = kwargs.get("position_embeddings")

    # ----------------------------------------------------------------- attention
    def on_attention(self, module, query, key, kwargs) -> None:
        """One block's queries ``[B, H, Q, D]`` and keys ``[B, G, L, D]`` (after RoPE, the
        cache included); ``kwargs``: the attention call's, with its ``value``."""
        cfg, layer = self.config, module.layer_idx
        if self.phase is None:
            return
        scaling = kwargs.get("scaling") or module.scaling
        softcap = kwargs.get("softcap")
        if self.phase == "prefill" and self.pruner is not None:
            if self.pruner.wants(layer):
                self.pruner.probs[layer] = attention_rows(query, key, scaling,
                                                          self.pruner.rows, softcap)
            return
        if cfg.kind != "kv" or cfg.is_noop or \
                (self.phase == "decode" and not getattr(cfg, "every", 0)):
            return
        inputs = ScoreInputs(query, key, kwargs["value"], scaling, softcap, layer, module,
                             self.rope.pop(layer, None))
        if self.phase == "prefill":
            sc = self.scorer
            self.scores[layer] = check_scores(sc, sc.score(inputs), inputs)
        else:  # decode-time eviction: the press' scores of the cached tokens, kept up
            new = cfg.rescore(inputs, self.scores.get(layer))
            if new is not None:
                self.scores[layer] = check_scores(cfg, new, inputs)

    # ----------------------------------------------------------------- forward
    def _forward(self, *args, **kw):
        if args:
            kw["input_ids"] = args[0]
        if "past_key_values" in kw:
            kw["cache"] = kw.pop("past_key_values")
        cache = kw.get("cache")
        use_cache = kw.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.base.config, "use_cache", True)
        if cache is None and not use_cache:
            return self._evaluate(kw)
        if cache is None:
            cache = kw["cache"] = DynamicCache(config=self.base.config)
        return self._step(kw, cache)

    def split(self, t: int) -> int:
        """Prompt tokens of a ``t``-token evaluator window: the first ``split(t)`` tokens are
        prefilled under the press, the other ``t - split(t)`` (the continuation) are scored
        on the pressed cache."""
        if self.continuation is not None:
            if self.continuation >= t:
                raise ConfigError(f"continuation {self.continuation} does not fit a window of "
                                  f"{t} tokens (it needs at least 1 prompt token before it)")
            return t - self.continuation
        return max(1, int(t * self.context))

    def _new_sequence(self, cache) -> None:
        # a cache a press compressed knows its token count; one filled outside any press is
        # uncompressed: its length is the token count
        seen = cache.prunelab_seen if isinstance(cache, _PressedCache) \
            else cache.get_seq_length()
        self.cache, self.seen, self.steps, self.budget = cache, seen, 0, None
        if seen == 0:  # a cache reused for a new sequence: no holes from the last one
            cache.__dict__.pop("prunelab_heads", None)
        self.scores = {}
        if self.pruner is not None:
            self.pruner.reset()

    def _step(self, kw: dict, cache):
        x = kw.get("input_ids")
        x = kw.get("inputs_embeds") if x is None else x
        b, s = x.shape[0], x.shape[1]
        if cache is not self.cache or cache.get_seq_length() == 0:
            self._new_sequence(cache)
        mask = kw.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            if not bool(mask.all()):
                raise UnsupportedOperationError(
                    "press: padded batches are not supported; give prompts of equal length")
            kw["attention_mask"] = None
        # positions continue from the tokens seen, never from the (shrunken) cache length;
        # padding is refused, so this is also what generate passes
        pos = torch.arange(self.seen, self.seen + s, device=x.device)
        kw["position_ids"] = pos[None].expand(b, -1)
        self.phase = "prefill" if self.seen == 0 else "decode"
        _STEPPING.add(id(cache))
        try:
            out = self._orig(**kw)
            self.seen += s
            if self.phase == "prefill":
                self._after_prefill(cache, s)
            else:
                self._after_decode(cache)
        finally:
            self.phase = None
            _STEPPING.discard(id(cache))
        if isinstance(cache, _PressedCache):
            cache.prunelab_seen = self.seen
        return out

    def _after_prefill(self, cache, length: int) -> None:
        cfg = self.config
        if cfg.kind == "kv":
            q = self.question
            self.budget = kv.budget(cfg, length - q) + q
            evictor = cfg.for_question(q) if q else cfg
            kept = evictor.evict(cache, self.budget, self.scores, q)
            if not getattr(cfg, "every", 0):  # decode-time eviction goes on from them
                self.scores = {}
            self.report = {"prompt": length, "kept": min(self.budget, length),
                           "keep": kept, "entries": budgets.kept_entries(cache)}
            if kept:
                _mark_pressed(cache, self.seen)
        elif self.pruner is not None:
            self.pruner.trim_cache(cache)
            kept = length if self.pruner.keep is None else self.pruner.keep.shape[1]
            self.report = {"prompt": length, "kept": kept, "keep": self.pruner.keep,
                           **self.pruner.info}
            if kept < length:
                _mark_pressed(cache, self.seen)
        else:
            self.report = {"prompt": length, "kept": length}
        self.report["cache_bytes"] = kv.cache_bytes(cache)

    def _after_decode(self, cache) -> None:
        cfg = self.config
        self.steps += 1
        every = getattr(cfg, "every", 0)
        if cfg.is_noop or not every or self.steps % every or self.budget is None:
            return  # budget None: a cache this session did not prefill (nothing to keep to)
        if cfg.kind == "kv" and cfg.evict(cache, self.budget, self.scores):
            _mark_pressed(cache, self.seen)  # a prompt too short to shrink may shrink now

    def _evaluate(self, kw: dict):
        """A cache-less forward (the evaluator): prefill the first ``context`` fraction
        under the press, then the rest on the pressed cache; ``[B, T, H]`` states."""
        ids = kw.get("input_ids")
        if ids is None or self.config.is_noop:
            return self._orig(**kw)
        t = ids.shape[1]
        c = self.split(t)
        if c >= t:
            return self._orig(**kw)
        cache = DynamicCache(config=self.base.config)
        first = self._step(dict(input_ids=ids[:, :c], cache=cache, use_cache=True), cache)
        prefix = first.last_hidden_state
        if prefix.shape[1] != c:  # prefill pruning: dropped positions exit early
            norm = self.lm.adapter.final_norm()
            exit_h = self.pruner.exit_hidden
            full = (norm(exit_h) if norm is not None else exit_h).clone()
            idx = self.pruner.keep[..., None].expand(-1, -1, full.shape[-1])
            prefix = full.scatter(1, idx, prefix)
        rest = self._step(dict(input_ids=ids[:, c:], cache=cache, use_cache=True), cache)
        if self.pruner is not None:
            self.pruner.reset()
        hidden = torch.cat([prefix, rest.last_hidden_state], dim=1)
        return BaseModelOutputWithPast(last_hidden_state=hidden)


@contextmanager
def press(lm, config: Press | str, context: float | None = None,
          continuation: int | None = None, **options):
    """Run ``lm`` (a prunelab ``LoadedModel`` or a Hugging Face causal LM) under
    ``config`` (a press config or its registered name with ``options``) inside a ``with``
    block; yields the :class:`Session` (its ``report`` describes the last prefill). The
    model is restored exactly on exit. A cache the press compressed can be continued in a
    later press only (:class:`~prunelab.errors.PressedCacheError` outside one).

    For cache-less forwards (the evaluator) each window is split into a pressed prompt and
    a continuation scored on the pressed cache: ``context`` is the prompt's fraction of the
    window (default 0.5), or ``continuation`` the number of tokens at the end of each
    window (give one of the two)."""
    if not isinstance(lm, LoadedModel):
        lm = wrap(lm)
    config = PRESSES.make(config, **options)
    check_press(config)
    if context is not None and continuation is not None:
        raise ConfigError("give the press' context or its continuation, not both")
    if continuation is not None:
        check_range("continuation", continuation, 1, None, integer=True)
    context = 0.5 if context is None else context
    check_range("context", context, 0.0, 1.0)
    if context == 0:
        raise ConfigError("context must be > 0: a pressed prompt of no tokens presses nothing")
    session = Session(lm, config, context, continuation)
    session.install()
    try:
        yield session
    finally:
        session.uninstall()
