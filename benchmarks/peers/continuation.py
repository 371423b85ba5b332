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

Retrieval (:func:`needle_answer`): a pass-key prompt (a key sentence at some depth of a
haystack, then the question) is prefilled under the press and the answer decoded greedily,
one token at a time on the compressed cache (``new_tokens`` tokens, positions continuing
from the prompt's length); the driver decodes the tokens and checks for the key.
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


def pressed_window(model, ids, continuation: int, press_ctx, explicit_positions: bool,
                   stepwise: bool = False):
    """Prefill under ``press_ctx`` (a context manager factory, or None for no press), then
    the continuation on the compressed cache. Returns ``(logits [C, V], kept per layer,
    seconds)``; ``seconds`` covers the prefill, the eviction and the continuation forward.

    ``explicit_positions``: pass ``position_ids`` / ``cache_position`` for the
    continuation (kvpress leaves them to the caller); prunelab's press numbers the new
    tokens itself and needs the continuation run inside its context.

    ``stepwise``: the continuation one token per forward (the same logits in exact
    arithmetic): for a cache whose blocks have different lengths, where one mask built from
    block 0's length does not fit the others (kvpress' PyramidKV under ``sdpa``)."""
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
            if stepwise:
                rows = []
                for j in range(split, t):
                    kw = {}
                    if explicit_positions:
                        length = cache.get_seq_length()
                        kw = {"position_ids": torch.tensor([[j]]),
                              "cache_position": torch.tensor([length])}
                    rows.append(_logits(model, input_ids=ids[:, j:j + 1],
                                        past_key_values=cache, use_cache=True, **kw))
                out = torch.cat(rows, 0)
            elif explicit_positions:
                pos = torch.arange(split, t)[None]
                cache_pos = torch.arange(kept[0], kept[0] + continuation)
                out = _logits(model, input_ids=ids[:, split:], past_key_values=cache,
                              use_cache=True, position_ids=pos, cache_position=cache_pos)
            else:
                out = _logits(model, input_ids=ids[:, split:], past_key_values=cache,
                              use_cache=True)
        seconds = (time.perf_counter() - t0, time.process_time() - c0)
    return out, kept, seconds


def needle_answer(model, prompt, press_ctx, explicit_positions: bool,
                  new_tokens: int = 8) -> list[int]:
    """Greedy answer (``new_tokens`` token ids) to the pass-key ``prompt`` ``[1, P]``
    prefilled under ``press_ctx`` (None: the dense model), decoded on its cache."""
    import contextlib

    import torch
    from transformers import DynamicCache

    p = prompt.shape[1]
    cache = DynamicCache(config=model.config)
    ctx = press_ctx() if press_ctx is not None else contextlib.nullcontext()
    out: list[int] = []
    with torch.no_grad(), ctx:
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits
        for step in range(new_tokens):
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            if step == new_tokens - 1:
                break
            x = torch.tensor([[tok]])
            if explicit_positions:
                length = cache.get_seq_length()
                logits = model(input_ids=x, past_key_values=cache, use_cache=True,
                               position_ids=torch.tensor([[p + step]]),
                               cache_position=torch.tensor([length])).logits
            else:
                logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits
    return out


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
                explicit_positions: bool, peak_rss_cls, rss_fn,
                needles: list | None = None, new_tokens: int = 8,
                needle_ratios: tuple | None = None, stepwise: tuple = ()) -> list[dict]:
    """Every ``(press name, ratio, context factory)`` of ``jobs`` over all windows of
    ``ids`` ``[N, T]`` (torch int64). Dense references are computed once first; each
    press' wall time sums its windows' pressed runs, its peak RSS is over the RSS just
    before its windows. ``cpu_seconds``: the process' CPU time over the same runs (the
    fair figure on a shared core, where wall time also counts other processes' turns).

    ``needles``: pass-key prompts (``[1, P_i]`` each); every press then also answers each
    (``needle_tokens``, after its timed windows, outside the time and the peak), and the
    first row ``{"press": "dense"}`` holds the dense model's answers; ``needle_ratios``:
    only at these ratios (None: all). ``stepwise``: press names whose continuation runs one
    token per forward (see :func:`pressed_window`). A press that raises gets a row with its
    ``error`` (the other presses still run)."""
    import torch

    refs = [dense_reference(model, ids[i:i + 1], continuation) for i in range(len(ids))]
    rows = []
    if needles:
        rows.append({"press": "dense", "ratio": 0.0, "needle_tokens": [
            needle_answer(model, p, None, explicit_positions, new_tokens) for p in needles]})
    for name, ratio, factory in jobs:
        try:
            row = _press_row(model, ids, continuation, name, ratio, factory,
                             explicit_positions, peak_rss_cls, rss_fn, refs,
                             name in stepwise)
            if needles and (needle_ratios is None or ratio in needle_ratios):
                row["needle_tokens"] = [needle_answer(model, p, factory, explicit_positions,
                                                      new_tokens) for p in needles]
        except Exception as exc:  # one press' failure is a row, not the end of the side
            row = {"press": name, "ratio": ratio,
                   "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        rows.append(row)
    torch.set_grad_enabled(True)
    return rows


def _press_row(model, ids, continuation, name, ratio, factory, explicit_positions,
               peak_rss_cls, rss_fn, refs, stepwise: bool) -> dict:
    """One press over every window: the scored row (time, peak, kept)."""
    sums, kept_all, seconds, cpu = [], [], 0.0, 0.0
    base = rss_fn()
    with peak_rss_cls() as peak:
        for i in range(len(ids)):
            w = ids[i:i + 1]
            out, kept, dt = pressed_window(model, w, continuation, factory,
                                           explicit_positions, stepwise)
            seconds += dt[0]
            cpu += dt[1]
            kept_all.append(sum(kept) / len(kept))
            sums.append(window_sums(refs[i], out, w, continuation))
            del out
    row = {"press": name, "ratio": ratio, **finish(sums), "seconds": seconds,
           "cpu_seconds": cpu,
           "kept": sum(kept_all) / len(kept_all), "prompt": ids.shape[1] - continuation,
           "extra_peak": peak.peak - base, "peak_rss": peak.peak, "stepwise": stepwise}
    return row
