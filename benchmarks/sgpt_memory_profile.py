"""Where SparseGPT's memory goes: resident memory by phase on the first blocks of a model.

Loads ``--model`` (default the embedded ``qwen2.5-coder-1.5b``, float32) streamed from its
shards (``--resident`` loads it whole), keeps only its first ``--blocks`` blocks (the
shapes of a block, hence the memory of one, are those of the whole run) and prunes them
with SparseGPT at ``--sparsity`` on ``--samples`` x ``--seqlen`` tokens of
``wiki-vital:calib`` (seed 0). A thread samples ``/proc/self/status`` every
``--interval`` seconds (``RssAnon`` + ``RssFile``) and charges each sample to the phase
the main thread is in (innermost first):

``capture`` (block-0 inputs: embeddings read), ``load`` / ``free`` (a block read from or
written to the shards), ``stage g`` (the statistics of group ``g`` of a block: q/k/v, o,
gate/up, down; ``stage 4`` is the final pass), ``gram`` (``X^T X`` made symmetric),
``factor`` (damping, Cholesky, inverse factor), ``sweep`` (the rest of
``sparsegpt_prune``), ``substitute`` (o_proj / down_proj applied to the saved inputs).

Printed: per phase the calls, the peak RSS and the peak anonymous RSS in MiB, then
``VmHWM``. Run (about 3 min on one thread for 2 blocks of the 1.5B)::

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sgpt_memory_profile.py \
        [--blocks 2] [--samples 8 --seqlen 512] [--resident] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import threading
import time
import warnings
from pathlib import Path

MiB = 2**20


def _status() -> dict[str, int]:
    """``RssAnon``, ``RssFile`` and ``VmHWM`` of this process in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class PhaseRSS:
    """Samples RSS in a thread; :meth:`phase` names what the main thread is doing."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.stack: list[str] = ["setup"]
        self.peaks: dict[str, list[int]] = {}  # phase -> [peak rss, peak anon]
        self.calls: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        s = _status()
        rss, anon = s["RssAnon"] + s["RssFile"], s["RssAnon"]
        peak = self.peaks.setdefault(self.stack[-1], [0, 0])
        peak[0], peak[1] = max(peak[0], rss), max(peak[1], anon)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sample()
        self.stack.append(name)
        self.calls[name] = self.calls.get(name, 0) + 1
        try:
            yield
        finally:
            self._sample()
            self.stack.pop()

    def wrap(self, owner, attr: str, label) -> None:
        """Replace ``owner.attr`` (a function or method) by one that runs in a phase;
        ``label(*args)`` names it."""
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self.phase(label(*args) if callable(label) else label):
                return fn(*args, **kwargs)
        setattr(owner, attr, wrapped)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def live_tensors(min_mib: float = 8.0) -> list[tuple[str, float]]:
    """``(shape / dtype, MiB)`` of the live tensors (one per storage) of at least
    ``min_mib``, largest first: what holds the memory at a given moment."""
    import gc

    import torch

    seen: dict[int, tuple[str, float]] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        objects = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    for t in objects:
        if not t.is_meta:
            st = t.untyped_storage()
            mib = st.nbytes() / MiB
            if mib >= min_mib and st.data_ptr() not in seen:
                kind = "param" if isinstance(t, torch.nn.Parameter) else "tensor"
                seen[st.data_ptr()] = (f"{kind} {tuple(t.shape)} {t.dtype}", mib)
    return sorted(seen.values(), key=lambda v: -v[1])


def _census_at(owner, attr: str, label: str, out: list) -> None:
    """Before each call of ``owner.attr``: the live tensors, appended to ``out``."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out.append((label, live_tensors()))
        return fn(*args, **kwargs)
    setattr(owner, attr, wrapped)


def _instrument(prof: PhaseRSS) -> None:
    """Phases around the runner, the streamer and SparseGPT's steps."""
    from prunelab.calib import stats
    from prunelab.calib.runner import BlockRunner
    from prunelab.calib.sequential import SequentialBlock
    from prunelab.models.streaming import Streamer
    from prunelab.pruning.sparsity import sparsegpt as sg
    from prunelab.pruning.sparsity.methods import sparsegpt as sg_method

    prof.wrap(BlockRunner, "capture", "capture")
    prof.wrap(Streamer, "acquire", "load")
    prof.wrap(Streamer, "release", "free")
    prof.wrap(SequentialBlock, "_stage", lambda _self, g, *_a: f"stage {g}")
    prof.wrap(SequentialBlock, "_substitute", "substitute")
    prof.wrap(sg_method, "sparsegpt_prune", "sweep")
    for name in ("_dead_and_factor", "sparsegpt_factor"):
        if hasattr(sg, name):
            prof.wrap(sg, name, "factor")
    if hasattr(stats.Gram, "take"):
        prof.wrap(stats.Gram, "take", "gram")
    xtx = stats.Gram.xtx

    def read(self):
        with prof.phase("gram"):
            return xtx.fget(self)
    stats.Gram.xtx = property(read)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--interval", type=float, default=0.002)
    p.add_argument("--resident", action="store_true", help="load the model whole")
    p.add_argument("--census", action="store_true",
                   help="list the live tensors of >= 8 MiB at every Cholesky and triangular "
                        "solve and at the start of every stage")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    import torch

    import prunelab
    from prunelab.api import tokens_for
    from prunelab.models.memory import release_free_memory
    from prunelab.pruning.base import METHODS

    torch.set_num_threads(args.threads)
    prunelab.log.set_quiet(True)
    lm = prunelab.load(args.model, dtype="float32", stream=not args.resident)
    blocks = lm.adapter.blocks()
    del blocks[args.blocks:]
    calib = tokens_for(lm, "wiki-vital:calib", seqlen=args.seqlen, samples=args.samples,
                       seed=0, mode="calib")
    calib = dataclasses.replace(calib, input_ids=calib.input_ids.clone().contiguous())
    release_free_memory()
    base = _status()
    prof = PhaseRSS(args.interval)
    _instrument(prof)
    census: list = []
    if args.census:
        from prunelab import linalg
        from prunelab.calib.sequential import SequentialBlock

        _census_at(linalg, "cholesky_ex", "cholesky", census)
        _census_at(linalg, "solve_triangular", "solve", census)
        _census_at(SequentialBlock, "_stage", "stage", census)
    cfg = METHODS.make("sparsegpt", sparsity=args.sparsity)
    t0 = time.perf_counter()
    with prof:
        prunelab.prune(lm, cfg, calib, batch_size=8)
    seconds = time.perf_counter() - t0
    end = _status()
    _report(prof, base, end, seconds, args)
    for label, tensors in census:
        print(f"{label}: {sum(m for _, m in tensors):,.0f} MiB in "
              + ", ".join(f"{what} {m:,.0f}" for what, m in tensors))


def _report(prof: PhaseRSS, base: dict, end: dict, seconds: float, args) -> None:
    print(f"{args.model}, first {args.blocks} blocks, {args.samples} x {args.seqlen} tokens, "
          f"{'resident' if args.resident else 'streamed'}, {args.threads} thread(s): "
          f"{seconds:.1f} s")
    print(f"baseline before prune: RSS {(base['RssAnon'] + base['RssFile']) / MiB:,.0f} MiB "
          f"(anon {base['RssAnon'] / MiB:,.0f})")
    print(f"{'phase':<12} {'calls':>5} {'peak RSS MiB':>12} {'peak anon MiB':>13}")
    for name, (rss, anon) in sorted(prof.peaks.items(), key=lambda kv: -kv[1][0]):
        print(f"{name:<12} {prof.calls.get(name, 0):>5} {rss / MiB:>12,.0f} {anon / MiB:>13,.0f}")
    print(f"VmHWM {end['VmHWM'] / MiB:,.0f} MiB")
    if args.json:
        args.json.write_text(json.dumps({
            "settings": {k: str(v) for k, v in vars(args).items()}, "seconds": seconds,
            "baseline": base, "end": end, "calls": prof.calls,
            "peaks": {k: {"rss": v[0], "anon": v[1]} for k, v in prof.peaks.items()}},
            indent=2))


if __name__ == "__main__":
    main()
