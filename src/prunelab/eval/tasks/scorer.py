"""Log-likelihood of continuations given a context, and the multiple-choice metrics.

Protocol (the one of lm-evaluation-harness' ``HFLM.loglikelihood``, so that the numbers
compare): a request is ``(context, continuation)``; trailing whitespace of the context
moves to the continuation; the context is tokenized alone, the continuation's tokens are
those of ``tokenize(context + continuation)`` after the context's length; an empty context
is replaced by the BOS (else EOS) token; a request longer than the model's positions + 1 is
cut on the left (the caller warns how many items were cut); a continuation longer than the
positions by itself is refused. The score is the sum of ``log p(token | prefix)`` over the
continuation's tokens, and ``is_greedy`` says whether every continuation token is the argmax.

Batching: the choices of one item usually share their context, so the context runs once
(one forward, its KV cache repeated for each choice) and the continuations run together as
one right-padded batch over that cache (padding masked); continuations of a single token
need no second forward at all. Items whose choices have different contexts (WinoGrande) run
as one right-padded batch of ``context + continuation`` rows. Maths in float32.

Metrics (lm-eval's ``multiple_choice`` task): ``acc`` = argmax of the summed log-likelihood
is the gold choice; ``acc_norm`` = argmax of log-likelihood divided by the choice's length in
characters; standard errors = sample standard deviation / sqrt(n) (lm-eval's
``mean_stderr``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from prunelab.errors import ConfigError
from prunelab.models.vocab import check_token_ids


@dataclass(frozen=True)
class Item:
    """One task item: its ``(context, continuation)`` requests (one per choice; a single
    request for a loglikelihood task such as LAMBADA), the gold choice index and the
    choice lengths in characters that ``acc_norm`` divides by."""

    id: str
    requests: tuple[tuple[str, str], ...]
    gold: int = 0
    norm_lengths: tuple[int, ...] = field(default=())

    def lengths(self) -> tuple[int, ...]:
        if self.norm_lengths:
            return self.norm_lengths
        return tuple(len(cont.lstrip(" ")) for _, cont in self.requests)


def _encode(tok, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation token ids exactly as lm-eval's causal ``_encode_pair``."""
    if context == "":
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        cont = _encode(tok, continuation)
        return [prefix], (cont[1:] if cont and cont[0] == prefix else cont)
    n = len(context) - len(context.rstrip())
    if n > 0:
        continuation = context[-n:] + continuation
        context = context[:-n]
    whole = _encode(tok, context + continuation)
    ctx = _encode(tok, context)
    return ctx, whole[len(ctx):]


def _max_positions(lm) -> int:
    cfg = lm.model.config
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 2048


def _truncate(ctx: list[int], cont: list[int], limit: int) -> list[int]:
    """Left-cut the context so that ``ctx + cont[:-1]`` fits in ``limit`` positions."""
    keep = max(limit + 1 - len(cont), 1)
    return ctx[-keep:]


def _forward(lm, ids: torch.Tensor, mask: torch.Tensor | None = None, cache=None):
    check_token_ids(lm, ids, "a task item")
    kw = {"input_ids": ids.to(lm.device), "use_cache": True}
    if mask is not None:
        kw["attention_mask"] = mask.to(lm.device)
    if cache is not None:
        kw["cache"] = cache
    out = lm.adapter.base(**kw)
    return out.last_hidden_state, getattr(out, "cache", None) or getattr(
        out, "past_key_values", None)


def _logprobs(lm, hidden: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(lm.adapter.logits(hidden).float(), dim=-1)


def _pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


def _sum_logprob(logp: torch.Tensor, targets: list[int]) -> tuple[float, bool]:
    """``logp`` ``[len(targets), V]``: summed log-probability and greedy flag."""
    t = torch.tensor(targets, dtype=torch.long, device=logp.device)
    ll = float(logp.gather(1, t[:, None]).double().sum())
    return ll, bool((logp.argmax(-1) == t).all())


@torch.no_grad()
def score_shared(lm, ctx: list[int], conts: list[list[int]]) -> list[tuple[float, bool]]:
    """Requests with one context: the context runs once; its cache serves every
    continuation (right-padded batch of ``cont[:-1]``)."""
    hidden, cache = _forward(lm, torch.tensor([ctx]))
    first = _logprobs(lm, hidden[0, -1:])  # predicts each continuation's first token
    rest = max(len(c) for c in conts) - 1
    later = None
    if rest > 0:
        if cache is None:
            return score_rows(lm, [ctx] * len(conts), conts)
        cache.batch_repeat_interleave(len(conts))
        ids, mask = _pad([c[:-1] or [0] for c in conts])
        mask[:, 0] = torch.tensor([1 if len(c) > 1 else 0 for c in conts])
        full = torch.cat([torch.ones(len(conts), len(ctx), dtype=torch.long), mask], 1)
        later, _ = _forward(lm, ids, full, cache)
    out = []
    for i, c in enumerate(conts):
        rows = [first[0]]
        if len(c) > 1:
            rows.append(_logprobs(lm, later[i, :len(c) - 1]))
        out.append(_sum_logprob(torch.cat([r.reshape(-1, first.shape[-1]) for r in rows]), c))
    return out


@torch.no_grad()
def score_rows(lm, ctxs: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
    """Requests with different contexts: one right-padded batch of ``ctx + cont[:-1]``."""
    ids, mask = _pad([c + k[:-1] for c, k in zip(ctxs, conts, strict=True)])
    hidden, _ = _forward(lm, ids, mask)
    out = []
    for i, (c, k) in enumerate(zip(ctxs, conts, strict=True)):
        start = len(c) - 1
        out.append(_sum_logprob(_logprobs(lm, hidden[i, start:start + len(k)]), k))
    return out


def check_item(lm, item: Item) -> list[tuple[list[int], list[int]]]:
    """The token pairs of ``item``'s requests; a continuation with no tokens, or longer than
    the model's positions by itself (no left cut can make it fit), is a one-line
    ``ConfigError``."""
    limit = _max_positions(lm)
    pairs = [encode_pair(lm.tokenizer, c, k) for c, k in item.requests]
    conts = [k for _, k in pairs]
    if any(len(k) == 0 for k in conts):
        raise ConfigError(f"item {item.id}: a continuation has no tokens")
    longest = max(len(k) for k in conts)
    if longest > limit:
        raise ConfigError(
            f"item {item.id}: a continuation of {longest} tokens is beyond the {limit} "
            f"positions of {lm.spec}; shorten the choice")
    return pairs


def score_item(lm, item: Item, share_prefix: bool = True,
               cut: list | None = None) -> list[tuple[float, bool]]:
    """``(loglikelihood, is_greedy)`` of each request of ``item``. A context too long for
    the model's positions is cut on the left (lm-eval's protocol; the item's id is appended
    to ``cut``); a continuation that alone exceeds them is a one-line ``ConfigError``."""
    limit = _max_positions(lm)
    pairs = check_item(lm, item)
    conts = [k for _, k in pairs]
    ctxs = [_truncate(c, k, limit) for c, k in pairs]
    if cut is not None and any(len(a) < len(c) for a, (c, _) in zip(ctxs, pairs, strict=True)):
        cut.append(item.id)
    if share_prefix and all(c == ctxs[0] for c in ctxs):
        return score_shared(lm, ctxs[0], conts)
    return score_rows(lm, ctxs, conts)


def mean_stderr(values: list[float]) -> float | None:
    """Sample standard deviation / sqrt(n) (lm-eval's ``mean_stderr``); None for n < 2."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1)) / math.sqrt(n)


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # first max, as numpy


def mc_metrics(items: list[Item], scores: list[list[tuple[float, bool]]]) -> dict:
    """``acc``, ``acc_norm`` and their standard errors over ``items``, plus ``n``."""
    acc, acc_norm = [], []
    for item, sc in zip(items, scores, strict=True):
        lls = [ll for ll, _ in sc]
        acc.append(float(_argmax(lls) == item.gold))
        norm = [ll / max(n, 1) for ll, n in zip(lls, item.lengths(), strict=True)]
        acc_norm.append(float(_argmax(norm) == item.gold))
    n = len(items)
    return {"acc": sum(acc) / n if n else None, "acc_stderr": mean_stderr(acc),
            "acc_norm": sum(acc_norm) / n if n else None,
            "acc_norm_stderr": mean_stderr(acc_norm), "n": n}


def loglikelihood_metrics(items: list[Item], scores: list[list[tuple[float, bool]]]) -> dict:
    """LAMBADA-style: ``acc`` (every target token greedy) and ``perplexity`` =
    exp(-mean log-likelihood of the target), as lm-eval's ``lambada_openai``."""
    greedy = [float(sc[0][1]) for sc in scores]
    lls = [sc[0][0] for sc in scores]
    n = len(items)
    return {"acc": sum(greedy) / n if n else None, "acc_stderr": mean_stderr(greedy),
            "perplexity": math.exp(-sum(lls) / n) if n else None, "n": n}
