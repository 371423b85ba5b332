"""Depth pruning speed-up: prefill and decode tokens/s before and after removing n blocks.

For n = 3, 6, 9 (``--removes``) blocks of the embedded model, chosen by block influence and
repaired with each recovery (``foldable``: vanilla, no extra parameters; ``ghost`` and
``lra``: one linear bridge per removed span), prints the measured speed-up next to the
ideal ``L / (L - n)`` and the fraction of ideal reached, plus parameters. The dense model
is measured back to back with every pruned copy (alternating, best of ``--rounds``), so
each ratio compares runs made under the same machine load. Speed is measured with
:func:`prunelab.eval.speed.measure_speed` (prefill of ``--prompt-len`` tokens, median of 3
after a warm-up; ``--decode`` greedy steps with the KV cache).

Run::

    python benchmarks/depth_speed.py [--removes 3,6,9] [--recoveries foldable,ghost,lra]
                                     [--prompt-len 256 --decode 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import transformers

import prunelab
from prunelab.data import make_batches
from prunelab.eval.speed import measure_speed
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext
from prunelab.pruning import Depth
from prunelab.pruning.depth.config import select
from prunelab.pruning.depth.surgery import prune_depth


def speed(lm, args) -> dict:
    runs = [measure_speed(lm, prompt_len=args.prompt_len, decode_tokens=args.decode,
                          repeats=3, seed=0) for _ in range(args.rounds)]
    return {"prefill": max(r["prefill_tokens_per_s"] for r in runs),
            "decode": max(r["decode_tokens_per_s"] for r in runs)}


def paired(dense_lm, pruned_lm, args) -> tuple[dict, dict]:
    """Dense and pruned measured back to back, alternating, best of ``rounds`` each: the
    ratio compares runs made under the same machine load."""
    d_runs, p_runs = [], []
    for _ in range(args.rounds):
        d_runs.append(measure_speed(dense_lm, prompt_len=args.prompt_len,
                                    decode_tokens=args.decode, repeats=3, seed=0))
        p_runs.append(measure_speed(pruned_lm, prompt_len=args.prompt_len,
                                    decode_tokens=args.decode, repeats=3, seed=0))

    def best(runs):
        return {"prefill": max(r["prefill_tokens_per_s"] for r in runs),
                "decode": max(r["decode_tokens_per_s"] for r in runs)}

    return best(d_runs), best(p_runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--removes", default="3,6,9")
    ap.add_argument("--recoveries", default="foldable,ghost,lra")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="best of this many measurements")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prunelab.log.set_quiet(True)
    lm = prunelab.load(args.model)
    n_blocks = lm.adapter.num_blocks
    calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=args.seqlen,
                         samples=args.samples, seed=0).input_ids
    dense = speed(lm, args)
    dense_params = prunelab.models.size.model_size(lm.model)["params"]
    ctx = ProbeContext(lm, calib, batch_size=8)
    rows = []
    for n in [int(x) for x in args.removes.split(",")]:
        removed, _ = select(lm, Depth(remove=n), ctx, n)
        for rec in args.recoveries.split(","):
            work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
            report = prune_depth(work, Depth(blocks=tuple(removed), recovery=rec), calib,
                                 ctx=ctx, removed=removed, batch_size=8)
            d, s = paired(lm, work, args)
            ideal = n_blocks / (n_blocks - n)
            rows.append({"removed": n, "blocks": removed, "recovery": rec,
                         "params": report["size_after"]["params"],
                         "prefill": s["prefill"], "decode": s["decode"],
                         "dense_prefill": d["prefill"], "dense_decode": d["decode"],
                         "prefill_speedup": s["prefill"] / d["prefill"],
                         "decode_speedup": s["decode"] / d["decode"], "ideal": ideal})
            del work
    ctx.close()
    print(f"{args.model}: {n_blocks} blocks, {dense_params:,} params, {torch.get_num_threads()} "
          f"threads; prefill {args.prompt_len} tokens, decode {args.decode} tokens")
    print(f"dense (first measurement): prefill {dense['prefill']:.0f} tok/s, decode "
          f"{dense['decode']:.1f} tok/s; each row's ratio uses its own paired dense run")
    print(f"{'n':>2} {'recovery':<9} {'params':>12} {'prefill':>8} {'x':>6} {'decode':>7} "
          f"{'x':>6} {'ideal':>6} {'pre/ideal':>9} {'dec/ideal':>9}")
    for r in rows:
        print(f"{r['removed']:>2} {r['recovery']:<9} {r['params']:>12,} {r['prefill']:>8.0f} "
              f"{r['prefill_speedup']:>6.2f} {r['decode']:>7.1f} {r['decode_speedup']:>6.2f} "
              f"{r['ideal']:>6.2f} {r['prefill_speedup'] / r['ideal']:>9.2f} "
              f"{r['decode_speedup'] / r['ideal']:>9.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"dense": dense, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
