"""Needle windows: calibration windows that make an eviction fit see retrieval.

The end-to-end decay fit (:mod:`prunelab.inference.decay_kl`) minimises the continuation
KL of ordinary text, which no single cached token matters much to; a pass-key task turns on
one sentence far back in the prompt, and a press fitted on text alone may evict it (measured
on Gemma 3 270M at 4x compression: the lowest text KL of all presses, and the pass key lost
where SnapKV keeps it). A needle window is a calibration window whose prompt holds a key
sentence at a random depth of a corpus haystack and ends with a question, and whose
continuation opens with the answer: evicting the key raises the continuation KL there, so a
fit on text windows plus needle windows weighs retrieval as well as text.

The phrasing (a "secret code", five digits) differs on purpose from the benchmark's pass-key
task (``benchmarks/inference_pruning.py``: "The pass key is ..."), and the haystacks are
calibration text, so a press fitted with needles is tested on a task it was not fitted to
word for word. This is the "needle in a haystack" evaluation of Kamradt (2023) and the
pass-key task of Mohtashami & Jaggi (2023, "Landmark Attention") used as calibration data.
"""

from __future__ import annotations

import torch

from prunelab.errors import ConfigError

NEEDLE = "\nThe secret code is {key}. Keep it in mind: {key}.\n"
QUESTION = "\nWhat was the secret code? The secret code is"
ANSWER = " {key}."


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"],
                        dtype=torch.long)


def needle_windows(tokenizer, haystacks: torch.Tensor, horizon: int, seed: int = 0,
                   depths: tuple[float, float] = (0.1, 0.9)) -> tuple[torch.Tensor, list[dict]]:
    """``[N, T]`` needle windows of the same length as ``haystacks`` (``[N, T]`` corpus
    windows, framed as the tokenizer frames a sequence: a leading BOS stays first) and, per
    window, ``{"key", "depth", "needle_at", "question_at", "answer_at"}``.

    Each window: haystack tokens, the needle sentence inserted at a seeded random relative
    depth in ``depths`` of the prompt's haystack, the question ending the prompt (the first
    ``T - horizon`` tokens), then the answer (`` 12345.``) opening the last ``horizon``
    tokens, then haystack tokens to fill them. Keys are seeded five-digit numbers."""
    if haystacks.dim() != 2:
        raise ConfigError("needle_windows: haystacks must be [N, T] token ids")
    n, t = haystacks.shape
    lo, hi = depths
    if not 0.0 <= lo <= hi <= 1.0:
        raise ConfigError(f"needle_windows: depths must satisfy 0 <= low <= high <= 1, got "
                          f"{depths}")
    gen = torch.Generator().manual_seed(seed)
    question = _ids(tokenizer, QUESTION)
    rows, info = [], []
    for i in range(n):
        key = int(torch.randint(10000, 100000, (1,), generator=gen))
        depth = lo + (hi - lo) * float(torch.rand((), generator=gen))
        needle = _ids(tokenizer, NEEDLE.format(key=key))
        answer = _ids(tokenizer, ANSWER.format(key=key))
        prompt = t - horizon
        body = prompt - needle.numel() - question.numel()
        fill = horizon - answer.numel()
        if body < 2 or fill < 0:
            raise ConfigError(f"needle_windows: windows of {t} tokens with horizon {horizon} "
                              f"cannot hold the needle ({needle.numel()} tokens), the "
                              f"question ({question.numel()}) and the answer "
                              f"({answer.numel()})")
        hay = haystacks[i]
        at = max(1, min(body - 1, int(round(depth * body))))  # after a BOS, before the end
        row = torch.cat([hay[:at], needle, hay[at:body], question, answer,
                         hay[body:body + fill]])
        rows.append(row)
        info.append({"key": key, "depth": depth, "needle_at": at,
                     "question_at": prompt - question.numel(), "answer_at": prompt})
    return torch.stack(rows), info


def with_needles(tokenizer, text: torch.Tensor, needles: int, horizon: int,
                 seed: int = 0) -> torch.Tensor:
    """``text`` (``[N, T]`` calibration windows) followed by ``needles`` needle windows
    built on its first ``needles`` windows (so no extra corpus is read; with ``needles``
    above ``N`` the haystacks repeat, each with its own key and depth)."""
    if isinstance(needles, bool) or not isinstance(needles, int) or needles < 0:
        raise ConfigError(f"needles must be an integer >= 0, got {needles!r}")
    if needles == 0:
        return text
    hay = text[torch.arange(needles) % text.shape[0]]
    windows, _ = needle_windows(tokenizer, hay, horizon, seed=seed)
    return torch.cat([text, windows.to(text.dtype)], 0)
