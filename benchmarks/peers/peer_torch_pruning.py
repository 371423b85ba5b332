"""Peer: Torch-Pruning 1.6.1 (its LLM example's settings), heads and FFN channels, against
prunelab's width pruning with and without compensation.

For each ratio (0.2 and 0.5: the fraction of heads and FFN channels Torch-Pruning removes
in every block, ``pruning_ratio = head_pruning_ratio``; see ``worker_torch_pruning.py`` for
the settings and the one change from the example), Torch-Pruning runs first in its venv
(``.bench/peers/torch-pruning-venv``: torch 2.13.0 CPU, torch-pruning 1.6.1, transformers
as prunelab's); the parameter count its checkpoint keeps is then prunelab's budget
(``Width(target_params=N)``: the same size), for ``Width(unit="ffn", score="wanda-sp")``
plain and with ``compensate=True`` (least-squares refit of ``down_proj``), on
``wiki-vital:calib`` windows whose sha256 both sides check (Torch-Pruning's importance is
data-free: it only traces the graph on the first 16 of those tokens). All checkpoints are
reloaded from disk and scored by one evaluator (:func:`scoring.score_dirs`): perplexity,
KL to the dense model and top-1 agreement on the same ``wiki-vital:test`` windows.
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

NAME = "torch-pruning"
PIN = "torch-pruning==1.6.1"
HERE = Path(__file__).resolve().parent
#: (row, prunelab width score, compensate): prunelab's calibrated default plain and with
#: compensation, its data-free score (the same information as Torch-Pruning's), and the
#: hand-written replica of Torch-Pruning's criterion (a check of the peer, not a method;
#: only where Torch-Pruning kept every head)
SIDES = (("prunelab", "wanda-sp", False), ("prunelab+comp", "wanda-sp", True),
         ("prunelab data-free", "magnitude-profile", False),
         ("group-L2 by hand", "group-l2-by-hand", False))


def protocol(quick: bool) -> dict:
    if quick:
        return {"ratios": (0.2,), "calib": (4, 128), "test": (2, 128)}
    return {"ratios": (0.2, 0.5), "calib": (32, 256), "test": (8, 512)}


def run(ctx) -> tuple[str, dict]:
    import transformers

    import prunelab
    from prunelab.data import make_batches

    proto = protocol(ctx.quick)
    if ctx.ratios:
        proto["ratios"] = tuple(ctx.ratios)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        py, versions = common.ensure_venv(
            "torch-pruning", [PIN, f"transformers=={transformers.__version__}", "psutil"],
            ["torch_pruning", "torch", "transformers", "psutil"])
    except RuntimeError as exc:
        return _head(ctx, started) + f"\n\nNot run: {exc}", {"error": str(exc)}
    lm = prunelab.load(ctx.model, dtype="float32", device="cpu")
    (cn, cs), (tn, ts) = proto["calib"], proto["test"]
    calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=cs, samples=cn, seed=0)
    test = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=ts, samples=tn)
    model_dir = str(lm.source)
    dense_heads = lm.model.config.num_attention_heads
    del lm
    workdir = ctx.workdir / NAME
    workdir.mkdir(parents=True, exist_ok=True)
    sha = common.save_ids(workdir / "calib.ids.npy", calib.input_ids)
    results, dirs = {}, {}
    for r in proto["ratios"]:
        tag = f"r{r:g}"
        tp_dir = str(workdir / f"tp-{tag}")
        theirs = common.run_worker(py, HERE / "worker_torch_pruning.py",
                                   {"model_dir": model_dir, "ids": str(workdir / "calib.ids.npy"),
                                    "ids_sha256": sha, "ratio": r, "save_dir": tp_dir},
                                   workdir, f"tp-{tag}")
        row = {"torch-pruning": theirs}
        if "error" not in theirs:
            common.check_result_ids(theirs, sha, "torch-pruning")
            dirs[f"{tag}/torch-pruning"] = tp_dir
            specs = {}
            for side, score, comp in SIDES:
                if score == "group-l2-by-hand" and theirs["heads"] != dense_heads:
                    continue  # the hand check redoes FFN-only pruning
                specs[side] = {"model": ctx.model, "ids_sha256": sha,
                               "calib": {"source": "wiki-vital:calib", "seqlen": cs,
                                         "samples": cn},
                               "target_params": theirs["params_after"], "unit": "ffn",
                               "score": score, "compensate": comp,
                               "ffn_width": theirs["intermediate"],
                               "save_dir": str(workdir / f"{side}-{tag}")}
            with ThreadPoolExecutor(2) as pool:  # two processes at once
                futures = {side: pool.submit(common.run_worker, sys.executable,
                                             HERE / "worker_width.py", spec, workdir,
                                             f"{side}-{tag}")
                           for side, spec in specs.items()}
                for side, f in futures.items():
                    row[side] = f.result()
                    if "error" not in row[side]:
                        common.check_result_ids(row[side], sha, side)
                        dirs[f"{tag}/{side}"] = row[side]["save_dir"]
        results[tag] = row
    scores = scoring.score_dirs(ctx.model, test, dirs)
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    raw = {"protocol": proto, "ids_sha256": sha, "test_sha256": test.sha256,
           "results": results, "scores": scores, "venv_versions": versions}
    return section(ctx, started, raw), raw


def _head(ctx, started) -> str:
    return "\n".join([f"## Torch-Pruning ({PIN.split('==')[1]}): heads and FFN channels", "",
                      f"Run {started}, commit `{ctx.commit}`, {ctx.machine}; command: "
                      f"`{ctx.command}`."])


def section(ctx, started, raw) -> str:
    p, sc = raw["protocol"], raw["scores"]
    lines = [_head(ctx, started), "",
             f"{ctx.model}, float32, CPU. Torch-Pruning with its LLM example's settings "
             "(`GroupNormImportance(p=2, group_reduction='mean')`, data-free; local "
             "pruning; `pruning_ratio = head_pruning_ratio = R`; whole heads, head dims "
             "kept; `round_to=4`; LM head ignored); unlike the example the hidden size is "
             "kept (`embed_tokens`, `o_proj`, `down_proj` ignored as roots), so both sides "
             "prune inside the blocks only. prunelab: `Width(unit='ffn', score='wanda-sp', "
             "target_params=N)` with N the parameter count Torch-Pruning's checkpoint keeps, "
             "plain and with `compensate=True`, and `score='magnitude-profile'` (prunelab "
             "data-free: weights only, like Torch-Pruning's criterion), calibrated on "
             f"{p['calib'][0]} x {p['calib'][1]} tokens of `wiki-vital:calib` (sha256 "
             f"`{raw['ids_sha256'][:16]}`, checked by every job). All checkpoints reloaded "
             f"and scored by prunelab's evaluator on {p['test'][0]} x {p['test'][1]} tokens "
             f"of `wiki-vital:test` (sha256 `{raw['test_sha256'][:16]}`); dense perplexity "
             f"{fmt(sc['dense']['perplexity'], '.3f')}, {fmt(sc['dense']['params'], ',')} "
             "parameters. Time and peak RSS: the pruning call (Torch-Pruning: building the "
             "dependency graph and pruning), each in a fresh process; CPU time is the figure "
             "to compare. group-L2 by hand: a check of the peer, not a method: Torch-"
             "Pruning's criterion written from its definition in this harness (each FFN "
             "channel's squared L2 norm over its gate / up rows and down column, averaged; "
             "the same width kept in every block), run where Torch-Pruning kept every head; "
             "if it scores as Torch-Pruning's checkpoint, the tool did what its criterion "
             "says and the criterion is what fails here.", ""]
    headers = ["R", "side", "shape (heads / kv / FFN)", "params kept", "ppl", "KL", "top-1",
               "CPU s", "peak MiB", "ppl ratio pl/TP", "KL ratio pl/TP", "gap"]
    rows = []
    for tag, row in raw["results"].items():
        tp = row["torch-pruning"]
        s_tp = sc.get(f"{tag}/torch-pruning", {})
        for side in ("torch-pruning", *(x[0] for x in SIDES)):
            res = row.get(side)
            if res is None:
                continue
            if "error" in res:
                lines.append(f"R {tag[1:]}, {side}: failed: `{res['error']}`")
                continue
            s = sc.get(f"{tag}/{side}", {})
            shape = (f"{tp['heads']} / {tp['kv_heads']} / {tp['intermediate']}"
                     if side == "torch-pruning"
                     else f"all kept / {res.get('ffn', ['?'])[0]}")
            ours = side not in ("torch-pruning", "group-L2 by hand")
            g = " ".join(x for x in (gap(s.get("perplexity"), s_tp.get("perplexity"), 0.001),
                                     gap(s.get("kl"), s_tp.get("kl"), 0.02)) if x) \
                if ours else ""
            rows.append([tag[1:], side, shape, f"{res['params_after']:,}",
                         fmt(s.get("perplexity"), ".3f"), fmt(s.get("kl"), ".4f"),
                         fmt(s.get("top1"), ".3f"), fmt(res.get("cpu_seconds"), ".1f"),
                         fmt(res["extra_peak"] / common.MiB, ".0f"),
                         ratio(s.get("perplexity"), s_tp.get("perplexity")) if ours else "",
                         ratio(s.get("kl"), s_tp.get("kl")) if ours else "", g or "-"])
    lines.append(markdown_table(headers, rows))
    for tag, row in raw["results"].items():
        tp = row["torch-pruning"]
        if "error" not in tp:
            failed = [a["error"] for a in tp.get("attempts", []) if "error" in a]
            lines.append(f"\nR {tag[1:]}: Torch-Pruning's checkpoint has {tp['heads']} query / "
                         f"{tp['kv_heads']} key-value heads and FFN width {tp['intermediate']} "
                         f"(uniform over blocks: {tp['uniform']}; importance "
                         f"`{tp.get('importance')}`; perplexity on the calibration windows "
                         f"in its own venv before saving "
                         f"{fmt(tp.get('pruned_calib_ppl_in_venv'), '.1f')})"
                         + (f"; pruning heads failed first: `{failed[0]}`, so this row is "
                            "FFN channels only" if failed else "") + ".")
            hand, s_tp = sc.get(f"{tag}/group-L2 by hand"), sc.get(f"{tag}/torch-pruning")
            if hand and s_tp and hand.get("perplexity") and s_tp.get("perplexity"):
                rel = abs(hand["perplexity"] / s_tp["perplexity"] - 1)
                lines.append(f"\nHand check at R {tag[1:]}: the hand-written criterion's "
                             f"checkpoint scores perplexity {hand['perplexity']:.3f}, "
                             f"Torch-Pruning's {s_tp['perplexity']:.3f} (relative difference "
                             f"{rel:.1e}): " + ("the same channels, so Torch-Pruning applied "
                                               "its criterion as defined." if rel < 1e-4
                                               else "they differ."))
    return "\n".join(lines)
