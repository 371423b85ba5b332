"""CausalGate static sublayer gates vs block removal vs probe-greedy sublayer removal at equal
skipped compute (issue 19, part 2).

On SmolLM2-135M (embedded spec ``smollm2-135m``), calibration ``wiki-vital:calib``, test
``wiki-vital:test``: the intervention KLs of every attention and MLP branch are measured
once on the calibration windows (:func:`prunelab.pruning.gates.config.measure_sublayers`), and
for each budget (fraction of the sublayer compute skipped, FLOPs per token of the branches)
four plans are built from them and applied for real to a fresh copy of the model:

* ``gates``: CausalGate (EMA of bootstrap rounds, pairwise ranking loss, per-FLOP cover);
* ``gates-order``: the same gates covered in plain gate order (isolates the FLOP weighting);
* ``probe-greedy``: ascending mean KL alone, plain order;
* ``blocks``: whole blocks in ascending ``--block-probe`` score (default block influence).

Each row: the achieved skipped fraction (exact), removed sublayers / deleted blocks,
parameters, test perplexity, and the measured prefill tokens/s and latency against the
dense model measured back to back (best of ``--rounds``); with ``--decode-tokens N`` (> 0)
also prefill and decode tokens/s at batch 1 with the KV cache
(:func:`prunelab.eval.speed.speed_against`: ``--rounds`` interleaved rounds with the dense
model, the median ratio and its range), ``--threads`` setting torch's threads for all the
speed measurements.

Run (the lead runs it; the CPU is shared)::

    python benchmarks/gates.py [--calib 32 --test 32 --seqlen 256] [--budgets 0.1,0.2,0.3]
                               [--prompt-len 256 --rounds 2] [--decode-tokens 32]
                               [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time

import transformers

import prunelab
from prunelab import api
from prunelab.eval.perplexity import score_windows
from prunelab.models.loading import wrap
from prunelab.models.size import model_size
from prunelab.probes.context import ProbeContext
from prunelab.pruning.gates.config import (
    Gates,
    apply_plan,
    block_scores,
    latency_vs_dense,
    measure_sublayers,
    plan_blocks,
    plan_gates,
    plan_probe_greedy,
)


def plans_for(meas, scores, budget: float, args) -> list:
    cfg = Gates(budget=budget, ema=args.ema, rounds=args.gate_rounds,
                rank_weight=args.rank_weight, steps=args.steps, lr=args.lr)
    gates = plan_gates(meas, cfg)
    order = plan_gates(meas, dataclasses.replace(cfg, select="order"))
    order.method = "gates-order"
    return [gates, order, plan_probe_greedy(meas, budget),
            plan_blocks(meas, scores, budget, probe=args.block_probe)]


def run_plan(lm, plan, test, args) -> dict:
    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    rec = apply_plan(work, plan)
    ppl = score_windows(work, test, batch_size=args.batch_size, desc=plan.method)["perplexity"]
    lat = latency_vs_dense(lm, work, prompt_len=args.prompt_len, rounds=args.rounds)
    if args.decode_tokens > 0:
        from prunelab.eval.speed import speed_against

        sp = speed_against(work, lm, rounds=args.rounds, prompt_len=args.prompt_len,
                           decode_tokens=args.decode_tokens)
        lat.update({k: sp[k] for k in sp if k.startswith(("prefill_x", "decode_x"))},
                   decode_tokens_per_s=sp["decode_tokens_per_s"])
    return {"method": plan.method, "budget": plan.budget, "achieved": plan.achieved,
            "skipped_flops": plan.skipped_flops, "sublayer_flops": plan.total_flops,
            "removed": [[i, p] for i, p in plan.sublayers],
            "deleted_blocks": rec["deleted_blocks"],
            "params": model_size(work.model)["params"], "test_perplexity": ppl, **lat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib", type=int, default=32, help="calibration windows")
    ap.add_argument("--test", type=int, default=32, help="test windows")
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--budgets", default="0.1,0.2,0.3")
    ap.add_argument("--block-probe", default="block-influence")
    ap.add_argument("--ema", type=float, default=0.9)
    ap.add_argument("--gate-rounds", type=int, default=8)
    ap.add_argument("--rank-weight", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="latency: best of this many")
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="also interleaved prefill/decode tokens/s (median [range])")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the speed "
                    "measurements")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prunelab.log.set_quiet(True)
    lm = prunelab.load(args.model)
    calib = api.tokens_for(lm, "wiki-vital:calib", seqlen=args.seqlen, samples=args.calib,
                           seed=0, mode="calib").input_ids
    test = api.tokens_for(lm, "wiki-vital:test", seqlen=args.seqlen, samples=args.test,
                          seed=0, mode="test").input_ids
    dense_ppl = score_windows(lm, test, batch_size=args.batch_size, desc="dense")["perplexity"]
    start = time.perf_counter()
    ctx = ProbeContext(lm, calib, batch_size=args.batch_size)
    meas = measure_sublayers(lm, calib, ctx=ctx)
    scores = block_scores(ctx, args.block_probe)
    ctx.close()
    measure_s = time.perf_counter() - start
    rows = []
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    for budget in [float(b) for b in args.budgets.split(",")]:
        for plan in plans_for(meas, scores, budget, args):
            rows.append(run_plan(lm, plan, test, args))
            r = rows[-1]
            print(f"{r['method']:<13} budget {budget:.2f} achieved {r['achieved']:.4f} "
                  f"ppl {r['test_perplexity']:.3f} prefill x{r['prefill_speedup']:.2f}",
                  flush=True)
    dense_params = model_size(lm.model)["params"]
    print(f"\n{args.model}: dense test perplexity {dense_ppl:.3f}, {dense_params:,} params; "
          f"{len(meas.sublayers)} sublayers measured in {measure_s:.0f} s on "
          f"{args.calib} x {args.seqlen} calibration tokens")
    print("\n| budget | method | achieved | removed (attn/mlp) | deleted blocks | params | "
          "test ppl | ppl / dense | prefill tok/s | dense tok/s | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        attn = sum(p == "attention" for _, p in r["removed"])
        print(f"| {r['budget']:.2f} | {r['method']} | {r['achieved']:.4f} | "
              f"{attn}/{len(r['removed']) - attn} | {len(r['deleted_blocks'])} | "
              f"{r['params']:,} | {r['test_perplexity']:.3f} | "
              f"{r['test_perplexity'] / dense_ppl:.3f} | {r['prefill_tokens_per_s']:.0f} | "
              f"{r['dense_prefill_tokens_per_s']:.0f} | {r['prefill_speedup']:.2f} |")
    if args.decode_tokens > 0:
        print(f"\nbatch 1, KV cache, {args.prompt_len}-token prompt, {args.decode_tokens} "
              f"decode tokens, {args.rounds} interleaved rounds (median [range] vs dense)")
        print("\n| budget | method | prefill vs dense | decode tok/s | decode vs dense |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['budget']:.2f} | {r['method']} | {r['prefill_x_dense']:.2f}x "
                  f"[{r['prefill_x_dense_min']:.2f}, {r['prefill_x_dense_max']:.2f}] | "
                  f"{r['decode_tokens_per_s']:.1f} | {r['decode_x_dense']:.2f}x "
                  f"[{r['decode_x_dense_min']:.2f}, {r['decode_x_dense_max']:.2f}] |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "dense_perplexity": dense_ppl,
                       "dense_params": dense_params, "measure_seconds": measure_s,
                       "gates": [{"sublayer": list(s), "kl": float(k), "flops": f}
                                 for s, k, f in zip(meas.sublayers, meas.mean_kl,
                                                    meas.flops, strict=True)],
                       "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
