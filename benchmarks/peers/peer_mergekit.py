"""Peer: depth pruning with PruneMe's angular-distance span cut and mergekit's passthrough
merge (mergekit 0.1.5), against prunelab's ``span-angular`` probe with recovery.

Both sides get the same calibration windows (``wiki-vital:calib``; sha256 checked by
every job) and the same budget, ``n`` contiguous blocks removed (full: 6 of 30, as the
depth benchmarks; ``--quick``: 2). The peer (``worker_mergekit.py``, in
``.bench/peers/mergekit-venv``) picks the span by PruneMe's last-token angular distance and
cuts it with ``mergekit-yaml`` (no recovery); prunelab runs ``Depth(remove=n,
probe="span-angular", select="span")`` with ``recovery="none"`` (the same cut, a check
that both pick the same span) and ``recovery="foldable"`` (its closed-form recovery, a
plain checkpoint). All checkpoints are reloaded and scored by one evaluator
(:func:`scoring.score_dirs`) on the same ``wiki-vital:test`` windows.
"""

from __future__ import annotations

import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common
import scoring
from table import fmt, gap, markdown_table, ratio

NAME = "mergekit"
PIN = "mergekit==0.1.5"
HERE = Path(__file__).resolve().parent


def protocol(quick: bool) -> dict:
    if quick:
        return {"remove": 2, "calib": (4, 128), "test": (2, 128)}
    return {"remove": 6, "calib": (32, 256), "test": (8, 512)}


def run(ctx) -> tuple[str, dict]:
    import transformers

    import prunelab
    from prunelab.data import make_batches

    proto = protocol(ctx.quick)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        py, versions = common.ensure_venv(
            "mergekit", [PIN, f"transformers=={transformers.__version__}", "psutil"],
            ["mergekit", "torch", "transformers", "psutil"])
    except RuntimeError as exc:
        return _head(ctx, started) + f"\n\nNot run: {exc}", {"error": str(exc)}
    lm = prunelab.load(ctx.model, dtype="float32", device="cpu")
    (cn, cs), (tn, ts) = proto["calib"], proto["test"]
    calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=cs, samples=cn, seed=0)
    test = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=ts, samples=tn)
    model_dir = str(lm.source)
    del lm
    workdir = ctx.workdir / NAME
    workdir.mkdir(parents=True, exist_ok=True)
    sha = common.save_ids(workdir / "calib.ids.npy", calib.input_ids)
    n = proto["remove"]
    peer_spec = {"model_dir": model_dir, "ids": str(workdir / "calib.ids.npy"),
                 "ids_sha256": sha, "remove": n, "save_dir": str(workdir / "mergekit-out")}
    shutil.rmtree(peer_spec["save_dir"], ignore_errors=True)
    specs = {f"prunelab {rec}": {"model": ctx.model, "ids_sha256": sha, "remove": n,
                                 "calib": {"source": "wiki-vital:calib", "seqlen": cs,
                                           "samples": cn}, "recovery": rec,
                                 "save_dir": str(workdir / f"prunelab-{rec}")}
             for rec in ("none", "foldable")}
    with ThreadPoolExecutor(3) as pool:  # three processes at once on the shared core
        futures = {"PruneMe + mergekit": pool.submit(
            common.run_worker, py, HERE / "worker_mergekit.py", peer_spec, workdir, "mergekit")}
        for side, spec in specs.items():
            futures[side] = pool.submit(common.run_worker, sys.executable,
                                        HERE / "worker_depth.py", spec, workdir,
                                        side.replace(" ", "-"))
        results = {side: f.result() for side, f in futures.items()}
    dirs = {}
    for side, res in results.items():
        if "error" not in res:
            common.check_result_ids(res, sha, side)
            dirs[side] = res["save_dir"]
    scores = scoring.score_dirs(ctx.model, test, dirs)
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    raw = {"protocol": proto, "ids_sha256": sha, "test_sha256": test.sha256,
           "results": results, "scores": scores, "venv_versions": versions}
    return section(ctx, started, raw), raw


def _head(ctx, started) -> str:
    return "\n".join(["## Depth: PruneMe + mergekit (passthrough) vs prunelab span-angular", "",
                      f"Run {started}, commit `{ctx.commit}`, {ctx.machine}; command: "
                      f"`{ctx.command}`."])


def _removed(side: str, res: dict) -> str:
    if side.startswith("PruneMe"):
        b = res.get("removed", [])
    else:
        rep = res.get("report", {})
        b = rep.get("removed") or rep.get("removed_blocks") or rep.get("blocks") or "?"
    return str(b).replace(" ", "")


def section(ctx, started, raw) -> str:
    p, sc = raw["protocol"], raw["scores"]
    lines = [_head(ctx, started), "",
             f"{ctx.model}, float32, CPU; {p['remove']} contiguous blocks removed; "
             f"calibration {p['calib'][0]} x {p['calib'][1]} tokens of `wiki-vital:calib` "
             f"(sha256 `{raw['ids_sha256'][:16]}`, checked by every job); test "
             f"{p['test'][0]} x {p['test'][1]} of `wiki-vital:test` (sha256 "
             f"`{raw['test_sha256'][:16]}`), every checkpoint reloaded and scored by "
             f"prunelab's evaluator; dense perplexity {fmt(sc['dense']['perplexity'], '.3f')}. "
             "PruneMe's time is its similarity pass plus the `mergekit-yaml` merge (a child "
             "process: its CPU time and peak RSS from `getrusage`); prunelab's the `prune` "
             "call (probe, cut, recovery). The three jobs ran at the same time, one process "
             "each, on core 1, which other jobs shared: CPU time is the figure to compare.",
             ""]
    ref = sc.get("PruneMe + mergekit", {})
    headers = ["side", "blocks removed", "params", "ppl", "KL", "top-1", "CPU s",
               "peak MiB", "ppl ratio to PruneMe", "gap"]
    rows = []
    for side, res in raw["results"].items():
        if "error" in res:
            lines.append(f"{side}: failed: `{res['error']}`")
            continue
        s = sc.get(side, {})
        if side.startswith("PruneMe"):
            cpu = res["similarity_cpu_seconds"] + res["merge_cpu_seconds"]
            peak = (f"{res['similarity_extra_peak'] / common.MiB:.0f} (merge process "
                    f"{res['merge_peak_rss'] / common.MiB:.0f} total)")
            g, rat = "", ""
        else:
            cpu, peak = res["cpu_seconds"], f"{res['extra_peak'] / common.MiB:.0f}"
            g = " ".join(x for x in (gap(s.get("perplexity"), ref.get("perplexity"), 0.001),
                                     gap(s.get("kl"), ref.get("kl"), 0.02)) if x) or "-"
            rat = ratio(s.get("perplexity"), ref.get("perplexity"))
        rows.append([side, _removed(side, res), fmt(s.get("params"), ","),
                     fmt(s.get("perplexity"), ".3f"), fmt(s.get("kl"), ".4f"),
                     fmt(s.get("top1"), ".3f"), fmt(cpu, ".1f"), peak, rat, g])
    lines.append(markdown_table(headers, rows))
    return "\n".join(lines)
