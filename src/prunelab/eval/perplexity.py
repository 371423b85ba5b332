"""Perplexity, KL to a reference model and top-1 agreement on token windows.

Protocol: the test text is cut into non-overlapping windows of ``seqlen`` tokens
(stride = seqlen, see :mod:`prunelab.data.batches`); each window is scored on its own
(no context carried over), the loss of predicting tokens ``1..T-1`` from their prefixes is
summed over all windows, and ``perplexity = exp(total_nll / scored_tokens)`` with
``scored_tokens = windows * (seqlen - 1)``.

KL(p_ref || p_model) and top-1 agreement are averaged over all ``seqlen`` positions of
every window. Logits are computed one window at a time from the base model's hidden
states (so a batch never materialises ``[B, T, V]`` float logits at once); maths in float32.

With ``continuation = C`` the last ``C`` positions of each window (``T - C .. T - 1``: under
an inference-time press, those run on the pressed cache) are also scored on their own:
``continuation_kl_to_reference`` and ``continuation_top1_agreement`` average over those
``C`` positions, ``continuation_perplexity`` is ``exp`` of the mean NLL of the
``C - 1`` tokens they predict inside the window (``T - C + 1 .. T - 1``).
"""

from __future__ import annotations

import math
import time

import torch

from prunelab.errors import ConfigError
from prunelab.eval.divergence import kl_from_logits, token_nll, top1_agreement
from prunelab.log import progress


@torch.no_grad()
def final_hidden(lm, ids: torch.Tensor) -> torch.Tensor:
    """Base-model output (after the final norm) for ``ids`` ``[B, T]``."""
    base = lm.adapter.base
    return base(input_ids=ids.to(lm.device), use_cache=False).last_hidden_state


@torch.no_grad()
def score_windows(lm, input_ids: torch.Tensor, batch_size: int = 4, reference=None,
                  desc: str = "eval", reference_cache: dict | None = None,
                  continuation: int | None = None) -> dict:
    """Perplexity of ``lm`` on ``input_ids`` ``[N, T]``; KL and top-1 agreement to
    ``reference`` (another loaded model with the same tokenizer) when given.

    ``reference_cache``: a dict that keeps the reference's final hidden states per batch,
    so that evaluating many models against one reference runs the reference once.
    ``continuation``: also score the last ``continuation`` positions of each window on
    their own (``continuation_*`` keys; see the module docstring)."""
    input_ids = torch.as_tensor(input_ids)
    n, t = input_ids.shape
    if continuation is not None:
        check_continuation(continuation, t)
    c0 = t - (continuation or 0)
    nll = cont_nll = 0.0
    kl_sum = agree_sum = cont_kl = cont_agree = 0.0
    start = time.perf_counter()
    batches = input_ids.split(batch_size)
    for ids in progress(batches, total=len(batches), desc=desc):
        hidden = final_hidden(lm, ids)
        ref_hidden = None
        if reference is not None:
            key = (len(ids), hash(ids.numpy().tobytes()))
            if reference_cache is not None and key in reference_cache:
                ref_hidden = reference_cache[key].to(lm.device)
            else:
                ref_hidden = final_hidden(reference, ids)
                if reference_cache is not None:
                    reference_cache[key] = ref_hidden.to("cpu")
        for row in range(ids.shape[0]):
            logits = lm.adapter.logits(hidden[row:row + 1])
            tok = token_nll(logits, ids[row:row + 1])  # [1, T-1]: position j predicts j+1
            nll += float(tok.sum())
            cont_nll += float(tok[:, c0:].sum())
            if ref_hidden is not None:
                ref_logits = reference.adapter.logits(ref_hidden[row:row + 1]).to(logits.device)
                kl = kl_from_logits(ref_logits, logits).double()
                agree = top1_agreement(ref_logits, logits).double()
                kl_sum += float(kl.sum())
                agree_sum += float(agree.sum())
                cont_kl += float(kl[:, c0:].sum())
                cont_agree += float(agree[:, c0:].sum())
    elapsed = time.perf_counter() - start
    scored = n * (t - 1)
    out = {
        "perplexity": math.exp(nll / scored),
        "nll": nll / scored,
        "tokens": scored,
        "seqlen": t,
        "samples": n,
        "eval_seconds": elapsed,
        "eval_tokens_per_s": n * t / elapsed if elapsed > 0 else float("inf"),
    }
    if reference is not None:
        out["kl_to_reference"] = kl_sum / (n * t)
        out["top1_agreement"] = agree_sum / (n * t)
    if continuation is not None:
        scored = n * (continuation - 1)
        out.update(continuation=continuation, continuation_tokens=scored,
                   continuation_nll=cont_nll / scored,
                   continuation_perplexity=math.exp(cont_nll / scored))
        if reference is not None:
            out["continuation_kl_to_reference"] = cont_kl / (n * continuation)
            out["continuation_top1_agreement"] = cont_agree / (n * continuation)
    return out


def check_continuation(continuation: int, t: int) -> None:
    """A continuation of ``continuation`` positions must leave at least one prompt token of
    a ``t``-token window and predict at least one token inside it (so ``>= 2``)."""
    if isinstance(continuation, bool) or not isinstance(continuation, int) \
            or not 2 <= continuation <= t - 1:
        raise ConfigError(f"continuation {continuation!r} does not fit a window of {t} "
                          f"tokens: it takes 2 to {t - 1} tokens (at least 1 prompt token "
                          "before it, and 1 token it predicts)")
