"""A context and a question: where the question goes when the context is compressed.

Three modes for a prompt made of a context (``[B, C]`` tokens) followed by a question
(``[B, Q]``), answered greedily on the pressed cache:

* ``prompt`` (prunelab's default, what ``generate`` does with one prompt): context and
  question are one prompt, prefilled and compressed together by the press as it is (SnapKV's
  observation window is the prompt's last ``window`` tokens; question tokens may be
  evicted like any other).
* ``after`` (kvpress' pipeline, ``KVPressTextGenerationPipeline``: query-agnostic): the
  context alone is prefilled and compressed, then the question is appended on the
  compressed cache (never evicted) and the answer generated; the press cannot know the
  question.
* ``aware`` (query-aware compression): context and question are prefilled together, the
  question is the observation window that scores the context (SnapKV: ``window = Q``; TOVA:
  the last question token; H2O: every query, the question's included; KNorm and
  expected-attention score as they do anyway), the question's tokens are always kept, and
  the budget is that of the context: ``C - floor(C * ratio) + Q`` entries per head. kvpress
  gets this by putting the question inside the context (its ``query_aware`` evaluation
  setting); here the question is also protected from eviction.

Budget wrappers (AdaKV, PyramidKV) apply to the scorer of the same modes. Prefill presses
(``kind = "prefill"``) run in ``prompt`` and ``after`` modes only.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.inference.base import PRESSES, Press
from prunelab.inference.needles import needle_windows
from prunelab.inference.press import active_session, press
from prunelab.models.loading import LoadedModel, wrap

MODES = ("prompt", "after", "aware")


def check_mode(config: Press | None, mode: str) -> None:
    """One-line errors for a mode that does not apply to ``config`` (``None``: no press)."""
    if mode not in MODES:
        raise ConfigError(f"question mode must be one of {', '.join(MODES)}, got {mode!r}")
    if config is None or mode != "aware":
        return
    if config.kind != "kv":
        raise UnsupportedOperationError(
            f"query-aware compression needs a KV-cache press; {config.registry_name} prunes "
            "inside the prefill (use question mode prompt or after)")
    config.scoring.for_question(1)  # a press that cannot take a question says so here


def answer(lm, context: torch.Tensor, question: torch.Tensor, max_new_tokens: int,
           mode: str = "prompt", config: Press | str | None = None,
           eos: int | None = None) -> tuple[torch.Tensor, dict]:
    """Greedy answer ``[B, N]`` (``N <= max_new_tokens``; stops once every row has produced
    ``eos``) to ``question`` ``[B, Q]`` after ``context`` ``[B, C]`` in ``mode``, and the
    press' report of the compression (``{}`` without a press). The press is ``config``, or
    the one active on ``lm`` (``with press(lm, ...)``), or none (the plain model)."""
    if not isinstance(lm, LoadedModel):
        lm = wrap(lm)
    if context.dim() != 2 or question.dim() != 2 or context.shape[0] != question.shape[0]:
        raise ConfigError("answer: context and question must be [B, C] and [B, Q] token ids")
    if question.shape[1] < 1 or context.shape[1] < 1:
        raise ConfigError("answer: the context and the question need at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if config is not None:
        cfg = PRESSES.make(config) if isinstance(config, str) else config
        check_mode(cfg, mode)
        with press(lm, cfg):
            return answer(lm, context, question, max_new_tokens, mode, eos=eos)
    session = active_session(lm)
    check_mode(None if session is None else session.config, mode)
    ids = torch.cat([context, question], 1).to(lm.device)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        if session is None or mode == "prompt":
            out = lm.model(input_ids=ids, cache=cache, use_cache=True,
                           logits_to_keep=1)
        elif mode == "aware":
            session.question = question.shape[1]
            try:
                out = lm.model(input_ids=ids, cache=cache, use_cache=True,
                               logits_to_keep=1)
            finally:
                session.question = 0
        else:
            c = context.shape[1]
            lm.model(input_ids=ids[:, :c], cache=cache, use_cache=True,
                     logits_to_keep=1)
        report = {} if session is None else dict(session.report)
        if session is not None and mode == "after":  # the question on the pressed cache
            out = lm.model(input_ids=ids[:, c:], cache=cache, use_cache=True,
                           logits_to_keep=1)
        report["question"] = question.shape[1]
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        new, done = [nxt], nxt[:, 0] == eos if eos is not None else None
        for _ in range(max_new_tokens - 1):
            if done is not None and bool(done.all()):
                break
            out = lm.model(input_ids=nxt, cache=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            new.append(nxt)
            if done is not None:
                done = done | (nxt[:, 0] == eos)
    return torch.cat(new, 1), report


def needle_retrieval(lm, config: Press | str | None, haystacks: torch.Tensor,
                     mode: str = "prompt", horizon: int = 16, seed: int = 0,
                     new_tokens: int = 8) -> dict:
    """The pass-key task of :mod:`prunelab.inference.needles` answered under ``config`` in
    ``mode``: each haystack ``[N, T]`` gets a seeded key sentence at a random depth and
    ends with the question (its prompt is the first ``T - horizon`` tokens); the context
    is the prompt up to the question, and the answer the first ``new_tokens`` greedy
    tokens. ``{"accuracy", "mode", "windows": [{"key", "depth", "answer", "hit"}]}``,
    a hit when the key's digits appear in the decoded answer."""
    if not isinstance(lm, LoadedModel):
        lm = wrap(lm)
    windows, info = needle_windows(lm.tokenizer, haystacks, horizon, seed=seed)
    rows = []
    for row, meta in zip(windows, info, strict=True):
        q0, a0 = meta["question_at"], meta["answer_at"]
        out, _ = answer(lm, row[None, :q0], row[None, q0:a0], new_tokens, mode, config)
        text = lm.tokenizer.decode(out[0], skip_special_tokens=True)
        rows.append({"key": meta["key"], "depth": meta["depth"], "answer": text,
                     "hit": str(meta["key"]) in text})
    hits = sum(r["hit"] for r in rows)
    return {"accuracy": hits / max(len(rows), 1), "mode": mode, "windows": rows}
