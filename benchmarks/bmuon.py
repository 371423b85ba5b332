"""AdamW vs Muon vs BMuon: does the optimizer make MLP channel pruning hurt less?

A LLaMA-style model (byte-level vocabulary of 256, ``--hidden``/``--layers``/``--ffn``;
default about 3 M parameters) is trained from scratch on the embedded corpus
(``wiki-vital:calib`` text as bytes) with each optimizer for the same steps and tokens
(Muon / BMuon on the blocks' 2-D weights, AdamW on embeddings, norms and head, as Jordan
et al. 2024 recommend), then its MLP channels are pruned after training at 25 / 50 / 75 %
(global across blocks, at least one channel per block kept, no recovery): by weight
magnitude (a channel's L2 norm over its gate / up rows and down column) for every model,
and for BMuon also by its own allocation surrogate ``u`` (:mod:`prunelab.train.bmuon`).
Held-out perplexity (``wiki-vital:test`` bytes) before and after.

``--taper S`` also trains a tapered-width model (CascadeFormer seed: block ``i`` keeps
``ffn (1 + S (1/2 - x_i))`` channels, the same MLP parameters as the uniform one) with
AdamW, for the architecture comparison of issue 17.

Seeds' claims to check: Muon degrades more than AdamW under channel pruning; BMuon less
than Muon; BMuon's allocation is a better criterion than magnitude.

Run (the lead's machine; minutes on 2 cores)::

    python benchmarks/bmuon.py [--steps 600 --batch 16 --seqlen 128] [--taper 0.5]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import transformers as tf

from prunelab.data.sources import load_text_source
from prunelab.models.loading import wrap
from prunelab.train.bmuon import BMuon, channel_surrogate, mlp_channel_groups


def byte_ids(spec: str, limit: int) -> torch.Tensor:
    src = load_text_source(spec)
    data = src.joiner.join(src.documents).encode("utf-8", "replace")[:limit]
    return torch.tensor(list(data), dtype=torch.long)


def windows(ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    n = len(ids) // seqlen
    return ids[:n * seqlen].view(n, seqlen)


def build(args, widths: list[int] | None = None):
    torch.manual_seed(args.seed)
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
                         intermediate_size=max(widths) if widths else args.ffn,
                         max_position_embeddings=args.seqlen, tie_word_embeddings=True)
    lm = wrap(tf.LlamaForCausalLM(cfg))
    if widths:
        for i, w in enumerate(widths):
            lm.adapter.slice_ffn(i, list(range(w)))
    return lm


def optimizers(lm, kind: str, args):
    named = list(lm.model.named_parameters())
    mats = [p for n, p in named if p.ndim == 2 and ".layers." in n]
    rest = [p for n, p in named if not (p.ndim == 2 and ".layers." in n)]
    if kind == "adamw":
        return [torch.optim.AdamW(mats + rest, lr=args.adam_lr, weight_decay=0.1)]
    adam = torch.optim.AdamW(rest, lr=args.adam_lr, weight_decay=0.1)
    if kind == "muon":
        return [torch.optim.Muon(mats, lr=args.muon_lr, weight_decay=0.1), adam]
    total = sum(lm.adapter.ffn_width(i) for i in range(lm.adapter.num_blocks))
    return [BMuon(mats, mlp_channel_groups(lm), budget=int(args.bmuon_keep * total),
                  lr=args.muon_lr, weight_decay=0.1, curvature=args.curvature), adam]


def train(lm, kind: str, train_w: torch.Tensor, args):
    opts = optimizers(lm, kind, args)
    gen = torch.Generator().manual_seed(args.seed)
    lm.model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        ids = train_w[torch.randint(len(train_w), (args.batch,), generator=gen)]
        loss = lm.model(input_ids=ids, labels=ids, use_cache=False).loss
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        if step % max(args.steps // 5, 1) == 0:
            print(f"  {kind} step {step}: loss {float(loss.detach()):.3f}", flush=True)
    lm.model.eval()
    return opts, time.perf_counter() - start


@torch.no_grad()
def perplexity(lm, test_w: torch.Tensor) -> float:
    losses = [float(lm.model(input_ids=b, labels=b, use_cache=False).loss)
              for b in test_w.split(16)]
    return math.exp(sum(losses) / len(losses))


def magnitude(lm) -> list[torch.Tensor]:
    out = []
    for i in range(lm.adapter.num_blocks):
        p = lm.adapter.mlp_projections(i)
        s = p["down"].weight.detach().pow(2).sum(0)
        for r in ("gate", "up"):
            s = s + p[r].weight.detach().pow(2).sum(1)
        out.append(s.sqrt())
    return out


def prune_channels(lm, scores: list[torch.Tensor], fraction: float) -> None:
    """Remove ``fraction`` of all MLP channels, lowest score first over all blocks (each
    block keeps its best channel)."""
    flat = sorted((float(s), i, c) for i, v in enumerate(scores) for c, s in enumerate(v))
    drop = int(round(fraction * len(flat)))
    gone = [set() for _ in scores]
    for _, i, c in flat:
        if drop == 0:
            break
        if len(gone[i]) < len(scores[i]) - 1:
            gone[i].add(c)
            drop -= 1
    for i, g in enumerate(gone):
        lm.adapter.slice_ffn(i, [c for c in range(len(scores[i])) if c not in g])


def evaluate_pruning(lm, kind: str, criteria: dict, test_w, args) -> list[dict]:
    import copy

    rows = [{"optimizer": kind, "criterion": "-", "pruned": 0.0,
             "perplexity": perplexity(lm, test_w)}]
    for name, scores in criteria.items():
        for frac in args.fractions:
            small = wrap(copy.deepcopy(lm.model))
            prune_channels(small, scores, frac)
            rows.append({"optimizer": kind, "criterion": name, "pruned": frac,
                         "perplexity": perplexity(small, test_w)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--adam-lr", type=float, default=3e-3)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--bmuon-keep", type=float, default=0.5,
                    help="BMuon budget: fraction of all MLP channels allocated")
    ap.add_argument("--curvature", type=float, default=1.0)
    ap.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.25, 0.5, 0.75])
    ap.add_argument("--taper", type=float, default=None)
    ap.add_argument("--optimizers", default="adamw,muon,bmuon")
    ap.add_argument("--train-bytes", type=int, default=4_000_000)
    ap.add_argument("--test-bytes", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    train_w = windows(byte_ids("wiki-vital:calib", args.train_bytes), args.seqlen)
    test_w = windows(byte_ids("wiki-vital:test", args.test_bytes), args.seqlen)
    rows, times = [], {}
    for kind in args.optimizers.split(","):
        lm = build(args)
        opts, times[kind] = train(lm, kind, train_w, args)
        criteria = {"magnitude": magnitude(lm)}
        if kind == "bmuon":
            bm = opts[0]
            criteria["allocation"] = bm.u if bm.u is not None else [
                channel_surrogate(g, bm.curvature) for g in bm.groups]
        rows += evaluate_pruning(lm, kind, criteria, test_w, args)
    if args.taper is not None:
        n = args.layers
        widths = [max(8, round(args.ffn * (1 + args.taper * (0.5 - i / max(n - 1, 1)))))
                  for i in range(n)]
        lm = build(args, widths)
        _, times["adamw-taper"] = train(lm, "adamw", train_w, args)
        rows.append({"optimizer": f"adamw-taper{widths}", "criterion": "-", "pruned": 0.0,
                     "perplexity": perplexity(lm, test_w)})
    print("\n| optimizer | criterion | MLP channels pruned | perplexity |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['criterion']} | {r['pruned']:.0%} | "
              f"{r['perplexity']:.3f} |")
    print("train seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows, "train_seconds": times}, fh, indent=2)


if __name__ == "__main__":
    main()
