"""Evaluation throughput: prunelab's ``score_windows`` versus a bare transformers loop.

Both score the same token windows of the embedded model (``smollm2-135m``, float32, CPU):

* prunelab: :func:`prunelab.eval.perplexity.score_windows` (base model, then the LM head
  one window at a time);
* bare: ``model(input_ids=batch, use_cache=False).logits``, float32 cross-entropy summed
  over the shifted tokens, ``perplexity = exp(total / count)``.

Each side runs one warm-up batch, then the full set; the order alternates over
``--repeats`` rounds and the best time of each side is kept. The table reports tokens/s
(all ``samples * seqlen`` input tokens per second), the perplexities and their relative
difference (should be ~1e-4 or less), and the ratio prunelab/bare (target >= 0.9).

Run::

    python benchmarks/eval_throughput.py [--samples 16 --seqlen 512 --batch-size 4]
                                         [--repeats 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch


def bare_perplexity(model, input_ids: torch.Tensor, batch_size: int) -> tuple[float, int]:
    """Plain transformers perplexity: summed float32 NLL of tokens 1..T-1 of each window."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in input_ids.split(batch_size):
            logits = model(input_ids=batch, use_cache=False).logits
            shift = logits[:, :-1].float()
            target = batch[:, 1:]
            nll = torch.nn.functional.cross_entropy(
                shift.reshape(-1, shift.shape[-1]), target.reshape(-1), reduction="sum")
            total += float(nll)
            count += target.numel()
    return math.exp(total / count), count


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki-vital:test")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    import transformers

    import prunelab
    from prunelab.data import make_batches
    from prunelab.eval.perplexity import score_windows

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # set_quiet does not cover HF's bars
    prunelab.log.set_quiet(True)
    lm = prunelab.load(args.model)
    ids = make_batches(lm.tokenizer, args.data, seqlen=args.seqlen,
                       samples=args.samples).input_ids
    n_tokens = ids.numel()
    warm = ids[:args.batch_size]

    def run_prunelab() -> tuple[float, float]:
        score_windows(lm, warm, batch_size=args.batch_size)
        t0 = time.perf_counter()
        ppl = score_windows(lm, ids, batch_size=args.batch_size)["perplexity"]
        return time.perf_counter() - t0, ppl

    def run_bare() -> tuple[float, float]:
        bare_perplexity(lm.model, warm, args.batch_size)
        t0 = time.perf_counter()
        ppl, _ = bare_perplexity(lm.model, ids, args.batch_size)
        return time.perf_counter() - t0, ppl

    sides = {"prunelab": run_prunelab, "bare": run_bare}
    times: dict[str, list[float]] = {k: [] for k in sides}
    ppls: dict[str, float] = {}
    for r in range(args.repeats):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            seconds, ppls[name] = sides[name]()
            times[name].append(seconds)

    best = {k: min(v) for k, v in times.items()}
    tps = {k: n_tokens / best[k] for k in sides}
    rel = abs(ppls["prunelab"] - ppls["bare"]) / ppls["bare"]
    ratio = tps["prunelab"] / tps["bare"]

    print(f"model {args.model}  data {args.data}  samples {args.samples}  seqlen "
          f"{args.seqlen}  batch {args.batch_size}  repeats {args.repeats}  "
          f"threads {torch.get_num_threads()}")
    print(f"tokens per pass {n_tokens} (scored {args.samples * (args.seqlen - 1)})")
    print(f"{'':<22}{'prunelab':>14}{'bare HF':>14}")
    print(f"{'best seconds':<22}{best['prunelab']:>14.2f}{best['bare']:>14.2f}")
    print(f"{'all seconds':<22}"
          + "".join(f"{' '.join(f'{t:.2f}' for t in times[k]):>14}" for k in sides))
    print(f"{'tokens/s':<22}{tps['prunelab']:>14.1f}{tps['bare']:>14.1f}")
    print(f"{'perplexity':<22}{ppls['prunelab']:>14.6f}{ppls['bare']:>14.6f}")
    print(f"{'ppl relative diff':<22}{rel:>14.2e}  ({'ok' if rel <= 1e-4 else 'MISMATCH'}"
          " at 1e-4)")
    print(f"{'ratio prunelab/bare':<22}{ratio:>14.3f}  "
          f"({'meets' if ratio >= 0.9 else 'BELOW'} target 0.9)")

    result = {
        "model": args.model, "data": args.data, "samples": args.samples,
        "seqlen": args.seqlen, "batch_size": args.batch_size, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "tokens": n_tokens,
        "seconds": times, "best_seconds": best, "tokens_per_s": tps,
        "perplexity": ppls, "perplexity_rel_diff": rel, "ratio_prunelab_over_bare": ratio,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
