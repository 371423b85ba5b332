"""Three real models side by side: dense quality, swap-probe agreement, 20 % depth pruning.

For each embedded model (``smollm2-135m``: LLaMA, 30 blocks; ``gemma3-270m``: Gemma 3,
18 blocks with 5 sliding + 1 global attention; ``minilm-l6``: a 6-block BERT sentence
encoder) this prints:

* dense quality: test perplexity on ``wiki-vital:test`` windows (decoders; Gemma's windows
  start with its BOS) or, for the encoder, the same-document nearest-neighbour rate of
  mean-pooled sentence embeddings (:mod:`prunelab.eval.embedding`);
* the Spearman rank correlation between the interchange and the replacement probe over
  the adjacent pairs ``(i, i+1)`` ("No Free Swap": the two swap protocols; both measured on
  the calibration windows as KL of next-token distributions at the last position, or
  1 - cos of mean-pooled final hidden states for the encoder);
* quality after removing ``round(fraction * L)`` blocks (at least 1; default 20 %, no
  recovery) chosen by block influence (ShortGPT, one-shot) and by interchange
  (no-adjacent, ``r(l) = min(d(l, l-1), d(l, l+1))``): test perplexity and KL to dense
  for decoders; mean cosine to dense, NN agreement and same-document NN for the encoder.

Speed figures are wall-clock seconds per model on this machine (they include the probes,
the two prunings and three evaluations).

Run::

    python benchmarks/cross_architecture.py [--models smollm2-135m,gemma3-270m,minilm-l6]
        [--calib-samples 4 --calib-seqlen 128] [--test-samples 4 --test-seqlen 256]
        [--sentences 256] [--fraction 0.2] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import transformers
from scipy.stats import spearmanr

import prunelab
from prunelab.data import make_batches
from prunelab.eval.embedding import sentence_batch
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext
from prunelab.probes.base import make_config, options_for
from prunelab.pruning import Depth
from prunelab.pruning.depth.config import select
from prunelab.pruning.depth.surgery import prune_depth

MODELS = ("smollm2-135m", "gemma3-270m", "minilm-l6")


def quality(lm, test, dense, cache, batch_size) -> dict:
    res = prunelab.evaluate(lm, test, reference=dense, reference_cache=cache,
                            batch_size=batch_size)
    keys = ("same_document_nn", "mean_cosine_to_reference", "nn_agreement") if lm.is_encoder \
        else ("perplexity", "kl_to_reference", "top1_agreement")
    return {k: res[k] for k in keys}


def run_model(name: str, args) -> dict:
    start = time.perf_counter()
    lm = prunelab.load(name)
    n_blocks = lm.adapter.num_blocks
    n_remove = max(1, round(args.fraction * n_blocks))
    calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=args.calib_seqlen,
                         samples=args.calib_samples, seed=args.seed)
    if lm.is_encoder:
        test = sentence_batch(lm.tokenizer, "wiki-vital:test", samples=args.sentences,
                              max_length=128)
        eval_bs = 32
    else:
        test = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=args.test_seqlen,
                            samples=args.test_samples)
        eval_bs = 2
    cache: dict = {}
    row = {"model": name, "blocks": n_blocks, "removed": n_remove,
           "data": {"calib": calib.to_dict(), "test": test.to_dict()}}
    row["dense"] = quality(lm, test, lm, cache, eval_bs)
    ctx = ProbeContext(lm, calib.input_ids, batch_size=args.calib_samples, lazy=True)
    try:
        probes = {}
        for probe in ("block-influence", "interchange", "replacement"):
            cfg = make_config(probe, **options_for(probe, window=1))
            probes[probe] = cfg.run(ctx)
        inter = {tuple(s["layers"]): s["value"] for s in probes["interchange"].scores}
        repl = {tuple(s["layers"]): s["value"] for s in probes["replacement"].scores}
        pairs = sorted(inter)
        rho = spearmanr([inter[p] for p in pairs], [repl[p] for p in pairs]).statistic
        row["interchange_vs_replacement_spearman"] = float(rho)
        row["adjacent_pairs"] = len(pairs)
        for probe in ("block-influence", "interchange"):
            work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=name)
            cfg = Depth(remove=n_remove, probe=probe)
            removed, how = select(lm, cfg, ctx, n_remove, result=probes[probe])
            prune_depth(work, cfg, calib.input_ids, batch_size=args.calib_samples, ctx=ctx,
                        removed=removed)
            row[probe] = {"removed_blocks": removed, "strategy": how["strategy"],
                          **quality(work, test, lm, cache, eval_bs)}
            del work
    finally:
        ctx.close()
    row["seconds"] = time.perf_counter() - start
    return row


def _fmt(row: dict, key: str) -> str:
    enc = "mean_cosine_to_reference" in row["dense"]
    d = row[key]
    if key == "dense":
        return f"same-doc NN {d['same_document_nn']:.3f}" if enc else f"ppl {d['perplexity']:.2f}"
    if enc:
        return (f"cos {d['mean_cosine_to_reference']:.3f}, NN agr {d['nn_agreement']:.3f}, "
                f"same-doc NN {d['same_document_nn']:.3f} {d['removed_blocks']}")
    return f"ppl {d['perplexity']:.2f}, KL {d['kl_to_reference']:.3f} {d['removed_blocks']}"


def table(rows: list[dict]) -> str:
    lines = ["| model | blocks (removed) | dense | interchange vs replacement Spearman "
             "(adjacent pairs) | removed by block influence | removed by interchange | "
             "seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['blocks']} ({r['removed']}) | {_fmt(r, 'dense')} | "
                     f"{r['interchange_vs_replacement_spearman']:.3f} ({r['adjacent_pairs']}) | "
                     f"{_fmt(r, 'block-influence')} | {_fmt(r, 'interchange')} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--calib-samples", type=int, default=4)
    p.add_argument("--calib-seqlen", type=int, default=128)
    p.add_argument("--test-samples", type=int, default=4)
    p.add_argument("--test-seqlen", type=int, default=256)
    p.add_argument("--sentences", type=int, default=256, help="encoder test sentences")
    p.add_argument("--fraction", type=float, default=0.2, help="share of blocks removed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    transformers.logging.set_verbosity_error()
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        rows.append(run_model(name, args))
        print(f"{name}: done in {rows[-1]['seconds']:.0f} s", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
