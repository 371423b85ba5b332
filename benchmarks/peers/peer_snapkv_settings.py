"""prunelab only: SnapKV's settings on the kvpress section's windows (issue 42, item 4).

prunelab's SnapKV and kvpress' ``SnapKVPress`` are the same algorithm with different
defaults: prunelab's observation window was 32 prompt queries with max pooling of the
scores (the SnapKV paper's code), kvpress' is 64 queries with mean pooling (kernel 5 on
both). The kvpress section compares the two tools at kvpress' settings; this section
measures the four combinations of ``window`` (32, 64) and ``pooling`` (max, mean) with
prunelab alone, on the same windows (``peer_kvpress.protocol``: 6 x (1,024 + 64) tokens of
``wiki-vital:test``, the same token ids, hash-checked), the same scoring code
(``continuation.run_presses`` in ``worker_press.py``, one fresh process) and the same
pass-key prompts, so the default can be chosen on the figures, not on either tool's habit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import common
import peer_kvpress
from table import fmt, markdown_table

NAME = "snapkv-settings"
SETTINGS = ((32, "max"), (32, "mean"), (64, "max"), (64, "mean"))


def label(window: int, pooling: str) -> str:
    return f"snapkv w{window} {pooling}"


def run(ctx) -> tuple[str, dict]:
    from prunelab.inference import SnapKV

    proto = peer_kvpress.protocol_of(ctx)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    workdir = ctx.workdir / NAME
    jobs = [["snapkv", r, {"window": w, "pooling": p}, label(w, p)]
            for r in proto["ratios"] for w, p in SETTINGS]
    spec, keys, tokenizer = peer_kvpress.prepare(ctx, proto, workdir, jobs)
    sha, needle_sha = spec["ids_sha256"], spec["needles_sha256"]
    print(f"{NAME}: {len(jobs)} settings x {proto['windows']} windows; ids sha256 "
          f"{sha[:12]}", flush=True)
    here = Path(__file__).resolve().parent
    res = common.run_worker(sys.executable, here / "worker_press.py", spec, workdir,
                            "prunelab", env=common.EXACT_RSS)
    if "error" not in res:
        common.check_result_ids(res, sha, "prunelab")
        peer_kvpress.score_needles(tokenizer, res, keys)
    default = SnapKV()
    raw = {"protocol": proto, "ids_sha256": sha, "needles_sha256": needle_sha, "keys": keys,
           "prunelab": res, "started": started, "commit": ctx.commit,
           "default": {"window": default.window, "pooling": default.pooling}}
    return section(ctx, proto, started, res, sha, (default.window, default.pooling)), raw


def section(ctx, proto, started, res: dict, sha: str, default: tuple[int, str]) -> str:
    out = ["## SnapKV settings (prunelab alone, the kvpress section's windows)", "",
           f"Run {started}, commit `{ctx.commit}`, {ctx.machine}; command: `{ctx.command}`.",
           "",
           f"{ctx.model}, float32, CPU; the kvpress section's protocol: {proto['windows']} "
           f"windows of {proto['prompt']:,} prompt + {proto['continuation']} continuation "
           f"tokens (token ids sha256 `{sha[:16]}`), the same scoring code and pass-key "
           "prompts. SnapKV's observation window (`--press-window`) and score pooling "
           "(`--press-pooling`), kernel 5. prunelab's default at this commit: window "
           f"{default[0]}, {default[1]} pooling; kvpress' (0.5.5): window 64, mean "
           "pooling.", ""]
    if "error" in res:
        return "\n".join(out + [f"Failed: `{res['error']}` (log `{res.get('log')}`)"])
    rows, by = [], {}
    for r in res["rows"]:
        if r["press"] == "dense":
            continue
        by[(r["press"], r["ratio"])] = r
    n_needles = len(proto["needle_lengths"]) * len(proto["needle_depths"])
    for ratio in proto["ratios"]:
        best = min((by[(label(w, p), ratio)]["continuation_kl"]
                    for w, p in SETTINGS if "error" not in by.get((label(w, p), ratio),
                                                                 {"error": 1})),
                   default=None)
        for w, p in SETTINGS:
            r = by.get((label(w, p), ratio), {"error": "not run"})
            if "error" in r:
                rows.append([w, p, f"{ratio:.2f}", f"failed: `{r['error']}`", "-", "-", "-"])
                continue
            hits = r.get("needle_hits")
            mark = " (lowest)" if best is not None and r["continuation_kl"] == best else ""
            rows.append([w, p, f"{ratio:.2f}", fmt(r["continuation_perplexity"], ".3f"),
                         fmt(r["continuation_kl"], ".4f") + mark,
                         fmt(r["continuation_top1"], ".3f"),
                         f"{sum(hits)} / {len(hits)}" if hits else "-"])
    dense = next((r for r in res["rows"] if r["press"] == "dense"), {})
    dense_ppl = next((r["dense_continuation_perplexity"] for r in res["rows"]
                      if "dense_continuation_perplexity" in r), None)
    out.append(f"Dense continuation perplexity {fmt(dense_ppl, '.3f')}; dense pass-key hits "
               + (f"{sum(dense['needle_hits'])} / {len(dense['needle_hits'])}"
                  if dense.get("needle_hits") else f"- (of {n_needles})") + ".")
    out.append("")
    out.append(markdown_table(["window", "pooling", "removed", "continuation ppl",
                               "continuation KL", "top-1", "pass-key hits"], rows))
    mean_kl = {}
    for w, p in SETTINGS:
        kls = [by[(label(w, p), r)]["continuation_kl"] for r in proto["ratios"]
               if "error" not in by.get((label(w, p), r), {"error": 1})]
        if len(kls) == len(proto["ratios"]):
            mean_kl[(w, p)] = sum(kls) / len(kls)
    if mean_kl:
        out += ["", "Mean continuation KL over the ratios: " + "; ".join(
            f"window {w} {p} {v:.4f}" for (w, p), v in sorted(mean_kl.items(),
                                                              key=lambda kv: kv[1])) + "."]
    return "\n".join(out)
