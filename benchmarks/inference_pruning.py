"""Inference-time presses on long inputs: retrieval, continuation KL, speed and cache bytes.

For every press (``--presses``), compression ratio (``--ratios``, fraction of the prompt
removed) and context length (``--contexts``), on text from the embedded corpus
(``wiki-vital:test``, offline):

* passkey retrieval: a pass key sentence inserted at relative depths ``--depths`` of a
  haystack, then "What is the pass key? The pass key is" (a copy of the needle's start,
  which even small models complete by induction); greedy decoding of 8 tokens;
  accuracy = the key appears in the answer;
* continuation KL: KL(full || pressed) of the next-token distributions over the
  ``--continuation`` tokens that follow the context (the context prefilled under the press,
  the continuation run on the pressed cache), and top-1 agreement;
* prefill tokens/s and time to first token (prefill + eviction + first token), decode
  tokens/s over ``--decode`` greedy steps on the pressed cache, cache bytes after the
  prefill and peak accelerator memory.

Token-pruning presses map the ratio to their cut: LazyLLM removes ``ratio`` at block
``--prune-layer``; EntroPrefill caps its removal at ``max_ratio = ratio`` under
``--mass-bound``. The decay press is fitted first on ``wiki-vital:calib`` windows;
``decay-kl`` is the blended decay press (SnapKV's score + the learned key-statistics prior
+ recency) whose per-layer weights are fitted end-to-end, at each ratio, by the
continuation KL on ``--decay-samples`` calibration windows of ``--decay-seqlen`` tokens
(never on the test contexts).

Run (do not run inside the test suite)::

    python benchmarks/inference_pruning.py [--model smollm2-135m] [--device auto]
        [--contexts 1024,2048,4096] [--ratios 0.25,0.5,0.75,0.9]
        [--presses streaming-llm,h2o,snapkv,decay,decay-keys,decay-kl,lazyllm,entroprefill]
        (any registered press by name too: tova, knorm, expected-attention)
        [--decay-observe 32 --decay-horizon 64] [--json out.json]
        [--decay-seqlen 1024 --decay-samples 8 --decay-blocks 3 --decay-needles 0]
        [--decay-shares 0,0.25,0.5,0.75]
        [--kl-samples 4]
        [--quality-only]
    # smoke: --contexts 128 --ratios 0.5 --depths 0.5 --continuation 16 --decode 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

import prunelab
from prunelab.data import make_batches
from prunelab.eval.divergence import kl_from_logits, top1_agreement
from prunelab.eval.perplexity import final_hidden
from prunelab.inference import PRESSES, cache_bytes, fit_decay, press
from prunelab.inference.decay_kl import KLCalibration
from prunelab.inference.needles import with_needles

PASSKEY = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def pressed(lm, cfg, **kw):
    """The press context, or none for the plain model (``cfg`` None)."""
    return contextlib.nullcontext(None) if cfg is None else press(lm, cfg, **kw)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def haystack(lm, length: int, seed: int) -> torch.Tensor:
    """``[1, length]`` corpus tokens (windows of the embedded test split; SmolLM2's
    tokenizer adds no special tokens, Gemma's adds its ``<bos>``)."""
    batches = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=length, samples=None,
                           mode="test")  # framed as the tokenizer frames a sequence (Gemma: BOS)
    ids = batches.input_ids
    return ids[seed % ids.shape[0]][None]


def passkey_prompt(lm, length: int, depth: float, key: int) -> torch.Tensor:
    tok = lm.tokenizer
    needle = tok(PASSKEY.format(key=key), add_special_tokens=False,
                 return_tensors="pt").input_ids
    question = tok(QUESTION, add_special_tokens=False, return_tensors="pt").input_ids
    body = haystack(lm, length - needle.shape[1] - question.shape[1], seed=key)
    at = int(depth * body.shape[1])
    return torch.cat([body[:, :at], needle, body[:, at:], question], dim=1)


def parse_shares(text: str | None) -> list[float] | None:
    """``--decay-shares`` as floats in [0, 1], checked before any model is loaded."""
    if not text:
        return None
    try:
        vals = [float(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: --decay-shares takes numbers in [0, 1], got {text!r}") from None
    if not all(0.0 <= v <= 1.0 for v in vals):  # also refuses nan
        raise SystemExit(f"error: --decay-shares takes numbers in [0, 1], got {text!r}")
    return vals


def make_press(name: str, ratio: float, args, lm, decay_cfg):
    if name == "decay-kl":  # fitted end-to-end at this ratio on the calibration windows
        kl = decay_cfg["decay-kl"]
        if ("decay-kl", ratio) not in decay_cfg:  # one fit per ratio, for every context
            t0 = time.perf_counter()
            decay_cfg["decay-kl", ratio] = kl.fit(ratio, blocks=args.decay_blocks,
                                                  shares=args.decay_shares)
            print(json.dumps({"fit": "decay-kl", "ratio": ratio, "share": kl.share,
                              "needles": args.decay_needles,
                              "fit_s": time.perf_counter() - t0, **kl.history[ratio]}),
                  flush=True)
        return decay_cfg["decay-kl", ratio]
    if name in ("decay", "decay-keys"):
        fitted = decay_cfg[name]
        return PRESSES.get("decay")(ratio=ratio, window=fitted.window,
                                    weights=fitted.weights, observe=fitted.observe)
    if name == "lazyllm":
        return PRESSES.make(name, ratio=ratio, layer=args.prune_layer)
    if name == "entroprefill":
        return PRESSES.make(name, max_ratio=ratio, layer=args.prune_layer,
                            mass_bound=args.mass_bound, keep_scale=args.keep_scale)
    return PRESSES.make(name, ratio=ratio)


@torch.no_grad()
def retrieval(lm, cfg, length: int, depths: list[float]) -> float:
    hits = 0
    for i, depth in enumerate(depths):
        key = 10000 + 7919 * (i + 1) % 90000
        ids = passkey_prompt(lm, length, depth, key).to(lm.device)
        with pressed(lm, cfg):
            out = lm.model.generate(ids, max_new_tokens=8, do_sample=False,
                                    pad_token_id=lm.tokenizer.eos_token_id)
        hits += str(key) in lm.tokenizer.decode(out[0, ids.shape[1]:])
    return hits / len(depths)


@torch.no_grad()
def continuation(lm, cfg, length: int, cont: int, ref_cache: dict, samples: int = 1) -> dict:
    """Mean KL / top-1 over ``samples`` held-out contexts (seeds 1 .. samples)."""
    kls, tops = [], []
    for seed in range(1, samples + 1):
        ids = haystack(lm, length + cont, seed=seed).to(lm.device)
        if (length, seed) not in ref_cache:
            ref_cache[length, seed] = lm.adapter.logits(final_hidden(lm, ids)[:, -cont:]).float()
        ref = ref_cache[length, seed]
        with press(lm, cfg, continuation=cont):
            logits = lm.adapter.logits(final_hidden(lm, ids)[:, -cont:]).float()
        kls.append(float(kl_from_logits(ref, logits).mean()))
        tops.append(float(top1_agreement(ref, logits).float().mean()))
    return {"kl": sum(kls) / samples, "top1": sum(tops) / samples, "kl_per_context": kls}


@torch.no_grad()
def speed(lm, cfg, length: int, decode: int) -> dict:
    ids = haystack(lm, length, seed=2).to(lm.device)
    dev = lm.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with pressed(lm, cfg) as session:
        lm.model(ids, use_cache=True)  # warm-up
        sync(dev)
        t0 = time.perf_counter()
        out = lm.model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        sync(dev)
        ttft = time.perf_counter() - t0
        cache = out.cache
        nbytes = cache_bytes(cache)
        t0 = time.perf_counter()
        for _ in range(decode):
            step = lm.model(token, cache=cache, use_cache=True)
            token = step.logits[:, -1:].argmax(-1)
        sync(dev)
        dt = time.perf_counter() - t0
        kept = length if session is None else session.report.get("kept", length)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return {"ttft_s": ttft, "prefill_tokens_per_s": length / ttft,
            "decode_tokens_per_s": decode / dt, "cache_bytes": nbytes, "kept": kept,
            "peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--ratios", default="0.25,0.5,0.75,0.9")
    ap.add_argument("--presses", default="streaming-llm,h2o,snapkv,decay,lazyllm,entroprefill")
    ap.add_argument("--decay-observe", type=int, default=32,
                    help="observation window of the learned decay press (0: keys only)")
    ap.add_argument("--decay-horizon", type=int, default=64,
                    help="future tokens whose attention the decay press is fitted to")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prune-layer", type=int, default=3)
    ap.add_argument("--mass-bound", type=float, default=0.1)
    ap.add_argument("--keep-scale", type=float, default=1.0)
    ap.add_argument("--decay-seqlen", type=int, default=1024,
                    help="calibration window length of the end-to-end fit (decay-kl)")
    ap.add_argument("--decay-samples", type=int, default=8,
                    help="calibration windows of the end-to-end fit (decay-kl)")
    ap.add_argument("--decay-share", type=float, default=0.0,
                    help="budget fraction reserved for SnapKV's own top tokens (decay-kl)")
    ap.add_argument("--decay-needles", type=int, default=0,
                    help="needle windows added to the decay-kl fit (a key sentence in the "
                    "prompt, its answer in the continuation; another phrasing than the "
                    "pass-key task; see prunelab.inference.needles)")
    ap.add_argument("--decay-shares", default=None,
                    help="comma-separated shares of the budget kept for SnapKV's top tokens, "
                    "fitted with recent and mix (decay-kl; default: --decay-share, fixed)")
    ap.add_argument("--decay-blocks", type=int, default=3,
                    help="layer blocks of the coordinate search (decay-kl)")
    ap.add_argument("--kl-samples", type=int, default=1,
                    help="held-out contexts the continuation KL is averaged over")
    ap.add_argument("--quality-only", action="store_true",
                    help="skip the speed / memory measurement (KL, top-1, retrieval only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.decay_shares = parse_shares(args.decay_shares)
    if args.decay_needles < 0:
        raise SystemExit(f"error: --decay-needles must be >= 0, got {args.decay_needles}")
    lm = prunelab.load(args.model, dtype=args.dtype, device=args.device)
    lm.model.config._attn_implementation = "sdpa"
    contexts = [int(c) for c in args.contexts.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    names = args.presses.split(",")
    decay_cfg = {}
    if "decay" in names or "decay-keys" in names:
        calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=512, samples=8)
        # decay: key statistics + the observation window's attention, fitted to the
        # attention of the next --decay-horizon tokens; decay-keys: key statistics only
        decay_cfg["decay"] = fit_decay(lm, calib.input_ids, window=16,
                                       observe=args.decay_observe,
                                       horizon=args.decay_horizon)
        decay_cfg["decay-keys"] = fit_decay(lm, calib.input_ids, window=16)
    if "decay-kl" in names:  # calibration windows of --decay-seqlen (prompt + 32 tokens)
        calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=args.decay_seqlen + 32,
                             samples=args.decay_samples)
        t0 = time.perf_counter()
        ids = with_needles(lm.tokenizer, calib.input_ids, args.decay_needles, horizon=32)
        decay_cfg["decay-kl"] = KLCalibration(lm, ids, horizon=32, observe=32,
                                              share=args.decay_share)
        print(json.dumps({"calibration_s": time.perf_counter() - t0}), flush=True)
    rows, ref_cache = [], {}
    timing = (lambda *a: {}) if args.quality_only else speed
    for length in contexts:
        base = {"press": "none", "ratio": 0.0, "context": length,
                "retrieval": retrieval(lm, None, length, depths),
                **timing(lm, None, length, args.decode)}
        rows.append(base)
        print(json.dumps(base), flush=True)
        for name in names:
            for ratio in ratios:
                cfg = make_press(name, ratio, args, lm, decay_cfg)
                row = {"press": name, "ratio": ratio, "context": length,
                       "retrieval": retrieval(lm, cfg, length, depths),
                       **continuation(lm, cfg, length, args.continuation, ref_cache,
                                      args.kl_samples),
                       **timing(lm, cfg, length, args.decode)}
                if "prefill_tokens_per_s" in row:
                    row["prefill_speedup"] = (row["prefill_tokens_per_s"]
                                              / base["prefill_tokens_per_s"])
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
