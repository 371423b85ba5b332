"""The continuation protocol of the KV-cache press comparison, run identically on both sides.

Imported by ``worker_press.py`` (prunelab's environment) and ``worker_kvpress.py``
(kvpress' venv): torch and transformers only, no prunelab, no kvpress.

Per window ``ids`` ``[1, T]`` with a continuation of ``C`` tokens (``T - C`` prompt tokens):

- dense: one forward of the whole window, no cache; ``ref = logits[T - C : T]`` ``[C, V]``;
- pressed: ``prefill(ids[:, :T - C])`` fills a ``DynamicCache`` under the press (the
  side's own context manager), then ``ids[:, T - C:]`` runs on the compressed cache with
  position ids ``T - C .. T - 1`` (their true positions, whatever the cache's length);
  ``out = logits`` of that forward ``[C, V]``; the kept length is the cache's length per
  layer right after the prefill.

Scored as prunelab's evaluator scores a continuation (``prunelab.eval.perplexity``):
perplexity = ``exp`` of the mean NLL of the ``C - 1`` tokens the continuation positions
predict inside the window (position ``T - C + j`` predicts token ``T - C + j + 1``); KL(dense ||
pressed) (float32 log-softmax, as ``kl_from_logits``) and top-1 agreement averaged over the
``C`` positions. Sums are returned so windows add up; :func:`finish` turns them into means.
"""

from __future__ import annotations

import math
import time


def _logits(model, **kw):
    return model(**kw).logits[0].float()


def dense_reference(model, ids, continuation: int):
    """``[C, V]`` float32 logits of the last ``C`` positions of the dense forward."""
    import torch

    with torch.no_grad():
        return _logits(model, input_ids=ids, use_cache=False)[-continuation:]


def pressed_window(model, ids, continuation: int, press_ctx, explicit_positions: bool):
    """Prefill under ``press_ctx`` (a context manager factory, or None for no press), then
    the continuation on the compressed cache. Returns ``(logits [C, V], kept per layer,
    seconds)``; ``seconds`` covers the prefill, the eviction and the continuation forward.

    ``explicit_positions``: pass ``position_ids`` / ``cache_position`` for the
    continuation (kvpress leaves them to the caller); prunelab's press numbers the new
    tokens itself and needs the continuation run inside its context."""
    import contextlib

    import torch
    from transformers import DynamicCache

    t = ids.shape[1]
    split = t - continuation
    cache = DynamicCache(config=model.config)
    ctx = press_ctx() if press_ctx is not None else contextlib.nullcontext()
    with torch.no_grad():
        t0, c0 = time.perf_counter(), time.process_time()
        with ctx:
            model(input_ids=ids[:, :split], past_key_values=cache, use_cache=True)
            kept = [cache.get_seq_length(i) for i in range(len(cache.layers))]
            if explicit_positions:
                pos = torch.arange(split, t)[None]
                cache_pos = torch.arange(kept[0], kept[0] + continuation)
                out = _logits(model, input_ids=ids[:, split:], past_key_values=cache,
                              use_cache=True, position_ids=pos, cache_position=cache_pos)
            else:
                out = _logits(model, input_ids=ids[:, split:], past_key_values=cache,
                              use_cache=True)
        seconds = (time.perf_counter() - t0, time.process_time() - c0)
    return out, kept, seconds


def window_sums(ref, out, ids, continuation: int) -> dict:
    """NLL, KL and top-1 sums of one window (see the module docstring)."""
    import torch

    cont = ids[0, -continuation:]
    logp = torch.log_softmax(out, dim=-1)
    logp_ref = torch.log_softmax(ref, dim=-1)
    nll = -logp[:-1].gather(-1, cont[1:, None]).sum()
    nll_ref = -logp_ref[:-1].gather(-1, cont[1:, None]).sum()
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
    agree = (ref.argmax(-1) == out.argmax(-1)).double()
    return {"nll": float(nll), "nll_dense": float(nll_ref), "kl": float(kl.double().sum()),
            "agree": float(agree.sum()), "positions": continuation,
            "tokens": continuation - 1}


def finish(sums: list[dict]) -> dict:
    """Means over windows: continuation perplexity (pressed and dense), KL, top-1."""
    tokens = sum(s["tokens"] for s in sums)
    positions = sum(s["positions"] for s in sums)
    return {"continuation_perplexity": math.exp(sum(s["nll"] for s in sums) / tokens),
            "dense_continuation_perplexity":
                math.exp(sum(s["nll_dense"] for s in sums) / tokens),
            "continuation_kl": sum(s["kl"] for s in sums) / positions,
            "continuation_top1": sum(s["agree"] for s in sums) / positions,
            "windows": len(sums), "tokens": tokens}


def run_presses(model, ids, continuation: int, jobs: list[tuple[str, float, object]],
                explicit_positions: bool, peak_rss_cls, rss_fn) -> list[dict]:
    """Every ``(press name, ratio, context factory)`` of ``jobs`` over all windows of
    ``ids`` ``[N, T]`` (torch int64). Dense references are computed once first; each
    press' wall time sums its windows' pressed runs, its peak RSS is over the RSS just
    before its windows. ``cpu_seconds``: the process' CPU time over the same runs (the
    fair figure on a shared core, where wall time also counts other processes' turns)."""
    import torch

    refs = [dense_reference(model, ids[i:i + 1], continuation) for i in range(len(ids))]
    rows = []
    for name, ratio, factory in jobs:
        sums, kept_all, seconds, cpu = [], [], 0.0, 0.0
        base = rss_fn()
        with peak_rss_cls() as peak:
            for i in range(len(ids)):
                w = ids[i:i + 1]
                out, kept, dt = pressed_window(model, w, continuation, factory,
                                               explicit_positions)
                seconds += dt[0]
                cpu += dt[1]
                kept_all.append(sum(kept) / len(kept))
                sums.append(window_sums(refs[i], out, w, continuation))
                del out
        row = {"press": name, "ratio": ratio, **finish(sums), "seconds": seconds,
               "cpu_seconds": cpu,
               "kept": sum(kept_all) / len(kept_all), "prompt": ids.shape[1] - continuation,
               "extra_peak": peak.peak - base, "peak_rss": peak.peak}
        rows.append(row)
    torch.set_grad_enabled(True)
    return rows
