"""Width pruning speed-up: prefill and decode tokens/s and bytes before and after
structured width pruning, printed side by side.

Settings on the embedded model (``--model``): 25 % of FFN channels removed uniformly
(SmolLM2: 1536 -> 1152 per block), one KV group removed per block (3 -> 2 groups, 9 -> 6
query heads), and both. Units are chosen by the weight-only magnitude profile (the speed
depends on the shapes, not on which units go; no calibration needed). Every pruned copy is
measured back to back with the dense model (alternating, best of ``--rounds``), so each
ratio compares runs made under the same machine load; speed comes from
:func:`prunelab.eval.speed.measure_speed` (prefill of ``--prompt-len`` tokens, median of 3
after a warm-up; ``--decode`` greedy steps with the KV cache). All pruned checkpoints here
are uniform, i.e. plain ``transformers`` configs.

Run::

    python benchmarks/width_speed.py [--prompt-len 256 --decode 32 --rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json

import transformers

import prunelab
from prunelab.eval.speed import measure_speed
from prunelab.models.loading import wrap
from prunelab.models.size import model_size
from prunelab.pruning.width.config import Width
from prunelab.pruning.width.execute import prune_width


def best(runs: list[dict]) -> dict:
    return {"prefill": max(r["prefill_tokens_per_s"] for r in runs),
            "decode": max(r["decode_tokens_per_s"] for r in runs)}


def paired(dense_lm, pruned_lm, args) -> tuple[dict, dict]:
    d_runs, p_runs = [], []
    for _ in range(args.rounds):
        for lm, runs in ((dense_lm, d_runs), (pruned_lm, p_runs)):
            runs.append(measure_speed(lm, prompt_len=args.prompt_len,
                                      decode_tokens=args.decode, repeats=3, seed=0))
    return best(d_runs), best(p_runs)


def pruned_copy(lm, configs: list[Width], ids):
    model = copy.deepcopy(lm.model)
    new = wrap(model, lm.tokenizer, spec=lm.spec)
    for cfg in configs:
        prune_width(new, cfg, ids, batch_size=1)
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ffn-ratio", type=float, default=0.25)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="best of this many measurements")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prunelab.log.set_quiet(True)
    lm = prunelab.load(args.model)
    ids = lm.tokenizer("The width benchmark needs one short window.",
                       return_tensors="pt").input_ids
    kv = lm.adapter.head_geometry(0).num_kv_heads
    ffn = Width(unit="ffn", score="magnitude-profile", ratio=args.ffn_ratio)
    heads = Width(unit="heads", score="magnitude-profile", ratio=1.0 / kv)
    settings = {f"{args.ffn_ratio:.0%} FFN": [ffn], "1 KV group per block": [heads],
                "both": [ffn, heads]}
    dense_size = model_size(lm.model)
    rows = []
    for name, configs in settings.items():
        pruned = pruned_copy(lm, configs, ids)
        geo = pruned.adapter.head_geometry(0)
        d, p = paired(lm, pruned, args)
        size = model_size(pruned.model)
        rows.append({"setting": name, "heads": geo.num_heads, "kv_heads": geo.num_kv_heads,
                     "ffn": pruned.adapter.ffn_width(0), "dense": d, "pruned": p,
                     "params": (dense_size["params"], size["params"]),
                     "bytes": (dense_size["bytes"], size["bytes"])})
    g0 = lm.adapter.head_geometry(0)
    print(f"{args.model}: dense {g0.num_heads} heads / {g0.num_kv_heads} KV, FFN "
          f"{lm.adapter.ffn_width(0)}; prompt {args.prompt_len}, decode {args.decode}, "
          f"best of {args.rounds} paired rounds")
    head = (f"{'setting':<22}{'shape':>16}{'MB dense':>10}{'MB pruned':>10}"
            f"{'prefill dense':>15}{'prefill pruned':>15}{'x':>6}"
            f"{'decode dense':>14}{'decode pruned':>15}{'x':>6}")
    print(head)
    for r in rows:
        shape = f"{r['heads']}/{r['kv_heads']}h, {r['ffn']}"
        print(f"{r['setting']:<22}{shape:>16}{r['bytes'][0] / 1e6:>10.1f}"
              f"{r['bytes'][1] / 1e6:>10.1f}{r['dense']['prefill']:>15.0f}"
              f"{r['pruned']['prefill']:>15.0f}"
              f"{r['pruned']['prefill'] / r['dense']['prefill']:>6.2f}"
              f"{r['dense']['decode']:>14.1f}{r['pruned']['decode']:>15.1f}"
              f"{r['pruned']['decode'] / r['dense']['decode']:>6.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
