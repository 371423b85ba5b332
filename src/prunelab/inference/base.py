"""The press hook: :class:`Press`, the base of every press config, and the registry
:data:`PRESSES`. The press machinery (:func:`prunelab.inference.press`, the eviction of
:mod:`prunelab.inference.kv`, the budget wrappers, the prefill pruner) asks a press only
through these methods; it knows no press by its class, so a press registered by a plugin
runs exactly as a built-in one (the built-ins are in :mod:`prunelab.inference.config`,
:mod:`~prunelab.inference.decay`, :mod:`~prunelab.inference.expected` and
:mod:`~prunelab.inference.budgets`).

The design is kvpress' (NVIDIA, ``ScorerPress.score(module, hidden_states, keys, values,
attentions, kwargs)``): a KV press is a score over the cached keys and values, and the
eviction (top ``keep`` per KV head) is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prunelab.errors import UnsupportedOperationError
from prunelab.inference import kv
from prunelab.inference.scores import ScoreInputs
from prunelab.registry import Registry, check_range

PRESSES = Registry("press")

KINDS = ("kv", "prefill")
#: the ``ratio`` of a press is what ``--budget remove-cache:F`` sets
CACHE_BUDGET = {"help": "fraction of the prompt's tokens removed from the cache",
                "budget": "remove-cache"}


@dataclass(frozen=True)
class Press:
    """Base of every press config: its hooks are the only way the press machinery
    (:func:`prunelab.inference.press`) asks a press anything; it knows no press by class.

    A KV press (``kind = "kv"``, a ``ratio`` field) is a score over the cached tokens,
    as kvpress' ``ScorerPress``: :meth:`score` gives every cached token of a block a
    number, and after the prefill each KV head keeps the ``L - floor(L * ratio)`` highest,
    the tokens :meth:`protected` names counted first. A prefill press (``kind =
    "prefill"``, a ``layer`` field) picks the tokens to keep at block ``layer`` with
    :meth:`select` from the attention of its :attr:`observers`. A press that defines
    neither is refused when it starts (:func:`check_press`)."""

    kind: ClassVar[str] = "kv"

    def __post_init__(self) -> None:
        ratio = getattr(self, "ratio", None)
        if ratio is not None:
            check_range("ratio", ratio, 0.0, 0.99)

    @property
    def is_noop(self) -> bool:
        return getattr(self, "ratio", 1.0) == 0.0

    # ------------------------------------------------------------------ KV presses
    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        """Token scores ``[B, G, L]`` of one block's cached tokens (higher: kept), from
        one attention call (:class:`~prunelab.inference.scores.ScoreInputs`): at the
        prefill, those the eviction ranks. Every KV press defines it."""
        raise NotImplementedError(f"{type(self).__name__} defines no score()")

    def protected(self, length: int, keep: int) -> tuple[int, int]:
        """``(first, last)``: how many of the first and of the last of ``length`` tokens
        are always kept when ``keep`` are (they count in ``keep``). Default: none."""
        return 0, 0

    def rescore(self, inputs: ScoreInputs, previous: torch.Tensor | None
                ) -> torch.Tensor | None:
        """Decode-time eviction (a press with ``every > 0``): the scores ``[B, G, T]`` of
        the cached tokens after this decode step, ``previous`` the scores kept so far
        (``None``: leave them). Default: :meth:`score` of this step afresh."""
        return self.score(inputs)

    def evict(self, cache, keep: int, scores: dict[int, torch.Tensor],
              protect: int = 0) -> dict:
        """Shrink the evictable blocks of ``cache`` to ``keep`` tokens per KV head from
        the blocks' ``scores``; the last ``protect`` tokens are always kept. Returns
        ``{block: kept indices [B, G, keep]}``. A budget wrapper redistributes instead."""
        return kv.evict(self, cache, keep, scores, protect)

    @property
    def scoring(self) -> Press:
        """The press whose :meth:`score` ranks the tokens (a budget wrapper's scorer)."""
        return self

    def for_question(self, question: int) -> Press:
        """The press scoring a prompt whose last ``question`` tokens are a question
        (query-aware mode); a press that cannot raises :class:`ConfigError`."""
        return self

    def check(self, lm) -> None:
        """Refuse, in one line, a model this press cannot run on (called at start)."""

    # ------------------------------------------------------------ prefill presses
    @property
    def observers(self) -> int:
        """Prefill presses: the last prompt tokens whose attention :meth:`select` reads."""
        return 1

    def select(self, probs: torch.Tensor, groups: int) -> tuple[torch.Tensor, dict]:
        """Prefill presses: the sorted token indices ``[B, K]`` kept at block ``layer``
        and what to report, from the attention ``probs`` ``[B, H, observers, L]`` of the
        last prompt tokens (``groups``: the KV heads)."""
        raise NotImplementedError(f"{type(self).__name__} defines no select()")


def _defines(config: Press, hook: str) -> bool:
    return getattr(type(config), hook) is not getattr(Press, hook)


def check_press(config: Press) -> None:
    """Refuse at start, in one line naming the press and its class, a press the machinery
    cannot run: a kind other than ``kv`` / ``prefill``, a KV press whose scorer defines
    no :meth:`Press.score` or that has no ``ratio``, a prefill press without
    :meth:`Press.select` or a ``layer``."""
    name = getattr(config, "registry_name", None) or type(config).__name__
    where = f"press {name!r} ({type(config).__module__}.{type(config).__qualname__})"
    kind = getattr(config, "kind", None)
    if kind not in KINDS:
        raise UnsupportedOperationError(f"{where}: kind must be one of {', '.join(KINDS)}, "
                                        f"got {kind!r}")
    if kind == "kv":
        scorer = config.scoring
        if not _defines(scorer, "score"):
            raise UnsupportedOperationError(
                f"{where} cannot score: a KV press defines score(self, inputs) returning "
                "[B, G, L] token scores (docs/inference.md, 'Writing a press')")
        ratio = getattr(config, "ratio", None)
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise UnsupportedOperationError(
                f"{where} has no ratio: a KV press has a float field ratio (the fraction "
                "of the prompt removed, set by --budget remove-cache:F)")
        return
    if not _defines(config, "select"):
        raise UnsupportedOperationError(
            f"{where} cannot select: a prefill press defines select(self, probs, groups) "
            "returning the kept token indices (docs/inference.md, 'Writing a press')")
    layer = getattr(config, "layer", None)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise UnsupportedOperationError(f"{where} has no layer: a prefill press has an int "
                                        "field layer (the 0-based block where it prunes)")


def check_scores(config: Press, scores, inputs: ScoreInputs) -> torch.Tensor:
    """``scores`` if a ``[B, G, L]`` tensor of ``inputs``' cached tokens, else one line
    naming the press and what it returned."""
    want = (inputs.key.shape[0], inputs.key.shape[1], inputs.key.shape[2])
    if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != want:
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        name = getattr(config, "registry_name", None) or type(config).__name__
        raise UnsupportedOperationError(
            f"press {name!r}: score() returned {got}, expected a tensor [B, G, L] = "
            f"{list(want)} (batch, KV heads, cached tokens) for block {inputs.layer}")
    return scores


def check_kept(config: Press, keep, batch: int, length: int) -> torch.Tensor:
    """``keep`` if the sorted, distinct token indices ``[B, K]`` of a ``length``-token
    prompt that a prefill press' :meth:`Press.select` must return, the last token among
    them (its hidden state gives the next token); else one line naming the press."""
    name = getattr(config, "registry_name", None) or type(config).__name__
    ok = isinstance(keep, torch.Tensor) and keep.dim() == 2 and keep.shape[0] == batch \
        and 1 <= keep.shape[1] <= length and not keep.is_floating_point()
    if ok:
        ok = bool((keep[:, 1:] > keep[:, :-1]).all()) and int(keep.min()) >= 0 \
            and bool((keep[:, -1] == length - 1).all())
    if not ok:
        got = tuple(keep.shape) if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise UnsupportedOperationError(
            f"press {name!r}: select() returned {got}; it must return sorted, distinct "
            f"integer token indices [B, K] = [{batch}, 1..{length}] that keep the last "
            f"prompt token ({length - 1})")
    return keep
