"""Swap-probe cost: prefix reuse (prunelab) versus a naive whole-model run per pair.

Both score the same pairs on the same token windows of the embedded model and compute the
same quantity: KL(p_dense || p_modified) at the last position (and over all positions).

* prunelab: ``run_probes(..., ["interchange", "replacement"])``: one dense pass caches
  every block boundary; each modified stack starts at block ``min(i, j)``.
* naive: for each pair the blocks are exchanged (or block i replaced by block j) in place
  inside ``try/finally`` and the whole model runs (``use_cache=False``) on all windows.

Printed side by side: seconds, block evaluations (one block over all windows = 1), the
ratio prunelab / naive, and the largest difference between the two implementations' KLs.
Two settings: adjacent pairs (window 1) and the full matrix (all pairs; fewer tokens by
default so that the naive side finishes in minutes on 2 cores).

Run::

    python benchmarks/probe_cost.py [--samples 8 --seqlen 128] [--full-samples 2
                                     --full-seqlen 64] [--skip-full] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

import prunelab
from prunelab.data import make_batches
from prunelab.probes import run_probes
from prunelab.probes.context import kl_last_position
from prunelab.probes.swap import select_pairs


@torch.no_grad()
def logits_of(lm, ids, batch_size):
    return torch.cat([lm.model(input_ids=b, use_cache=False).logits for b in
                      ids.split(batch_size)])


@torch.no_grad()
def naive(lm, ids, pairs, batch_size):
    """Whole-model runs per modified stack; returns (seconds, block evals, values)."""
    blocks = lm.adapter.blocks()
    n = len(blocks)
    start = time.perf_counter()
    dense = logits_of(lm, ids, batch_size)
    evals = n
    values = {"interchange": {}, "replacement": {}}

    def measure():
        logits = logits_of(lm, ids, batch_size)
        return kl_last_position(dense[:, -1], logits[:, -1]).mean().item()

    for i, j in pairs:
        original = list(blocks)
        try:
            blocks[i], blocks[j] = original[j], original[i]
            values["interchange"][(i, j)] = measure()
            blocks[i], blocks[j] = original[j], original[j]
            a = measure()
            blocks[i], blocks[j] = original[i], original[i]
            b = measure()
            values["replacement"][(i, j)] = max(a, b)
        finally:
            for k, blk in enumerate(original):
                blocks[k] = blk
        evals += 3 * n
    return time.perf_counter() - start, evals, values


def prefix(lm, ids, window, batch_size):
    start = time.perf_counter()
    res = run_probes(lm, ["interchange", "replacement"], ids, batch_size=batch_size,
                     window=window)
    seconds = time.perf_counter() - start
    evals = sum(r.meta["block_evaluations"] for r in res.values())
    evals += res["interchange"].meta["cache_block_evaluations"]
    values = {name: {tuple(s["layers"]): s["value"] for s in r.scores}
              for name, r in res.items()}
    return seconds, evals, values


def compare(lm, name, ids, window, batch_size):
    n = lm.adapter.num_blocks
    pairs = select_pairs(n, window, ())
    p_sec, p_evals, p_vals = prefix(lm, ids, window, batch_size)
    n_sec, n_evals, n_vals = naive(lm, ids, pairs, batch_size)
    diff = max(abs(p_vals[k][pair] - n_vals[k][pair]) / max(n_vals[k][pair], 1e-9)
               for k in p_vals for pair in pairs)
    return {"setting": name, "pairs": len(pairs), "tokens": ids.numel(),
            "prefix_seconds": p_sec, "naive_seconds": n_sec, "time_ratio": p_sec / n_sec,
            "prefix_block_evals": p_evals, "naive_block_evals": n_evals,
            "eval_ratio": p_evals / n_evals, "max_relative_kl_difference": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--full-samples", type=int, default=2)
    ap.add_argument("--full-seqlen", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--skip-full", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    prunelab.log.set_quiet(True)
    torch.manual_seed(0)
    lm = prunelab.load(args.model)
    rows = []
    ids = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=args.seqlen,
                       samples=args.samples, seed=0).input_ids
    rows.append(compare(lm, "window 1", ids, 1, args.batch_size))
    if not args.skip_full:
        ids = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=args.full_seqlen,
                           samples=args.full_samples, seed=0).input_ids
        rows.append(compare(lm, "full matrix", ids, None, args.batch_size))
    head = (f"{'setting':<12} {'pairs':>5} {'tokens':>6} {'prefix s':>9} {'naive s':>9} "
            f"{'ratio':>6} {'prefix evals':>12} {'naive evals':>11} {'ratio':>6} "
            f"{'max rel dKL':>11}")
    print(f"swap probes (interchange + replacement) on {args.model}, {torch.get_num_threads()} "
          "threads")
    print(head)
    for r in rows:
        print(f"{r['setting']:<12} {r['pairs']:>5} {r['tokens']:>6} "
              f"{r['prefix_seconds']:>9.1f} {r['naive_seconds']:>9.1f} {r['time_ratio']:>6.2f} "
              f"{r['prefix_block_evals']:>12.0f} "
              f"{r['naive_block_evals']:>11.0f} {r['eval_ratio']:>6.2f} "
              f"{r['max_relative_kl_difference']:>11.2e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
