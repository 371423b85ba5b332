"""Elastic ranking vs one-shot width scores: test metric and time to produce each size.

For each removal budget ``b`` (fraction of the attention + MLP parameters that width
pruning can remove), the elastic model is cut from ONE ranking (fitted once on the
calibration windows over ``--fit-budgets``; :mod:`prunelab.pruning.width.elastic`), while each
baseline (``wanda-sp``, ``magnitude-profile``, ``flap``) is computed for that budget: KV
groups then FFN channels, each at ratio ``b`` of its own parameters under the ``global``
allocation (so both remove ``b`` of the same pool, per-block widths in both). No
compensation anywhere (bias compensation off), so the scores alone are compared.

Metrics: decoders (SmolLM2-135M) perplexity on ``wiki-vital:test`` and KL to the dense
model; encoders (MiniLM-L6) the sentence-embedding metrics of the evaluator (mean cosine
to the dense embeddings, same-document nearest neighbour). Times: the ranking fit (once),
each cut, each baseline run (calibration included).

Run (the lead's machine; minutes per model)::

    python benchmarks/elastic.py --model smollm2-135m [--budgets 0.1,0.2,0.3,0.4,0.5,0.6]
        [--steps 100 --samples 32 --seqlen 256] [--device cuda] [--json out.json]
    python benchmarks/elastic.py --model minilm-l6 --seqlen 128
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import prunelab
from prunelab.api import tokens_for
from prunelab.models.loading import wrap
from prunelab.pruning.width import Width
from prunelab.pruning.width.elastic import ElasticRanking, elastic

BASELINES = ("wanda-sp", "magnitude-profile", "flap")


def _copy(lm):
    new = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    new.source = lm.source
    return new


def metric(lm, dense, args) -> dict:
    out = prunelab.evaluate(lm, args.eval_data, seqlen=args.seqlen, samples=args.eval_samples,
                            reference=dense, batch_size=args.batch_size)
    keys = ("perplexity", "kl_to_reference", "mean_cosine_to_reference", "same_document_nn",
            "nn_agreement", "params")
    return {k: out[k] for k in keys if k in out}


def baseline(lm, score: str, b: float, calib, args):
    small = _copy(lm)
    start = time.perf_counter()
    kinds = ("heads", "ffn") if small.adapter.head_geometry(0).num_kv_heads > 1 else ("ffn",)
    for kind in kinds:
        cfg = Width(unit=kind, score=score, ratio=b, allocation="global",
                    bias_compensation=False, round_to=args.round_to)
        prunelab.prune(small, cfg, calib, batch_size=args.batch_size)
    return small, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budgets", default="0.1,0.2,0.3,0.4,0.5,0.6")
    ap.add_argument("--fit-budgets", default="0.1..0.6")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--eval-data", default="wiki-vital:test")
    ap.add_argument("--eval-samples", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--round-to", type=int, default=8)
    ap.add_argument("--baselines", default=",".join(BASELINES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = prunelab.load(args.model, dtype=args.dtype, device=args.device)
    calib = tokens_for(lm, "wiki-vital:calib", seqlen=args.seqlen, samples=args.samples,
                       mode="calib")
    dense = _copy(lm)
    lo, hi = (float(x) for x in args.fit_budgets.split(".."))
    start = time.perf_counter()
    prunelab.prune(lm, ElasticRanking(budget_min=lo, budget_max=hi, steps=args.steps), calib,
                   batch_size=args.batch_size)
    fit_s = time.perf_counter() - start
    view = elastic(lm, round_to=args.round_to)
    rows = [{"method": "dense", "budget": 0.0, "seconds": 0.0, **metric(dense, dense, args)}]
    for b in (float(x) for x in args.budgets.split(",")):
        t = time.perf_counter()
        small = view.at(1.0 - b)
        rows.append({"method": "elastic", "budget": b, "seconds": time.perf_counter() - t,
                     **metric(small, dense, args)})
        for score in args.baselines.split(","):
            small, secs = baseline(dense, score, b, calib, args)
            rows.append({"method": score, "budget": b, "seconds": secs,
                         **metric(small, dense, args)})
        print(json.dumps(rows[-1 - len(args.baselines.split(",")):]), flush=True)
    print_table(rows, fit_s)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "fit_seconds": fit_s, "args": vars(args),
                       "rows": rows}, fh, indent=2)


def print_table(rows: list[dict], fit_s: float) -> None:
    keys = [k for k in ("perplexity", "kl_to_reference", "mean_cosine_to_reference",
                        "same_document_nn") if k in rows[0]]
    print(f"\nelastic ranking fit: {fit_s:.2f} s (once)\n")
    print("| method | budget | " + " | ".join(keys) + " | params | seconds |")
    print("|---" * (len(keys) + 4) + "|")
    for r in rows:
        vals = " | ".join(f"{r.get(k, float('nan')):.4g}" for k in keys)
        print(f"| {r['method']} | {r['budget']:.0%} | {vals} | {r.get('params', 0):,} | "
              f"{r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
