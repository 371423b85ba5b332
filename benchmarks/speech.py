"""Whisper encoder pruning by leave-one-layer-out WER, zero-shot and distilled.

For each model (``--models``, default the embedded ``whisper-tiny-en`` and ``whisper-base``):

1. dense WER (greedy ``generate``) and real-time factor on the evaluation set
   (``speech:test:N``: the pyannote sample, CMU ARCTIC a0007 and N synthesised held-out
   sentences);
2. ``probe --probe leave-one-out --metric wer`` on calibration speech
   (``speech:synth-calib:M``, never the evaluation sentences): the WER change of removing
   each encoder layer alone;
3. for n = 1, 2 (``--removes``): the n layers with the smallest WER change removed
   (``prune depth --stack encoder --blocks ...``), WER zero-shot, then the encoder
   distilled from the dense one on unlabelled synthesised speech
   (:mod:`prunelab.train.encoder_distill`, ``--distill-steps``), WER again; RTF of each.

Run (one thread; measured 21 min for tiny.en and 28 min for base on a heavily shared
2-core machine at the defaults)::

    OMP_NUM_THREADS=1 python benchmarks/speech.py [--models whisper-tiny-en]
        [--eval-sentences 8] [--loo-sentences 8] [--distill-steps 20]
        [--distill-sentences 32] [--json out.json]

``run(args) -> dict`` is importable (``benchmarks/vision_speech.py`` calls it).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import prunelab
from prunelab.data.speech import feature_batches, load_speech
from prunelab.eval.speech import speech_scores
from prunelab.probes.ablation import LeaveOneOut
from prunelab.pruning import Depth
from prunelab.train.encoder_distill import EncoderDistill, distill_encoder


def _scores(lm, data) -> dict:
    r = speech_scores(lm, data)
    return {k: r[k] for k in ("wer", "wer_real", "wer_synthetic", "real_time_factor")
            if k in r}


def one_model(name: str, args) -> dict:
    t0 = time.perf_counter()
    dense = prunelab.load(name, stack="encoder")
    test = load_speech(f"speech:test:{args.eval_sentences}")
    out: dict = {"model": name, "encoder_layers": dense.adapter.num_blocks,
                 "eval_data": test.to_dict(), "dense": _scores(dense, test)}
    print(f"{name}: dense {out['dense']}", flush=True)
    loo = prunelab.probe(dense, LeaveOneOut(metric="wer", metric_data=f"speech:synth-calib:"
                                            f"{args.loo_sentences}"),
                         data=feature_batches(dense, "speech:synth-calib:2"), bootstrap=0)
    out["loo"] = [{"layer": s["layers"][0], "wer_without": s["metric"],
                   "wer_change": s["value"]} for s in loo.scores]
    out["loo_dense_wer"] = loo.scores[0]["dense"]
    order = [s["layers"][0] for s in sorted(loo.scores, key=lambda s: s["value"])]
    print(f"{name}: LOO by WER {out['loo']}", flush=True)
    out["pruned"] = []
    for n in args.removes:
        lm = copy.deepcopy(dense)
        blocks = tuple(sorted(order[:n]))
        prunelab.prune(lm, Depth(blocks=blocks), data=feature_batches(lm, "speech:synth-calib:2"))
        row = {"removed": list(blocks), "encoder_layers": lm.adapter.num_blocks,
               "encoder_params_kept": _encoder_params(lm) / _encoder_params(dense),
               "zero_shot": _scores(lm, test)}
        row["distill"] = distill_encoder(lm, dense, EncoderDistill(
            steps=args.distill_steps, sentences=args.distill_sentences))
        row["distilled"] = _scores(lm, test)
        print(f"{name}: -{n} {row}", flush=True)
        out["pruned"].append(row)
        del lm
    out["seconds"] = time.perf_counter() - t0
    return out


def _encoder_params(lm) -> int:
    return sum(p.numel() for p in lm.model.model.encoder.parameters())


def table(results: list[dict]) -> str:
    """Markdown table of :func:`run`'s results."""
    lines = ["| model | encoder layers removed (0-based) | encoder params kept | WER | "
             "WER real clips | WER synthetic | RTF |", "|---|---|---|---|---|---|---|"]

    def fmt(r, key):
        return f"{r[key]:.3f}" if key in r else "-"

    for res in results:
        d = res["dense"]
        lines.append(f"| {res['model']} | none (dense, {res['encoder_layers']}) | 100.0% | "
                     f"{fmt(d, 'wer')} | {fmt(d, 'wer_real')} | {fmt(d, 'wer_synthetic')} | "
                     f"{fmt(d, 'real_time_factor')} |")
        for p in res["pruned"]:
            for kind in ("zero_shot", "distilled"):
                s = p[kind]
                lines.append(f"| {res['model']} | {p['removed']} {kind.replace('_', '-')} | "
                             f"{p['encoder_params_kept']:.1%} | {fmt(s, 'wer')} | "
                             f"{fmt(s, 'wer_real')} | {fmt(s, 'wer_synthetic')} | "
                             f"{fmt(s, 'real_time_factor')} |")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="whisper-tiny-en,whisper-base")
    ap.add_argument("--removes", default="1,2")
    ap.add_argument("--eval-sentences", type=int, default=8)
    ap.add_argument("--loo-sentences", type=int, default=8)
    ap.add_argument("--distill-steps", type=int, default=20)
    ap.add_argument("--distill-sentences", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.removes = [int(x) for x in args.removes.split(",")]
    return args


def run(args) -> dict:
    torch.manual_seed(0)
    results = []
    for name in args.models.split(","):
        results.append(one_model(name.strip(), args))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"results": results, "threads": torch.get_num_threads()}, fh,
                          indent=1)
    return {"results": results, "table": table(results)}


if __name__ == "__main__":
    print(run(parse())["table"])
