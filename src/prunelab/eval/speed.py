"""Prefill and decode speed, and peak memory.

Prefill: a forward of ``[batch, prompt_len]`` tokens building the KV cache (median of
``repeats`` after one warm-up). Decode: ``decode_tokens`` greedy steps of one token each
with the cache, after a prefill. Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA;
on CPU the peak resident set size of the process, sampled every 2 ms during the runs.
"""

from __future__ import annotations

import statistics
import threading
import time

import psutil
import torch


class PeakRSS:
    """Context manager sampling the process RSS; ``.peak`` in bytes."""

    def __init__(self, interval: float = 0.002):
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_speed(lm, prompt_len: int = 256, decode_tokens: int = 32, batch: int = 1,
                  repeats: int = 3, seed: int = 0) -> dict:
    """Prefill and decode tokens/s and peak memory of a causal LM on random tokens."""
    model, device = lm.model, lm.device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab, (batch, prompt_len), generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as rss:
        model(input_ids=ids, use_cache=True)  # warm-up
        times = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            _sync(device)
            times.append(time.perf_counter() - t0)
        cache = out.cache
        token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            step = model(input_ids=token, cache=cache, use_cache=True)
            cache = step.cache
            token = step.logits[:, -1:].argmax(-1)
        _sync(device)
        decode_time = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss.peak
    return {
        "prefill_tokens_per_s": batch * prompt_len / statistics.median(times),
        "decode_tokens_per_s": batch * decode_tokens / decode_time,
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": "cuda_allocated" if device.type == "cuda" else "process_rss",
        "speed_prompt_len": prompt_len,
        "speed_decode_tokens": decode_tokens,
        "speed_batch": batch,
    }


#: a ratio whose range over the rounds is wider than this fraction of its median is
#: flagged: too noisy to rank models by
NOISY_SPREAD = 0.2


def speed_against(lm, reference, rounds: int = 3, **kw) -> dict:
    """:func:`measure_speed` of ``lm`` interleaved with ``reference`` (the dense model):
    ``rounds`` rounds, each measuring the reference then ``lm`` moments apart, so a busy
    machine slows both sides of a ratio. Returns ``lm``'s median figures plus, for prefill
    and decode, the median ratio to the reference (``prefill_x_dense``), its range over the
    rounds (``..._min`` / ``..._max``), ``..._noisy`` when that range is wider than
    :data:`NOISY_SPREAD` of its median (the figure cannot rank close models), and
    ``speed_noisy`` when either is."""
    ours, theirs = [], []
    for _ in range(rounds):
        theirs.append(measure_speed(reference, **kw))
        ours.append(measure_speed(lm, **kw))
    out = dict(ours[-1])
    noisy = False
    for key, short in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
        out[key] = statistics.median(r[key] for r in ours)
        ratios = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)]
        med = statistics.median(ratios)
        out[f"{short}_x_dense"] = med
        out[f"{short}_x_dense_min"], out[f"{short}_x_dense_max"] = min(ratios), max(ratios)
        out[f"{short}_x_dense_noisy"] = max(ratios) - min(ratios) > NOISY_SPREAD * med
        noisy |= out[f"{short}_x_dense_noisy"]
    out["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in ours)
    out["speed_rounds"] = rounds
    out["speed_noisy"] = noisy
    return out
