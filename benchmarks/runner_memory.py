"""Peak memory of the block-by-block runner versus the model's own bytes.

Runs ``BlockRunner(lm, ids, batch_size).run()`` over all blocks of the embedded model
(``smollm2-135m``, float32, CPU) three ways: keeping no states, keeping every block
boundary in memory (``StateStore("memory")``) and on disk (``StateStore("disk")``).

Process RSS includes the loaded model, so every figure is an increase over the RSS after
loading (the baseline). The weights load as a file-backed mmap of the cached checkpoint
and only become resident when read, so they are read once before the baseline is taken.
Reported per store: baseline and peak RSS during the run (:class:`prunelab.eval.speed.
PeakRSS`, sampled every 2 ms), the extra peak over the baseline, its ratio to the model's
bytes and to the expected activation bytes (``samples * seqlen * hidden * 4`` for one
boundary; 2 boundaries, input + output, for a plain run; all ``blocks + 1`` with the
memory store), the wall time and the block evaluations. Each store runs in a fresh
process (this script, spawned) so memory that one run freed but the allocator kept does
not inflate the next.

Run::

    python benchmarks/runner_memory.py [--samples 32 --seqlen 512 --batch-size 8]
                                       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

MODES = ("none", "memory", "disk")
MiB = 2**20


def measure(mode: str, model: str, data: str, samples: int, seqlen: int,
            batch_size: int) -> dict:
    """Load the model in this (fresh) process, then run the blocks once under ``mode``."""
    import gc
    import time

    import psutil
    import torch
    import transformers

    import prunelab
    from prunelab.calib.runner import BlockRunner, StateStore
    from prunelab.data import make_batches
    from prunelab.eval.speed import PeakRSS
    from prunelab.models.size import model_size

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # set_quiet does not cover HF's bars
    prunelab.log.set_quiet(True)
    lm = prunelab.load(model)
    ids = make_batches(lm.tokenizer, data, seqlen=seqlen, samples=samples).input_ids
    size = model_size(lm.model)
    hidden = lm.adapter.hidden_size()
    blocks = lm.adapter.num_blocks
    with torch.no_grad():  # page in the mmapped weights so the baseline holds them
        for t in list(lm.model.parameters()) + list(lm.model.buffers()):
            t.sum()
    gc.collect()
    baseline = psutil.Process().memory_info().rss

    states = StateStore(mode) if mode != "none" else None
    runner = BlockRunner(lm, ids, batch_size=batch_size)
    try:
        with torch.no_grad(), PeakRSS() as rss:
            t0 = time.perf_counter()
            runner.run(states=states)
            seconds = time.perf_counter() - t0
        kept = len(states.boundaries()) if states is not None else 0
    finally:
        if states is not None:
            states.close()
    boundary = samples * seqlen * hidden * 4
    n_bound = blocks + 1 if mode == "memory" else 2
    extra = rss.peak - baseline
    return {
        "mode": mode, "model_params": size["params"], "model_bytes": size["bytes"],
        "baseline_rss": baseline, "peak_rss": rss.peak, "extra_peak": extra,
        "extra_over_model": extra / size["bytes"], "boundary_bytes": boundary,
        "expected_boundaries": n_bound, "expected_bytes": n_bound * boundary,
        "extra_over_expected": extra / (n_bound * boundary), "boundaries_kept": kept,
        "seconds": seconds, "block_evals": runner.block_evals, "blocks": blocks,
        "batches": len(runner.batches), "hidden": hidden, "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-vital:test")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    results = {}
    ctx = multiprocessing.get_context("spawn")
    for mode in args.modes:
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
            results[mode] = pool.submit(measure, mode, args.model, args.data, args.samples,
                                        args.seqlen, args.batch_size).result()

    first = results[args.modes[0]]
    print(f"model {args.model}: {first['model_params']:,} params, "
          f"{first['model_bytes'] / MiB:.1f} MiB; {first['blocks']} blocks, hidden "
          f"{first['hidden']}; data {args.data}, samples {args.samples}, seqlen "
          f"{args.seqlen}, batch {args.batch_size} ({first['batches']} batches); "
          f"threads {first['threads']}")
    print(f"one boundary = samples*seqlen*hidden*4 = {first['boundary_bytes'] / MiB:.1f} MiB. "
          "RSS includes the loaded model: 'extra' = peak RSS - RSS after loading,")
    print("measured in a fresh process per store.")
    rows = [
        ("RSS after load MiB", lambda r: f"{r['baseline_rss'] / MiB:.1f}"),
        ("peak RSS MiB", lambda r: f"{r['peak_rss'] / MiB:.1f}"),
        ("extra peak MiB", lambda r: f"{r['extra_peak'] / MiB:.1f}"),
        ("expected acts MiB", lambda r: f"{r['expected_bytes'] / MiB:.1f} "
                                        f"({r['expected_boundaries']}x)"),
        ("extra / expected", lambda r: f"{r['extra_over_expected']:.2f}"),
        ("extra / model bytes", lambda r: f"{r['extra_over_model']:.3f}"),
        ("boundaries kept", lambda r: str(r["boundaries_kept"])),
        ("block evaluations", lambda r: str(r["block_evals"])),
        ("seconds", lambda r: f"{r['seconds']:.1f}"),
    ]
    print(f"{'':<22}" + "".join(f"{'states=' + m:>18}" for m in args.modes))
    for label, fmt in rows:
        print(f"{label:<22}" + "".join(f"{fmt(results[m]):>18}" for m in args.modes))

    out = {"model": args.model, "data": args.data, "samples": args.samples,
           "seqlen": args.seqlen, "batch_size": args.batch_size, "runs": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
