"""Depth search on the embedded model: one-shot probes against SLEB, beam search and the
sub-block search (BlockPruner), each with none / foldable / ghost recovery and with the
recovery in the search loop; test perplexity, wall time, block evaluations, parameters.

Rows (``METHOD:RECOVERY[:loop]``):

* ``block-influence`` one-shot, ``span-angular`` (its best span), ``beam`` (block
  influence seeds, width 3, 12 seeds, KL), ``sleb`` (greedy by calibration NLL),
  ``sublayer`` (SLEB's greedy over attention / MLP sub-blocks at equal parameters removed:
  ``remove = n`` block-equivalents, see :mod:`prunelab.pruning.depth.search_budget`);
* ``:loop`` (beam, sleb, sublayer): every candidate scored after its closed-form recovery;
* ``plan:RECOVERY``: the sub-blocks given by ``--plans`` for that count (e.g. a sublayer
  row's ``removed``), re-applied with another recovery without searching again.

**Nested greedy rows** (``--nested``, the default): greedy removal is nested (the run to 8
blocks passes through the 4- and 6-block selections; see
:func:`prunelab.pruning.depth.strategies.sleb.share_greedy_runs`), so the ``sleb`` and
``sublayer`` rows search once, to the largest count, and the smaller counts take its
prefix; their wall time and block evaluations are the prefix's (what a run to that count
alone costs) plus their own repair. Greedy rows run after the others, largest count first.
``sleb:ghost`` and ``sleb:foldable`` share one search (the recovery enters the search only
with ``:loop``). ``:loop`` rows score each candidate's fit on held-out calibration batches
(``--holdout``, default the config's 0.25).

Every row prunes a fresh copy of the model; the dense model's probe context (the cached
block boundaries on the calibration windows) is shared, so a row's wall time and block
evaluations are its own selection and repair (the one dense caching pass is printed
apart). The script reports whether the best row at each removal count gives a plain
transformers checkpoint or one that needs ``trust_remote_code=True``.

Run (defaults are the issue's protocol)::

    python benchmarks/depth_search.py [--calib 32 --test 32 --seqlen 256 --test-seqlen 512]
        [--removes 4,6,8] [--rows sleb:ghost,sleb:ghost:loop] [--json out.json]
        [--no-nested] [--holdout 0.25] [--workers 2] [--no-fast] [--threads 1]

``--json`` is rewritten after every row, so an interrupted run still leaves its table.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

METHODS = ("block-influence", "span-angular", "beam", "sleb", "sublayer", "plan")
RECOVERIES = ("none", "foldable", "ghost")
LOOPED = ("beam", "sleb", "sublayer")
NESTED = ("sleb", "sublayer")  # greedy: a run to n passes through every k < n


def all_rows() -> list[str]:
    rows = [f"{m}:{r}" for m in METHODS if m != "plan" for r in RECOVERIES]
    rows += [f"{m}:{r}:loop" for m in LOOPED for r in RECOVERIES if r != "none"]
    return rows


def make_config(row: str, remove: int, holdout: float | None = None,
                search_windows: int | None = None, plans: dict | None = None,
                resume: str = "", workers: int = 1):
    """The Depth config of a row label (``holdout``: recovery_holdout of ``:loop`` rows;
    ``search_windows``: the search rows score candidates on that many windows;
    ``resume``: sleb / sublayer rows continue a search from these removals; ``workers``:
    processes scoring a sleb / sublayer step's candidates)."""
    from prunelab.pruning import Beam, Depth, Sleb

    method, recovery, *loop = row.split(":")
    kw = {"remove": remove, "recovery": recovery, "recovery_in_loop": bool(loop)}
    if resume and (loop or method not in ("sleb", "sublayer")):
        raise SystemExit(f"error: {row}: --resume applies to sleb / sublayer rows without "
                         ":loop")
    if loop and method in ("beam", "sleb", "sublayer"):
        kw["recovery_holdout"] = holdout
    if method in ("beam", "sleb", "sublayer"):
        kw["search_windows"] = search_windows
    if method == "block-influence":
        return Depth(probe="block-influence", select="one-shot", **kw)
    if method == "span-angular":
        return Depth(probe="span-angular", select="span", **kw)
    if method == "beam":
        return Depth(probe="block-influence", select=Beam(), **kw)
    if method == "sleb":
        return Depth(select=Sleb(score="nll", resume=resume, workers=workers), **kw)
    if method == "sublayer":
        return Depth(select=Sleb(score="nll", resume=resume, workers=workers),
                     granularity="sublayer", **kw)
    if method == "plan":
        if loop:
            raise SystemExit(f"error: {row}: a given plan has no search to loop over")
        if plans is not None and remove not in plans:
            raise SystemExit(f"error: {row}: --plans gives no plan for {remove} removed")
        return Depth(sublayers=(plans or {}).get(remove, "0:mlp"), recovery=recovery)
    raise SystemExit(f"error: unknown row {row!r}")


def run_row(lm, ctx, row: str, remove: int, calib, test, batch_size: int,
            holdout: float | None = None, search_windows: int | None = None,
            shared: dict | None = None, plans: dict | None = None,
            resume: str = "", workers: int = 1) -> dict:
    """Prune a copy of ``lm`` by ``row``, evaluate it on ``test``. A nested greedy row
    answered from a larger run adds that run's prefix cost (``search_*``) to its own.

    ``shared`` (beam rows without ``:loop``, whose search does not see the recovery): the
    first beam row at a count runs the search and records its blocks and cost; the other
    recoveries at that count remove the same blocks and add that search cost to their own
    repair (``shared_search`` in the row)."""
    import dataclasses

    import prunelab
    from prunelab.errors import PrunelabError
    from prunelab.pruning.depth.surgery import prune_depth

    work = copy.deepcopy(lm)
    cfg = make_config(row, remove, holdout, search_windows, plans, resume, workers)
    method, _, *loop = row.split(":")
    key = (remove, search_windows) if method == "beam" and not loop else None
    reuse = shared.get(key) if (shared is not None and key is not None) else None
    if reuse is not None:
        cfg = dataclasses.replace(cfg, remove=None, select=None, probe="block-influence",
                                  search_windows=None, blocks=tuple(reuse["blocks"]))
    t0 = time.perf_counter()
    try:
        rep = prune_depth(work, cfg, calib.input_ids, ctx=ctx, batch_size=batch_size)
    except PrunelabError as exc:
        return {"row": row, "remove": remove, "error": str(exc)}
    seconds = time.perf_counter() - t0
    sel = rep["selection"]
    evals = rep["block_evaluations"]
    if key is not None and shared is not None and reuse is None:
        shared[key] = {"blocks": list(rep["removed_blocks"]), "seconds": seconds,
                       "block_evaluations": sel.get("block_evaluations", evals)}
    res = prunelab.evaluate(work, test, batch_size=batch_size)
    if sel.get("nested"):  # the search ran once, for a larger count: its prefix's cost
        seconds += sel["seconds"]
        evals += sel["block_evaluations"]
    if reuse is not None:  # the beam search ran once, in the first row at this count
        seconds += reuse["seconds"]
        evals += reuse["block_evaluations"]
        sel = dict(sel, search_windows=search_windows, shared_search=True)
    return {"row": row, "remove": remove, "test_perplexity": res["perplexity"],
            "seconds": seconds, "block_evaluations": evals,
            "search_block_evaluations": sel.get("block_evaluations"),
            "nested": sel.get("nested"), "holdout": sel.get("holdout_split"),
            "resumed_from": sel.get("resumed_from"),
            "search_windows": sel.get("search_windows"),
            "shared_search": sel.get("shared_search", False),
            "params": rep["size_after"]["params"],
            "params_removed": rep["size_before"]["params"] - rep["size_after"]["params"],
            "removed": rep.get("removed_sublayers") or rep["removed_blocks"],
            "repaired_cuts": sel.get("repaired_cuts"),
            "calib_kl": rep["calib_kl_after_recovery"],
            "checkpoint": "remote code" if rep["needs_remote_code"] else "plain"}


def print_table(points: list[dict], dense: dict) -> None:
    print(f"dense: test ppl {dense['test_perplexity']:.2f}, {dense['params']:,} params; "
          f"cache pass {dense['cache_block_evaluations']:.0f} block evaluations, "
          f"{dense['cache_seconds']:.1f} s")
    head = f"{'remove':>6} {'row':<26} {'test ppl':>9} {'s':>7} {'blk evals':>9} " \
           f"{'params':>12} checkpoint"
    print(head)
    for p in points:
        if "error" in p:
            print(f"{p['remove']:>6} {p['row']:<26} error: {p['error']}")
            continue
        print(f"{p['remove']:>6} {p['row']:<26} {p['test_perplexity']:>9.2f} "
              f"{p['seconds']:>7.1f} {p['block_evaluations']:>9.0f} {p['params']:>12,} "
              f"{p['checkpoint']}")
    for n in sorted({p["remove"] for p in points}):
        ok = [p for p in points if p["remove"] == n and "error" not in p]
        if ok:
            best = min(ok, key=lambda p: p["test_perplexity"])
            ratio = best["test_perplexity"] / dense["test_perplexity"]
            print(f"best at {n} removed: {best['row']} (test ppl {best['test_perplexity']:.2f}"
                  f", {ratio:.2f}x dense), checkpoint: {best['checkpoint']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--test", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256, help="calibration window length")
    ap.add_argument("--test-seqlen", type=int, default=512)
    ap.add_argument("--removes", default="4,6,8")
    ap.add_argument("--rows", default=",".join(all_rows()),
                    help="METHOD:RECOVERY[:loop], comma separated")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="e.g. cuda")
    ap.add_argument("--json", default=None, help="rewritten after every row")
    ap.add_argument("--nested", action=argparse.BooleanOptionalAction, default=True,
                    help="greedy rows (sleb, sublayer): search once to the largest count")
    ap.add_argument("--holdout", type=float, default=None,
                    help=":loop rows: recovery_holdout (default: the config's 0.25)")
    ap.add_argument("--search-windows", type=int, default=None,
                    help="beam / sleb / sublayer rows: score candidates on the first N "
                    "calibration windows (default all; the recovery fits on all)")
    ap.add_argument("--plans", default=None,
                    help="plan rows: COUNT=BLOCK:PART,...;COUNT=... (e.g. "
                    "'4=5:attention,16:mlp')")
    ap.add_argument("--resume", default="",
                    help="sleb / sublayer rows without :loop: continue the search from these "
                    "removals (blocks 5,16 or sub-blocks 5:attention,16:mlp; the steps of a "
                    "smaller run: greedy runs are nested); one count in --removes; "
                    "block evaluations and seconds are then those of the continuation")
    ap.add_argument("--workers", type=int, default=1,
                    help="sleb / sublayer rows: processes scoring each step's candidates "
                    "(Sleb.workers; the same choice)")
    ap.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                    help="sleb / sublayer :loop rows at block granularity: the fast path "
                    "(prunelab.pruning.depth.fast_loop); --no-fast runs the straightforward "
                    "one (the same choice and scores, for comparison)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's)")
    ap.add_argument("--progress", action="store_true",
                    help="show progress on stderr (loading, each search step); "
                    "default quiet: rows print when they end")
    args = ap.parse_args()

    import torch

    import prunelab
    from prunelab import api
    from prunelab.probes import ProbeContext
    from prunelab.pruning.depth.strategies import sleb as sleb_strategy

    if args.threads:
        torch.set_num_threads(args.threads)
    sleb_strategy.FAST_IN_LOOP = args.fast
    rows = [r for r in args.rows.split(",") if r]
    plans = parse_plans(args.plans)
    for r in rows:
        for n in ([int(x) for x in args.removes.split(",")] if r.startswith("plan:") else [1]):
            make_config(r, n, plans=plans, resume=args.resume,
                        workers=args.workers)  # refuse bad rows early
    if args.resume and "," in args.removes:
        raise SystemExit("error: --resume continues one search: give one count in --removes")
    prunelab.log.set_quiet(not args.progress)
    lm = prunelab.load(args.model, device=args.device)
    calib = api.tokens_for(lm, "wiki-vital:calib", seqlen=args.seqlen, samples=args.calib)
    test = api.tokens_for(lm, "wiki-vital:test", seqlen=args.test_seqlen, samples=args.test)
    ctx = ProbeContext(lm, calib.input_ids, batch_size=args.batch_size)
    dense = prunelab.evaluate(lm, test, batch_size=args.batch_size)
    dense.update(test_perplexity=dense["perplexity"],
                 cache_block_evaluations=ctx.cache_block_evaluations,
                 cache_seconds=ctx.setup_seconds)
    print(json.dumps({"dense_test_perplexity": dense["perplexity"],
                      "cache_block_evaluations": ctx.cache_block_evaluations,
                      "cache_seconds": ctx.setup_seconds}), flush=True)
    if args.nested:
        from prunelab.pruning.depth.strategies.sleb import share_greedy_runs

        share_greedy_runs(ctx)
    points, shared = [], {}
    for row, n in plan_rows(rows, [int(x) for x in args.removes.split(",")], args.nested):
        points.append(run_row(lm, ctx, row, n, calib, test, args.batch_size, args.holdout,
                              args.search_windows, shared, plans, args.resume,
                              args.workers))
        print(json.dumps(points[-1]), flush=True)
        if args.json:
            write_json(args.json, dense, points, args)
    print_table(sorted(points, key=lambda p: p["remove"]), dense)


def parse_plans(text: str | None) -> dict:
    """``{count: "BLOCK:PART,..."}`` from ``--plans '4=5:attention,16:mlp;6=...'``."""
    plans = {}
    for item in (text or "").split(";"):
        if item.strip():
            count, _, spec = item.partition("=")
            plans[int(count)] = spec.strip()
    return plans


def plan_rows(rows: list[str], removes: list[int], nested: bool) -> list[tuple[str, int]]:
    """The order of the work: every count of the one-shot rows first (cheap), then each
    greedy row with its counts largest first (the smaller ones are its prefixes)."""
    greedy = [r for r in rows if nested and r.split(":")[0] in NESTED]
    # beam:none first: the shared beam search's time is then its own (no repair inside)
    rows = sorted(rows, key=lambda r: r != "beam:none")
    order = [(r, n) for n in removes for r in rows if r not in greedy]
    return order + [(r, n) for r in greedy for n in sorted(removes, reverse=True)]


def write_json(path: str, dense: dict, points: list, args) -> None:
    keys = ("test_perplexity", "params", "cache_block_evaluations", "cache_seconds")
    with open(path, "w") as f:
        json.dump({"dense": {k: dense[k] for k in keys if k in dense}, "points": points,
                   "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
