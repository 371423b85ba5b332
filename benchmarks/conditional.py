"""Conditional computation, PrunePath part: gated FFNs as experts with a cumulative-mass
router (``prunepath``), at several routing masses of one converted model.

For each mass ``p``: experts used per token (mean over blocks and test tokens, counted
while scoring), FFN FLOPs per token against the dense FFN (router included, from the
actual selections), test perplexity (the one evaluator), and measured prefill speed on
the first ``--speed-windows`` test windows (batch 1, with the KV cache): prefill tokens/s
and the time spent inside the MLPs (forward hooks on every block's MLP, here in the
benchmark only), each against the dense model measured back to back (alternating, best
of ``--rounds``). ``flop speed-up`` is dense / routed FFN FLOPs; ``efficiency`` is the
measured FFN speed-up over it (the issue's target: at least 0.7, with 30 % fewer FFN
FLOPs within +10 % test perplexity). The CausalGate part lives in ``benchmarks/gates.py``.

Decode (batch 1, KV cache, one token per step: the regime where the FFN is bound by
reading its weights, which the few-token path of ``PrunePathMLP`` exploits): after an
untimed prefill of ``--decode-prompt`` tokens of the first test window, its next
``--decode-tokens`` tokens are fed one per step (the same tokens for every model, so the
attention work is identical). Measured per round, in a rotating order, moments apart:
the dense model, the dense model with every MLP replaced by a function returning zeros
(``zero FFN``), and the converted model at every mass. The FFN time per token of a model is
its decode time per token minus the zero-FFN model's (the rest of the model, LM head
included, is the same); ``FFN time speed-up`` = dense FFN time / routed FFN time, per
round, then the median and range over ``--decode-rounds``, from wall-clock time and from
process CPU time (which leaves out the time the process waits for a shared core). A third
estimate times the MLP calls themselves (forward hooks, wall clock). Experts per token, the
share of the FFN weights read and the FFN FLOPs are counted on the decoded tokens.

Run (defaults: 64 x 512 calibration, 32 x 512 test windows)::

    python benchmarks/conditional.py [--model smollm2-135m] [--masses 0.7,0.8,0.9,1.0]
        [--experts 16 --clustering coactivation --router fitted]
        [--calib wiki-vital:calib --test wiki-vital:test --seqlen 512]
        [--calib-samples 64 --test-samples 32] [--cache /tmp/smol-prunepath]
        [--decode-prompt 128 --decode-tokens 64 --decode-rounds 7] [--threads N]
        [--no-quality] [--speed-windows 0] [--json out.json]

``--cache DIR`` keeps the converted model (a checkpoint plus ``DIR.json``) between runs;
it is reused only when the conversion settings match.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch


class MLPTimer:
    """Wall time spent inside every block's MLP (forward pre/post hooks)."""

    def __init__(self, lm):
        self.seconds = 0.0
        self._start: dict[int, float] = {}
        self._handles = []
        for i in range(lm.adapter.num_blocks):
            mlp = lm.adapter.mlp(i)
            self._handles.append(mlp.register_forward_pre_hook(self._pre))
            self._handles.append(mlp.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._start[id(module)] = time.perf_counter()

    def _post(self, module, args, output):
        self.seconds += time.perf_counter() - self._start.pop(id(module))

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@torch.no_grad()
def prefill(lm, windows: torch.Tensor) -> dict:
    """Prefill tokens/s and MLP seconds over ``windows`` ``[n, T]`` (batch 1 each)."""
    timer = MLPTimer(lm)
    try:
        lm.model(input_ids=windows[:1].to(lm.device), use_cache=True)  # warm-up
        timer.seconds = 0.0
        start = time.perf_counter()
        for row in windows.split(1):
            lm.model(input_ids=row.to(lm.device), use_cache=True)
        total = time.perf_counter() - start
    finally:
        timer.close()
    return {"prefill_tokens_per_s": windows.numel() / total, "mlp_seconds": timer.seconds,
            "seconds": total}


def best_of(runs: list[dict]) -> dict:
    return {"prefill_tokens_per_s": max(r["prefill_tokens_per_s"] for r in runs),
            "mlp_seconds": min(r["mlp_seconds"] for r in runs)}


def measure(dense, routed, windows, rounds: int) -> tuple[dict, dict]:
    d_runs, r_runs = [], []
    for _ in range(rounds):
        d_runs.append(prefill(dense, windows))
        r_runs.append(prefill(routed, windows))
    return best_of(d_runs), best_of(r_runs)


def _zeros(x, *args, **kwargs):
    return torch.zeros_like(x)


class ZeroFFN:
    """Within it every block's MLP returns zeros (its ``forward`` replaced on the instance):
    the model without its FFN compute, everything else unchanged."""

    def __init__(self, lm):
        self.mlps = [lm.adapter.mlp(i) for i in range(lm.adapter.num_blocks)]

    def __enter__(self):
        for mlp in self.mlps:
            mlp.forward = _zeros
        return self

    def __exit__(self, *exc):
        for mlp in self.mlps:
            del mlp.forward
        return False


@torch.no_grad()
def decode_seconds(model, ids: torch.Tensor, prompt: int, after_prefill=None,
                   timer: MLPTimer | None = None) -> tuple:
    """Wall-clock and process CPU seconds per decode step of ``model``, and the wall-clock
    seconds per step inside the MLPs (``timer``'s hooks; 0 without one):
    ``ids[:, :prompt]`` prefilled (not timed), then ``ids[:, prompt:]`` fed one token per
    step with the KV cache."""
    cache = model(input_ids=ids[:, :prompt], use_cache=True).cache
    if after_prefill is not None:
        after_prefill()
    if timer is not None:
        timer.seconds = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    for j in range(prompt, ids.shape[1]):
        cache = model(input_ids=ids[:, j:j + 1], cache=cache, use_cache=True).cache
    steps = ids.shape[1] - prompt
    mlp = timer.seconds / steps if timer is not None else 0.0
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps, mlp


def weights_read(routed) -> float:
    """Share of the FFN weights the counted tokens read (selected experts' channels over
    all channels, summed over blocks)."""
    from prunelab.pruning.moe import prunepath_modules

    used = total = 0
    for _, m in prunepath_modules(routed):
        used += sum(n * s for n, s in zip(m.stat_expert_tokens, m.sizes, strict=True))
        total += m.stat_tokens * m.ffn
    return used / total if total else float("nan")


def spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def decode_speed(lm, routed, masses: list, ids: torch.Tensor, prompt: int,
                 rounds: int) -> dict:
    """Interleaved decode timings (see the module docstring): per variant the seconds per
    token of every round, the median [range] tokens/s and ratios to the dense model, the
    FFN time speed-ups (wall clock and process CPU time), and the routing counts on the
    decoded tokens."""
    from prunelab.pruning.moe import reset_stats, routing_stats, set_mass

    ids = ids.to(lm.device)
    variants = ["dense", "zero"] + [f"p={p}" for p in masses]
    stats: dict = {}
    timers = {"dense": MLPTimer(lm), "routed": MLPTimer(routed)}

    def run_one(name: str) -> tuple:
        if name == "dense":
            return decode_seconds(lm.model, ids, prompt, timer=timers["dense"])
        if name == "zero":
            with ZeroFFN(lm):
                return decode_seconds(lm.model, ids, prompt)
        p = float(name[2:])
        set_mass(routed, p)
        sec = decode_seconds(routed.model, ids, prompt, after_prefill=lambda: reset_stats(routed),
                             timer=timers["routed"])
        st = routing_stats(routed)
        stats[name] = {"experts_per_token": st["experts_per_token"],
                       "ffn_flops_ratio": st["ffn_flops_ratio"],
                       "weights_read": weights_read(routed), "tokens": st["tokens"]}
        return sec

    for name in variants:  # warm-up (and the down_proj layout of a reloaded model)
        run_one(name)
    wall: dict = {name: [] for name in variants}
    cpu: dict = {name: [] for name in variants}
    mlp: dict = {name: [] for name in variants}
    try:
        for r in range(rounds):
            k = r % len(variants)
            for name in variants[k:] + variants[:k]:
                w, c, m = run_one(name)
                wall[name].append(w)
                cpu[name].append(c)
                mlp[name].append(m)
    finally:
        for timer in timers.values():
            timer.close()

    def ffn(clock: dict, name: str) -> dict:  # dense FFN time / this model's, per round
        return spread([(d - z) / (s - z) for d, z, s in
                       zip(clock["dense"], clock["zero"], clock[name], strict=True)])

    out = {"variants": {}, "prompt": prompt, "tokens": ids.shape[1] - prompt,
           "rounds": rounds,
           "ffn_share": spread([(d - z) / d for d, z in
                                zip(wall["dense"], wall["zero"], strict=True)]),
           "ffn_share_cpu": spread([(d - z) / d for d, z in
                                    zip(cpu["dense"], cpu["zero"], strict=True)])}
    for name in variants:
        row = {"seconds": wall[name], "cpu_seconds": cpu[name],
               "tokens_per_s": spread([1.0 / s for s in wall[name]]),
               "x_dense": spread([d / s for d, s in zip(wall["dense"], wall[name],
                                                        strict=True)]),
               "x_dense_cpu": spread([d / s for d, s in zip(cpu["dense"], cpu[name],
                                                            strict=True)])}
        if name.startswith("p="):
            row.update(stats[name], mass=float(name[2:]), ffn_speedup=ffn(wall, name),
                       ffn_speedup_cpu=ffn(cpu, name), mlp_seconds=mlp[name],
                       ffn_speedup_hooks=spread([d / s for d, s in
                                                 zip(mlp["dense"], mlp[name], strict=True)]))
        if name == "dense":
            row["mlp_seconds"] = mlp[name]
        out["variants"][name] = row
    return out


def installed_class(routed) -> None:
    """Rebuild every PrunePath MLP of ``routed`` with the installed class (same weights and
    mass): a checkpoint's modeling file carries the class source of when it was saved, and
    the benchmark measures this code."""
    from prunelab.models.custom import install
    from prunelab.pruning.moe import PrunePathMLP, prunepath_modules

    for path, old in prunepath_modules(routed.model):
        new = PrunePathMLP.prunelab_build(old.prunelab_spec())
        new = new.to(dtype=old.down_proj.weight.dtype, device=old.down_proj.weight.device)
        new.load_state_dict(old.state_dict())
        new.mass = old.mass
        install(routed.model, path, new)


def converted(lm, cfg, args):
    """The converted model and its conversion figures, from ``--cache`` when it holds
    this conversion, otherwise converted now (and cached when ``--cache`` is set)."""
    import prunelab
    from prunelab.models.loading import wrap
    from prunelab.registry import to_dict

    key = {"model": args.model, "config": to_dict(cfg), "calib": args.calib,
           "calib_samples": args.calib_samples, "seqlen": args.seqlen}
    meta = Path(str(args.cache).rstrip("/") + ".json") if args.cache else None
    if meta is not None and meta.exists() and Path(args.cache, "config.json").exists():
        saved = json.loads(meta.read_text())
        if saved["key"] == key:
            routed = prunelab.load(args.cache, trust_remote_code=True, dtype="float32")
            installed_class(routed)
            return routed, saved["figures"]
    routed = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    start = time.perf_counter()
    report = prunelab.prune(routed, cfg, args.calib, seqlen=args.seqlen,
                            samples=args.calib_samples, batch_size=args.batch_size)
    figures = {"convert_seconds": time.perf_counter() - start,
               "calib_experts_per_token": report["calib_experts_per_token"]}
    if meta is not None:
        prunelab.save(routed, args.cache, overwrite=True)
        meta.write_text(json.dumps({"key": key, "figures": figures}, indent=2))
    return routed, figures


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib", default="wiki-vital:calib")
    ap.add_argument("--test", default="wiki-vital:test")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--test-samples", type=int, default=32)
    ap.add_argument("--masses", default="0.7,0.8,0.9,1.0")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--clustering", default="coactivation")
    ap.add_argument("--router", default="fitted")
    ap.add_argument("--router-steps", type=int, default=300)
    ap.add_argument("--speed-windows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the speed "
                    "measurements (default: torch's choice)")
    ap.add_argument("--cache", default=None, help="directory keeping the converted model")
    ap.add_argument("--no-quality", action="store_true", help="skip the perplexities")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def run(args) -> dict:
    import prunelab
    from prunelab.api import tokens_for
    from prunelab.pruning.moe import PrunePath, reset_stats, routing_stats, set_mass
    from prunelab.registry import to_dict

    masses = [float(m) for m in args.masses.split(",")]
    lm = prunelab.load(args.model, dtype="float32")
    cfg = PrunePath(experts=args.experts, clustering=args.clustering, router=args.router,
                    mass=masses[0], router_steps=args.router_steps)
    test = tokens_for(lm, args.test, seqlen=args.seqlen, samples=args.test_samples,
                      mode="test")
    windows = test.input_ids[:args.speed_windows]
    end = args.decode_prompt + args.decode_tokens
    if end > test.input_ids.shape[1]:
        raise SystemExit(f"--decode-prompt + --decode-tokens ({end}) exceed --seqlen")
    dense_ppl = (float("nan") if args.no_quality else
                 prunelab.evaluate(lm, test, batch_size=args.batch_size)["perplexity"])
    routed, figures = converted(lm, cfg, args)
    rows = []
    build_threads = torch.get_num_threads()
    for p in masses:
        set_mass(routed, p)
        reset_stats(routed)
        torch.set_num_threads(build_threads)
        ppl = (float("nan") if args.no_quality else
               prunelab.evaluate(routed, test, batch_size=args.batch_size)["perplexity"])
        stats = routing_stats(routed)
        if args.threads:  # the speed measurements only
            torch.set_num_threads(args.threads)
        row = {"mass": p, "experts_per_token": stats["experts_per_token"],
               "ffn_flops_ratio": stats["ffn_flops_ratio"], "perplexity": ppl,
               "perplexity_ratio": ppl / dense_ppl}
        if len(windows):
            d_speed, r_speed = measure(lm, routed, windows, args.rounds)
            flop_speedup = 1.0 / stats["ffn_flops_ratio"]
            ffn_speedup = d_speed["mlp_seconds"] / r_speed["mlp_seconds"]
            row.update({
                "prefill_tokens_per_s": r_speed["prefill_tokens_per_s"],
                "dense_prefill_tokens_per_s": d_speed["prefill_tokens_per_s"],
                "prefill_speedup": r_speed["prefill_tokens_per_s"] /
                d_speed["prefill_tokens_per_s"],
                "mlp_seconds": r_speed["mlp_seconds"],
                "dense_mlp_seconds": d_speed["mlp_seconds"],
                "ffn_speedup": ffn_speedup, "flop_speedup": flop_speedup,
                "efficiency": ffn_speedup / flop_speedup,
                "meets_target": stats["ffn_flops_ratio"] <= 0.7 and
                ppl <= 1.1 * dense_ppl and ffn_speedup >= 0.7 * flop_speedup})
        rows.append(row)
    decode = None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode_rounds > 0:
        decode = decode_speed(lm, routed, masses, test.input_ids[:1, :end],
                              args.decode_prompt, args.decode_rounds)
    return {"model": args.model, "config": to_dict(cfg),
            "calib": {"spec": args.calib, "samples": args.calib_samples, "seqlen": args.seqlen},
            "test": test.to_dict(), "dense_perplexity": dense_ppl, **figures,
            "threads": torch.get_num_threads(), "rows": rows, "decode": decode}


def table(result: dict) -> str:
    """The prefill table (rows measured with ``--speed-windows``)."""
    head = ("| mass | experts/token | FFN FLOPs vs dense | test ppl (dense "
            f"{result['dense_perplexity']:.2f}) | prefill tok/s (vs dense) | FFN time "
            "speed-up | efficiency |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        if "prefill_tokens_per_s" not in r:
            continue
        lines.append(f"| {r['mass']:.2f} | {r['experts_per_token']:.2f} / "
                     f"{result['config']['experts']} | {r['ffn_flops_ratio']:.3f} | "
                     f"{r['perplexity']:.2f} ({r['perplexity_ratio']:.2f}x) | "
                     f"{r['prefill_tokens_per_s']:.0f} ({r['prefill_speedup']:.2f}x) | "
                     f"{r['ffn_speedup']:.2f}x (FLOPs {r['flop_speedup']:.2f}x) | "
                     f"{r['efficiency']:.2f} |")
    return "\n".join(lines) if len(lines) > 1 else ""


def _mr(s: dict, fmt: str = "{:.2f}", unit: str = "") -> str:
    """``median [min, max]``."""
    return (f"{fmt.format(s['median'])}{unit} [{fmt.format(s['min'])}, "
            f"{fmt.format(s['max'])}]")


def decode_table(result: dict) -> str:
    """The decode table: one row per model, median [range] over the rounds."""
    dec = result["decode"]
    ppl = {r["mass"]: r for r in result["rows"]}
    experts = result["config"]["experts"]
    lines = [f"| model | experts/token | FFN weights read | FFN FLOPs vs dense | test ppl "
             f"(dense {result['dense_perplexity']:.2f}) | decode tok/s | vs dense | FFN time "
             f"speed-up | FFN CPU-time speed-up | MLP time speed-up (hooks) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in dec["variants"].items():
        tps, x = _mr(v["tokens_per_s"], "{:.2f}"), _mr(v["x_dense"], unit="x")
        if name == "dense":
            lines.append(f"| dense | {experts} / {experts} | 1.000 | 1.000 | "
                         f"{result['dense_perplexity']:.2f} | {tps} | 1x | 1x | 1x | 1x |")
        elif name == "zero":
            lines.append(f"| dense, zero FFN | 0 | 0 | 0 | - | {tps} | {x} | - | - | - |")
        else:
            r = ppl.get(v["mass"], {})
            q = (f"{r['perplexity']:.2f} ({r['perplexity_ratio']:.2f}x)"
                 if r.get("perplexity") == r.get("perplexity") else "-")
            lines.append(f"| PrunePath p={v['mass']:.2f} | {v['experts_per_token']:.2f} / "
                         f"{experts} | {v['weights_read']:.3f} | {v['ffn_flops_ratio']:.3f} | "
                         f"{q} | {tps} | {x} | {_mr(v['ffn_speedup'], unit='x')} | "
                         f"{_mr(v['ffn_speedup_cpu'], unit='x')} | "
                         f"{_mr(v['ffn_speedup_hooks'], unit='x')} |")
    lines.append("")
    lines.append(f"FFN share of the dense decode time: {_mr(dec['ffn_share'], '{:.3f}')} "
                 f"(CPU time {_mr(dec['ffn_share_cpu'], '{:.3f}')}); {dec['tokens']} decode "
                 f"tokens after a {dec['prompt']}-token prompt, {dec['rounds']} rounds, "
                 f"{result['threads']} threads")
    return "\n".join(lines)


def main(argv=None) -> None:
    import transformers

    import prunelab.log

    args = parse(argv)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prunelab.log.set_quiet(True)
    result = run(args)
    prefill = table(result)
    if prefill:
        print(prefill)
    if result["decode"] is not None:
        print(decode_table(result))
    print(f"conversion: {result['convert_seconds']:.0f} s (cached runs: of the first run); "
          f"threads {result['threads']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
