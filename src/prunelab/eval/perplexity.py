"""Perplexity, KL to a reference model and top-1 agreement on token windows.

Protocol: the test text is cut into non-overlapping windows of ``seqlen`` tokens
(stride = seqlen, see :mod:`prunelab.data.batches`); each window is scored on its own
(no context carried over), the loss of predicting tokens ``1..T-1`` from their prefixes is
summed over all windows, and ``perplexity = exp(total_nll / scored_tokens)`` with
``scored_tokens = windows * (seqlen - 1)``.

KL(p_ref || p_model) and top-1 agreement are averaged over all ``seqlen`` positions of
every window. Logits are computed one window at a time from the base model's hidden
states (so a batch never materialises ``[B, T, V]`` float logits at once); maths in float32.
"""

from __future__ import annotations

import math
import time

import torch

from prunelab.eval.divergence import kl_from_logits, nll_sum, top1_agreement
from prunelab.log import progress


@torch.no_grad()
def final_hidden(lm, ids: torch.Tensor) -> torch.Tensor:
    """Base-model output (after the final norm) for ``ids`` ``[B, T]``."""
    base = lm.adapter.base
    return base(input_ids=ids.to(lm.device), use_cache=False).last_hidden_state


@torch.no_grad()
def score_windows(lm, input_ids: torch.Tensor, batch_size: int = 4, reference=None,
                  desc: str = "eval", reference_cache: dict | None = None) -> dict:
    """Perplexity of ``lm`` on ``input_ids`` ``[N, T]``; KL and top-1 agreement to
    ``reference`` (another loaded model with the same tokenizer) when given.

    ``reference_cache``: a dict that keeps the reference's final hidden states per batch,
    so that evaluating many models against one reference runs the reference once."""
    input_ids = torch.as_tensor(input_ids)
    n, t = input_ids.shape
    nll = 0.0
    kl_sum = agree_sum = 0.0
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
            nll += float(nll_sum(logits, ids[row:row + 1]))
            if ref_hidden is not None:
                ref_logits = reference.adapter.logits(ref_hidden[row:row + 1]).to(logits.device)
                kl_sum += float(kl_from_logits(ref_logits, logits).double().sum())
                agree_sum += float(top1_agreement(ref_logits, logits).double().sum())
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
    return out
