"""Factorization at matched parameter budgets: SliceGPT (per-layer), one global rotation,
sensitivity-aware slicing, per-block widths (``slicegpt-widths``: energy share;
``slicegpt-kl-widths``: measured per-block KL curves), SVD-LLM, Basis Sharing and
the optimized shared dictionary, against FFN width pruning with compensation and depth
pruning with foldable recovery.

Every point prunes a fresh copy of the model to the same kept fraction of the model's
parameters (``target_params``: everything the checkpoint stores counted, an untied head
and shortcut matrices included) on the same calibration windows, then scores it with the
one evaluator: test perplexity, KL to the dense model on the calibration windows (the
quantity the sensitivity-aware basis minimises) and on the test windows. Each point runs
in its own process so its wall time and peak memory (max RSS, model load included) are its
own. For the global rotation the script also measures prefill / decode speed of the sliced
model against the dense one, back to back (best of ``--rounds``).

Run (defaults are the issue's protocol: 64 x 512 calibration, 32 x 512 test)::

    python benchmarks/factorization.py [--model smollm2-135m] [--keeps 0.9,0.8,0.7]
        [--methods slicegpt,global,sensitivity,svd-llm,basis-sharing,shared-dict,width,depth]
        [--calib 64 --test 32 --seqlen 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time

#: method label -> (registered config name, fixed options)
FACTOR = {
    "slicegpt": ("slicegpt", {"rotation": "per-layer", "basis": "pca"}),
    "global": ("slicegpt", {"rotation": "global", "basis": "pca"}),
    "global-raw": ("slicegpt", {"rotation": "global", "basis": "pca",
                                "global_weights": "raw"}),
    "sensitivity": ("slicegpt", {"rotation": "per-layer", "basis": "sensitivity"}),
    "sensitivity-proxy": ("slicegpt", {"rotation": "per-layer", "basis": "sensitivity",
                                       "select": "proxy"}),
    "global-sensitivity": ("slicegpt", {"rotation": "global", "basis": "sensitivity"}),
    "slicegpt-widths": ("slicegpt", {"rotation": "per-layer", "basis": "pca",
                                     "widths": "spectrum"}),
    "slicegpt-kl-widths": ("slicegpt", {"rotation": "per-layer", "basis": "pca",
                                        "widths": "kl"}),
    "svd-llm": ("svd-llm", {}),
    "basis-sharing": ("basis-sharing", {}),
    "shared-dict": ("shared-dict", {}),
    "shared-dict-own": ("shared-dict", {"shrink": 0.0}),
}
ALL = [*FACTOR, "width", "depth"]


def make_config(label: str, keep: float, lm):
    """The pruning config of ``label`` at kept parameter fraction ``keep``."""
    from prunelab.pruning import METHODS, Depth, Width

    if label in FACTOR:
        name, opts = FACTOR[label]
        return METHODS.get(name)(target_params=keep, **opts)
    if label == "width":
        return Width(unit="ffn", score="wanda-sp", target_params=keep, compensate=True)
    if label == "depth":  # whole blocks, enough to reach `keep`, block-influence ranking
        return Depth(target_params=keep, probe="block-influence", recovery="foldable")
    raise SystemExit(f"error: unknown method {label!r}; choose from {', '.join(ALL)}")


def one_point(args) -> dict:
    """Prune and evaluate one (method, keep) point in this process; print its JSON."""
    import copy

    import prunelab
    from prunelab import api
    from prunelab.eval.divergence import kl_from_logits  # noqa: F401 - evaluator's KL

    prunelab.log.set_quiet(True)
    lm = prunelab.load(args.model)
    dense = copy.deepcopy(lm)
    calib = api.tokens_for(lm, "wiki-vital:calib", seqlen=args.seqlen,
                                samples=args.calib, seed=0)
    test = api.tokens_for(lm, "wiki-vital:test", seqlen=args.seqlen,
                               samples=args.test, seed=0)
    cfg = make_config(args.one, args.keep, lm)
    t0 = time.perf_counter()
    rep = prunelab.prune(lm, cfg, calib, batch_size=args.batch_size)
    seconds = time.perf_counter() - t0
    res = prunelab.evaluate(lm, test, reference=dense, batch_size=args.batch_size)
    sub = dataclasses.replace(calib, input_ids=calib.input_ids[:args.kl_windows],
                              samples=min(args.kl_windows, calib.samples))
    cal = prunelab.evaluate(lm, sub, reference=dense, batch_size=args.batch_size)
    point = {"method": args.one, "keep_target": args.keep,
             "kept_params": rep["size_after"]["params"] / rep["size_before"]["params"],
             "params": rep["size_after"]["params"],
             "flops_per_token": rep.to_dict().get("flops_per_token_after"),
             "test_perplexity": res["perplexity"], "test_kl": res["kl_to_reference"],
             "calib_kl": cal["kl_to_reference"], "seconds": seconds,
             "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    d = rep.to_dict()
    if d.get("block_widths"):  # slicing: the kept width per block (and the head)
        point["block_widths"] = d["block_widths"]
    if args.one.startswith("global") and args.speed:
        point.update(speed_pair(dense, lm, args.rounds))
    return point


def speed_pair(dense, sliced, rounds: int) -> dict:
    from prunelab.eval.speed import measure_speed

    runs = {"dense": [], "sliced": []}
    for _ in range(rounds):
        for key, lm in (("dense", dense), ("sliced", sliced)):
            runs[key].append(measure_speed(lm, prompt_len=256, decode_tokens=32, repeats=3,
                                           seed=0))
    best = {k: max(r["prefill_tokens_per_s"] for r in v) for k, v in runs.items()}
    return {"prefill_dense": best["dense"], "prefill_sliced": best["sliced"],
            "prefill_speedup": best["sliced"] / best["dense"],
            "hidden_ratio": sliced.model.config.hidden_size / dense.model.config.hidden_size}


def dense_point(args) -> dict:
    import prunelab
    from prunelab import api

    prunelab.log.set_quiet(True)
    lm = prunelab.load(args.model)
    test = api.tokens_for(lm, "wiki-vital:test", seqlen=args.seqlen, samples=args.test,
                               seed=0)
    res = prunelab.evaluate(lm, test, batch_size=args.batch_size)
    return {"method": "dense", "keep_target": 1.0, "kept_params": 1.0,
            "params": res["params"], "test_perplexity": res["perplexity"], "test_kl": 0.0,
            "calib_kl": 0.0, "seconds": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default=",".join(ALL))
    ap.add_argument("--keeps", default="0.9,0.8,0.7")
    ap.add_argument("--calib", type=int, default=64)
    ap.add_argument("--test", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--kl-windows", type=int, default=16,
                    help="calibration windows the calibration KL is measured on")
    ap.add_argument("--speed", action="store_true", help="prefill speed of global slices")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--keep", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        point = dense_point(args) if args.one == "dense" else one_point(args)
        print("POINT " + json.dumps(point), flush=True)
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in ALL]
    if unknown:
        raise SystemExit(f"error: unknown method {unknown[0]!r}; choose from {', '.join(ALL)}")
    keeps = [float(k) for k in args.keeps.split(",")]
    base = [sys.executable, __file__, "--model", args.model, "--calib", str(args.calib),
            "--test", str(args.test), "--seqlen", str(args.seqlen),
            "--batch-size", str(args.batch_size), "--rounds", str(args.rounds),
            "--kl-windows", str(args.kl_windows)]
    if args.speed:
        base.append("--speed")
    jobs = [("dense", 1.0)] + [(m, k) for k in keeps for m in methods]
    points = []
    for label, keep in jobs:
        proc = subprocess.run(base + ["--one", label, "--keep", str(keep)],
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("POINT ")), None)
        if proc.returncode != 0 or line is None:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{label} @ {keep}: failed: {err}", flush=True)
            points.append({"method": label, "keep_target": keep, "error": err})
            continue
        p = json.loads(line[len("POINT "):])
        points.append(p)
        print(f"{label:18s} keep {keep:.2f}: kept {p['kept_params']:.3f}  ppl "
              f"{p['test_perplexity']:8.3f}  calib KL {p['calib_kl']:.4f}  test KL "
              f"{p['test_kl']:.4f}  {p['seconds']:6.1f} s  "
              f"{p.get('peak_rss_mib', 0):6.0f} MiB", flush=True)
    print_table(points)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f, indent=2)


def print_table(points: list[dict]) -> None:
    dense = next((p for p in points if p["method"] == "dense" and "error" not in p), None)
    print("\n| method | target keep | kept params | test ppl | ppl / dense | calib KL | "
          "test KL | seconds | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in points:
        if "error" in p:
            print(f"| {p['method']} | {p['keep_target']} | failed: {p['error']} |||||||")
            continue
        ratio = p["test_perplexity"] / dense["test_perplexity"] if dense else float("nan")
        print(f"| {p['method']} | {p['keep_target']:.2f} | {p['kept_params']:.3f} | "
              f"{p['test_perplexity']:.3f} | {ratio:.2f}x | {p['calib_kl']:.4f} | "
              f"{p['test_kl']:.4f} | {p['seconds']:.1f} | {p.get('peak_rss_mib', 0):.0f} |")
    speed = [p for p in points if "prefill_speedup" in p]
    if speed:
        print("\n| method | keep | d'/d | prefill dense tok/s | prefill sliced tok/s | speed-up |")
        print("|---|---|---|---|---|---|")
        for p in speed:
            print(f"| {p['method']} | {p['keep_target']:.2f} | {p['hidden_ratio']:.3f} | "
                  f"{p['prefill_dense']:.0f} | {p['prefill_sliced']:.0f} | "
                  f"{p['prefill_speedup']:.2f}x |")


if __name__ == "__main__":
    main()
