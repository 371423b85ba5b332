"""Speed, size and perplexity of pruned SmolLM2 exports where they are served: inside
llama.cpp (through llama-cpp-python), on the same threads, side by side with the dense model.

    python benchmarks/llamacpp.py [--threads 2] [--types f16,q8_0] [--windows 8]
        [--rounds 5] [--out benchmarks/results/serving.md]

For the dense model and each structured result (depth 6 of 30 folded, 20 % FFN width
uniform, 20 % FFN width global (deci), four sublayers removed (deci), 50 % Wanda): the
model is pruned in memory (calibration: 16 x 256 tokens of wiki-vital:calib), written as
GGUF f16 (quantized types through llama.cpp's own quantizer, ``llama_model_quantize``),
then, in llama.cpp: prompt processing of 512 tokens and generation of 128 tokens (tokens
per second; --rounds rounds interleaved with the dense model, ratios taken within a round,
median and range shown), the file size, and the perplexity of wiki-vital:test windows of 256
tokens from llama.cpp's own logits, next to prunelab's float32 perplexity of the same
windows. Ratios are to the dense model of the same type. The table is printed and, with
--out, written with the date, commit, machine and command.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path


def _prune(case: str):
    import prunelab
    from prunelab import Depth, Wanda, Width
    from prunelab.models.sublayer import remove_sublayers

    lm = prunelab.load("smollm2-135m")
    calib = dict(samples=16, seqlen=256)
    if case == "depth-6":
        prunelab.prune(lm, Depth(remove=6, recovery="foldable"), "wiki-vital:calib", **calib)
    elif case == "ffn-20-uniform":
        prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.2,
                                 allocation="uniform"), "wiki-vital:calib", **calib)
    elif case == "ffn-20-global":
        prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.2,
                                 allocation="global"), "wiki-vital:calib", **calib)
    elif case == "sublayers-4":
        remove_sublayers(lm, [(3, "attention"), (7, "mlp"), (12, "attention"), (20, "mlp")])
    elif case == "wanda-50":
        prunelab.prune(lm, Wanda(sparsity=0.5), "wiki-vital:calib", **calib)
    return lm


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5,
                    help="speed rounds; each round measures every model once, dense first")
    ap.add_argument("--cases", default="dense,depth-6,ffn-20-uniform,ffn-20-global,"
                    "sublayers-4,wanda-50")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()

    from prunelab.checkpoint.gguf_export import quantize_gguf, write_gguf
    from prunelab.data import make_batches
    from prunelab.eval.llamacpp import compare_with_llamacpp, llamacpp_speed

    cases = opts.cases.split(",")
    types = opts.types.split(",")
    if cases[0] != "dense":
        raise SystemExit("error: --cases must start with dense (speeds are ratios to it)")
    tmp = Path(tempfile.mkdtemp(prefix="prunelab-llamacpp-"))
    files, info = {}, {}
    for case in cases:
        lm = _prune(case)
        windows = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=256,
                               samples=opts.windows, mode="test").input_ids
        f16 = tmp / f"{case}-f16.gguf"
        rep = write_gguf(lm, f16, "f16")
        for kind in types:
            path = f16 if kind == "f16" else tmp / f"{case}-{kind}.gguf"
            if kind != "f16":
                quantize_gguf(f16, path, kind)
            cmp = compare_with_llamacpp(lm, path, windows, threads=opts.threads)
            files[case, kind] = path
            info[case, kind] = dict(arch=rep["arch"], mib=path.stat().st_size / 2**20,
                                    ppl=cmp["perplexity"], ppl_cpp=cmp["llamacpp_perplexity"])
            print(f"{case:15} {kind:5} {info[case, kind]['mib']:7.1f} MiB  ppl "
                  f"{cmp['perplexity']:.3f} / llama.cpp {cmp['llamacpp_perplexity']:.3f}",
                  flush=True)
        del lm
    # speed: every round measures each model once, dense first, so a ratio compares two
    # measurements seconds apart (a busy machine slows both)
    prompt = list(range(1000, 1512))
    runs: dict[tuple, list[tuple[float, float]]] = {k: [] for k in files}
    for r in range(opts.rounds):
        for kind in types:
            for case in cases:
                sp = llamacpp_speed(files[case, kind], prompt, gen=128, threads=opts.threads,
                                    repeats=1)
                runs[case, kind].append((sp["prompt_tokens_per_s"], sp["gen_tokens_per_s"]))
        print(f"speed round {r + 1}/{opts.rounds} done", flush=True)

    def ratio(case, kind, j):
        rs = [a[j] / d[j] for a, d in zip(runs[case, kind], runs["dense", kind], strict=True)]
        return _median(rs), min(rs), max(rs)

    lines = ["| model | type | GGUF arch | MiB | prompt tok/s (512) | x dense [min-max] | "
             "generation tok/s (128) | x dense [min-max] | ppl prunelab f32 | "
             "ppl llama.cpp |", "|---|---|---|---|---|---|---|---|---|---|"]
    wide = []
    for kind in types:
        for case in cases:
            i = info[case, kind]
            pp = _median([x[0] for x in runs[case, kind]])
            tg = _median([x[1] for x in runs[case, kind]])
            cells = []
            for j, what in ((0, "prompt"), (1, "generation")):
                med, lo, hi = ratio(case, kind, j)
                cells.append(f"{med:.2f} [{lo:.2f}-{hi:.2f}]" if case != "dense" else "1.00")
                if case != "dense" and hi - lo > 0.2:
                    wide.append(f"{case} {kind} {what}")
            lines.append(f"| {case} | {kind} | {i['arch']} | {i['mib']:.1f} | {pp:.1f} | "
                         f"{cells[0]} | {tg:.1f} | {cells[1]} | {i['ppl']:.3f} | "
                         f"{i['ppl_cpp']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if opts.out:
        import llama_cpp

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        cpu = next((ln.split(":", 1)[1].strip() for ln in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), platform.processor())
        head = (f"# Serving in llama.cpp\n\nMeasured {datetime.date.today()} at commit {commit} "
                f"on {os.cpu_count()} cores ({cpu}), llama-cpp-python "
                f"{llama_cpp.__version__}, {opts.threads} threads.\n\nCommand: `python "
                f"{' '.join(sys.argv)}`\n\n")
        note = (f"Speeds: median of {opts.rounds} rounds; each round measures every model "
                "once, dense first, and a ratio is taken within a round (a busy machine slows "
                "both sides), then the median and the range over rounds are shown. 50 % "
                "unstructured sparsity stores the same dense tensors as the dense model "
                "(llama.cpp has no sparse kernel), so its ratio (expected 1.00) shows this "
                "run's noise. Quantized widths that are not multiples of 32 (the 20 % FFN "
                "rows: 1,232 channels) fall back to f16 in llama.cpp's quantizer. "
                "Perplexity: wiki-vital:test windows of 256 tokens, the same token ids in "
                "both.\n\n")
        if wide:
            note += ("Ratios whose range over rounds is wider than 0.2 (too noisy to rank): "
                     + ", ".join(wide) + ".\n\n")
        opts.out.write_text(head + note + table + "\n")
        print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
