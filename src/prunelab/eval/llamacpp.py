"""The same windows scored inside llama.cpp (through ``llama-cpp-python``) and by prunelab's
own forward: next-token log-probabilities side by side, and the perplexity of each.

``llama-cpp-python`` is optional (``pip install 'prunelab[llamacpp]'``; it compiles
llama.cpp, see the README for the flags this machine kind needs). llama.cpp receives the
token ids themselves (no BOS added, no tokenizer in the loop), keeps the logits of every
position (``logits_all``), and is reset between windows, so both sides see exactly the same
causal contexts.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from prunelab.errors import ConfigError
from prunelab.models.gguf_llama import require_llama_cpp


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def llamacpp_logprobs(path: str | Path, windows: torch.Tensor,
                      threads: int | None = None) -> np.ndarray:
    """``[N, T, V]`` float64 log-probabilities llama.cpp computes for each of the ``N``
    windows of ``T`` token ids (row ``t``: the distribution of token ``t + 1``)."""
    n, t = windows.shape
    llm = _open(path, t, threads, logits_all=True)
    out = []
    try:
        for row in windows.tolist():
            llm.reset()
            llm.eval(row)
            out.append(_log_softmax(np.asarray(llm.scores[:t], dtype=np.float32)))
    finally:
        llm.close() if hasattr(llm, "close") else None
    return np.stack(out)


@torch.no_grad()
def prunelab_logprobs(lm, windows: torch.Tensor) -> np.ndarray:
    """``[N, T, V]`` float64 log-probabilities of prunelab's own forward of ``lm``."""
    out = []
    for row in windows:
        logits = lm.model(input_ids=row[None].to(lm.device), use_cache=False).logits[0]
        out.append(torch.log_softmax(logits.double(), -1).cpu().numpy())
    return np.stack(out)


def _open(path: str | Path, n_ctx: int, threads: int | None, logits_all: bool):
    """A ``llama_cpp.Llama`` on ``path`` (llama.cpp's load log silenced); a file llama.cpp
    cannot load is one :class:`ConfigError` line."""
    llama_cpp = require_llama_cpp()
    try:
        with llama_cpp.suppress_stdout_stderr(disable=False):
            return llama_cpp.Llama(model_path=str(path), n_ctx=max(n_ctx, 8),
                                   n_batch=max(n_ctx, 8), logits_all=logits_all,
                                   verbose=False, seed=0,
                                   n_threads=threads or max(1, (os.cpu_count() or 1)))
    except (ValueError, RuntimeError, OSError) as e:
        raise ConfigError(f"llama.cpp cannot load {Path(path).name}: {e}") from e


def llamacpp_perplexity(path: str | Path, windows: torch.Tensor,
                        threads: int | None = None) -> dict:
    """Perplexity of the GGUF file ``path`` inside llama.cpp over ``windows`` (``[N, T]``
    token ids, each scored on its own from an empty cache: every position predicts the
    next token, ``N x (T - 1)`` predictions), one window's logits at a time (memory
    ``T x vocab``, whatever ``N``). Returns the perplexity, the mean NLL, its standard
    error over windows and each window's mean NLL (for paired comparisons of two files
    scored on the same windows)."""
    llm = _open(path, windows.shape[1], threads, logits_all=True)
    t = windows.shape[1]
    per_window = []
    try:
        for row in windows.tolist():
            llm.reset()
            llm.eval(row)
            lp = _log_softmax(np.asarray(llm.scores[:t], dtype=np.float32))
            per_window.append(float(-lp[np.arange(t - 1), row[1:]].mean()))
    finally:
        llm.close() if hasattr(llm, "close") else None
    nll = np.array(per_window)
    sem = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else float("nan")
    return {"perplexity": float(math.exp(nll.mean())), "nll": float(nll.mean()),
            "nll_sem": sem, "nll_windows": [float(x) for x in nll],
            "windows": int(windows.shape[0]), "seqlen": int(t)}


def _perplexity(logprobs: np.ndarray, windows: torch.Tensor) -> float:
    ids = windows.numpy()
    nll = -np.take_along_axis(logprobs[:, :-1], ids[:, 1:, None], axis=-1)
    return float(math.exp(nll.mean()))


def compare_with_llamacpp(lm, path: str | Path, windows: torch.Tensor,
                          threads: int | None = None) -> dict:
    """Score ``windows`` (``[N, T]`` token ids) with ``lm`` and with the GGUF file ``path``
    inside llama.cpp: the largest and the mean absolute difference of the next-token
    log-probabilities over the whole vocabulary (llama.cpp keeps its KV cache in float16, so
    the far tail of improbable tokens differs most), the largest one of the tokens that
    follow (what the perplexity sums), both perplexities and their relative difference."""
    ours = prunelab_logprobs(lm, windows)
    theirs = llamacpp_logprobs(path, windows, threads)
    if ours.shape != theirs.shape:
        raise ConfigError(f"llama.cpp returned {theirs.shape} log-probabilities, prunelab "
                          f"{ours.shape}: not the same vocabulary")
    diff = np.abs(ours - theirs)
    ids = windows.numpy()[:, 1:, None]
    target = np.abs(np.take_along_axis(ours[:, :-1], ids, -1)
                    - np.take_along_axis(theirs[:, :-1], ids, -1))
    ppl, ppl_cpp = _perplexity(ours, windows), _perplexity(theirs, windows)
    return {"windows": int(windows.shape[0]), "seqlen": int(windows.shape[1]),
            "max_abs_logprob_diff": float(diff.max()),
            "mean_abs_logprob_diff": float(diff.mean()),
            "max_abs_target_logprob_diff": float(target.max()),
            "perplexity": ppl, "llamacpp_perplexity": ppl_cpp,
            "perplexity_rel_diff": abs(ppl_cpp - ppl) / ppl}


def llamacpp_speed(path: str | Path, prompt: list[int], gen: int = 128,
                   threads: int | None = None, repeats: int = 2) -> dict:
    """Tokens per second of the GGUF file ``path`` inside llama.cpp: prompt processing of
    ``prompt`` (one batch) and generation of ``gen`` tokens one at a time after it (the
    token ids are fixed, not sampled, so every model does the same work); the best of
    ``repeats`` runs of each."""
    n = len(prompt)
    llm = _open(path, n + gen + 8, threads, logits_all=False)
    best_pp = best_tg = 0.0
    try:
        for _ in range(repeats):
            llm.reset()
            t = time.perf_counter()
            llm.eval(prompt)
            best_pp = max(best_pp, n / (time.perf_counter() - t))
            t = time.perf_counter()
            for i in range(gen):
                llm.eval([prompt[i % n]])
            best_tg = max(best_tg, gen / (time.perf_counter() - t))
    finally:
        llm.close() if hasattr(llm, "close") else None
    return {"prompt_tokens": n, "prompt_tokens_per_s": best_pp, "gen_tokens": gen,
            "gen_tokens_per_s": best_tg, "threads": threads or os.cpu_count() or 1,
            "repeats": repeats}
