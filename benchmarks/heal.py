"""Healing after pruning on SmolLM2-135M: test perplexity before / after a short fine-tune,
for depth, sparsity and width pruning, and for pruning *while* tuning (REP-LIE, CascadeFlow).

Rows (``--rows``, comma-separated; default all):

* ``depth6-ce`` / ``depth6-kd`` / ``depth6-hidden``: remove 6 blocks (block influence,
  foldable recovery), then heal with cross-entropy / logit distillation / hidden-state MSE
  (the teacher is the dense model);
* ``wanda50``: 50 % Wanda, then heal (the zero pattern is kept: the row checks it);
* ``ffn20-wanda-sp``: ``prune width --unit ffn --score wanda-sp --budget remove-units:0.2``,
  then heal;
* ``ffn20-rep-lie``: heal with ``--prune rep-lie --unit ffn --budget remove-units:0.2`` from
  the dense model (pruning while tuning, 4 events of 5 %), same budget as the row above;
* ``depth6-bi``: remove 6 blocks by block influence (no recovery), then heal;
* ``span6-fold-ce`` / ``span6-ghost-ce``: remove the best span of 6 blocks by span angular
  with foldable (plain checkpoint) / ghost (remote code; the bridges stay frozen) recovery,
  the best training-free 6-block pipelines of docs/depth.md, then heal with cross-entropy;
* ``depth6-cascadeflow``: heal with ``--prune cascadeflow --budget remove-blocks:6`` from the
  dense model (one block per event), same budget.

Training text: ``wiki-vital:calib`` windows of ``--seqlen`` tokens (the last
``--heldout`` windows are kept apart for early stopping); test perplexity on the first
``--eval-samples`` windows of ``wiki-vital:test``. Every row gets ``--tokens`` training
tokens (``--loss`` for the rows that do not name one), LoRA rank 8, lr 2e-4 with warm-up
and cosine decay, held-out evaluation 4 times per run with patience 2. ``gap recovered`` is
``(ppl_pruned - ppl_healed) / (ppl_pruned - ppl_dense)``; wall time covers pruning and
healing. One process; a table on stdout, ``--json`` writes the rows.

Run::

    python benchmarks/heal.py [--tokens 65536] [--rows depth6-ce,wanda50] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch
import transformers

import prunelab
from prunelab.eval.perplexity import score_windows
from prunelab.heal import HealConfig, heal
from prunelab.models.loading import wrap
from prunelab.train.lora import zero_count

ROWS = ("depth6-ce", "depth6-kd", "depth6-hidden", "wanda50", "ffn20-wanda-sp",
        "ffn20-rep-lie", "depth6-bi", "depth6-cascadeflow", "span6-fold-ce", "span6-ghost-ce")


def prune_for(row: str):
    """The pruning config applied before healing (``None``: the row prunes while tuning)."""
    if row.startswith("depth6-") and row[7:] in ("ce", "kd", "hidden"):
        return prunelab.Depth(remove=6, probe="block-influence", recovery="foldable")
    if row == "wanda50":
        return prunelab.Wanda(sparsity=0.5)
    if row == "ffn20-wanda-sp":
        return prunelab.Width(unit="ffn", score="wanda-sp", ratio=0.2)
    if row == "depth6-bi":
        return prunelab.Depth(remove=6, probe="block-influence", recovery="none")
    if row in ("span6-fold-ce", "span6-ghost-ce"):
        return prunelab.Depth(remove=6, probe="span-angular", select="span",
                              recovery="foldable" if "fold" in row else "ghost")
    return None


def heal_config(row: str, args, steps: int) -> HealConfig:
    loss = row[7:] if row.startswith("depth6-") and row[7:] in ("ce", "kd", "hidden") \
        else args.loss
    every = max(1, steps // 4)
    extra = {}
    if row == "ffn20-rep-lie":
        extra = dict(prune="rep-lie", unit="ffn", ratio=0.2, prune_fraction=0.05,
                     prune_every=max(1, steps // 6))
    if row == "depth6-cascadeflow":
        extra = dict(prune="cascadeflow", remove=6, prune_every=max(1, steps // 8))
    return HealConfig(loss=loss, steps=steps, batch_size=args.batch_size, seqlen=args.seqlen,
                      eval_every=every, patience=2, seed=0, quiet=not args.verbose,
                      lr=args.lr, **extra)


def ppl(lm, ids, batch_size: int) -> float:
    return score_windows(lm, ids, batch_size=batch_size)["perplexity"]


def run_row(row: str, dense, data: dict, args) -> dict:
    steps = max(1, math.ceil(args.tokens / (args.batch_size * args.seqlen)))
    lm = wrap(copy.deepcopy(dense.model), dense.tokenizer, spec=dense.spec)
    start = time.perf_counter()
    cfg = prune_for(row)
    if cfg is not None:
        prunelab.prune(lm, cfg, data["calib"], batch_size=args.batch_size)
    pruned = ppl(lm, data["test"], args.batch_size) if cfg is not None else None
    zeros = zero_count(lm.model, lm.adapter)
    hcfg = heal_config(row, args, steps)
    teacher = dense if hcfg.needs_teacher else None
    lm, rec = heal(lm, teacher, data["train"], data["heldout"], hcfg)
    wall = time.perf_counter() - start
    healed = ppl(lm, data["test"], args.batch_size)
    dense_ppl = data["dense_ppl"]
    ref = pruned if pruned is not None else dense_ppl
    out = {"row": row, "loss": hcfg.loss, "blocks": lm.adapter.num_blocks,
           "ffn": lm.adapter.ffn_width(0), "params": sum(p.numel() for p in
                                                          lm.model.parameters()),
           "ppl_dense": dense_ppl, "ppl_pruned": pruned, "ppl_healed": healed,
           "gap_recovered": (pruned - healed) / (pruned - dense_ppl)
           if pruned is not None and pruned > dense_ppl else None,
           "heldout_before": rec["held_out"]["before"], "heldout_after":
           rec["held_out"]["after"], "best_step": rec["best_step"], "steps": rec["steps"],
           "tokens": rec["tokens"], "wall_seconds": wall, "heal_seconds": rec["wall_seconds"],
           "zeros_kept": zeros == rec["zeros_after"] if zeros else None,
           "ppl_vs_reference": healed - ref}
    if "prune" in rec:
        out["prune"] = {k: v for k, v in rec["prune"].items() if k != "events"}
    return out


def show(rows: list[dict]) -> None:
    head = (f"{'row':<20}{'loss':>7}{'blocks':>7}{'ffn':>6}{'ppl dense':>10}{'pruned':>9}"
            f"{'healed':>9}{'gap rec.':>9}{'steps':>6}{'tokens':>8}{'wall s':>8}")
    print(head)
    for r in rows:
        pruned = f"{r['ppl_pruned']:.2f}" if r["ppl_pruned"] is not None else "-"
        gap = f"{r['gap_recovered']:.0%}" if r["gap_recovered"] is not None else "-"
        print(f"{r['row']:<20}{r['loss']:>7}{r['blocks']:>7}{r['ffn']:>6}"
              f"{r['ppl_dense']:>10.2f}{pruned:>9}{r['ppl_healed']:>9.2f}{gap:>9}"
              f"{r['steps']:>6}{r['tokens']:>8}{r['wall_seconds']:>8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=65536, help="training tokens per row")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--loss", default="ce", help="loss of the rows that do not name one")
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default: HealConfig's, 2e-4 with LoRA)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--heldout", type=int, default=8, help="calib windows for early stopping")
    ap.add_argument("--eval-samples", type=int, default=32, help="wiki-vital:test windows")
    ap.add_argument("--test-seqlen", type=int, default=None,
                    help="test window length (default: --seqlen; 512 is docs/depth.md's)")
    ap.add_argument("--calib-samples", type=int, default=32, help="pruning calibration")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--verbose", action="store_true", help="progress of each heal")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prunelab.log.set_quiet(not args.verbose)
    torch.manual_seed(0)
    dense = prunelab.load(args.model, dtype="float32", device=args.device)
    windows = prunelab.api.tokens_for(dense, "wiki-vital:calib", seqlen=args.seqlen,
                                      mode="test").input_ids
    data = {"train": windows[:-args.heldout], "heldout": windows[-args.heldout:],
            "calib": prunelab.api.tokens_for(dense, "wiki-vital:calib", seqlen=args.seqlen,
                                             samples=args.calib_samples, mode="calib"),
            "test": prunelab.api.tokens_for(dense, "wiki-vital:test",
                                            seqlen=args.test_seqlen or args.seqlen,
                                            samples=args.eval_samples,
                                            mode="test").input_ids}
    data["dense_ppl"] = ppl(dense, data["test"], args.batch_size)
    print(f"{args.model}: {len(data['train'])} training windows of {args.seqlen} tokens, "
          f"{args.tokens} tokens per row, test ppl dense {data['dense_ppl']:.2f}")
    results = []
    for row in rows:  # each row is kept as soon as it ends (a long run can be stopped)
        results.append(run_row(row, dense, data, args))
        print(f"done {row}: healed ppl {results[-1]['ppl_healed']:.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2)
    show(results)


if __name__ == "__main__":
    main()
