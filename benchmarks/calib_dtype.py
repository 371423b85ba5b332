"""bfloat16 calibration against float32 on SmolLM2-135M: wall time, float32-pass
equivalents and test perplexity of the same methods with ``calib_dtype="bfloat16"``
(the blocks' matmuls in bfloat16; statistics, masks and updates in float32).

    python benchmarks/calib_dtype.py [--samples 32] [--seqlen 512] [--threads 2]
        [--out benchmarks/results/calibration.md]

For each method the float32 and the bfloat16 run follow each other (same calibration
windows), so a busy machine slows both alike. A float32 pass is one plain run of every
block over the calibration windows (``BlockRunner.run``), timed once per dtype at the
start; "passes" is a method's wall time over that float32 pass. Test perplexity: 16
windows of 512 tokens of wiki-vital:test, float32 forward. The block-influence probe
reports the Spearman correlation of its two rankings instead of a perplexity.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def _pass_seconds(lm, ids, dtype) -> float:
    from prunelab.calib.runner import BlockRunner

    lm.calib_dtype = dtype
    runner = BlockRunner(lm, ids, batch_size=8)
    runner.capture()
    start = time.perf_counter()
    runner.run(desc="pass")
    lm.calib_dtype = None
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="wanda,sparsegpt,width,probe")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()

    import torch

    torch.set_num_threads(opts.threads)
    from scipy.stats import spearmanr

    import prunelab
    from prunelab import SparseGPT, Wanda, Width
    from prunelab.data import make_batches

    base = prunelab.load("smollm2-135m")
    calib = make_batches(base.tokenizer, "wiki-vital:calib", seqlen=opts.seqlen,
                         samples=opts.samples, mode="calib")
    test = dict(data="wiki-vital:test", seqlen=512, samples=16)
    f32_pass = _pass_seconds(base, calib.input_ids, None)
    bf16_pass = _pass_seconds(base, calib.input_ids, torch.bfloat16)
    print(f"one pass: float32 {f32_pass:.1f} s, bfloat16 matmuls {bf16_pass:.1f} s", flush=True)
    dense_ppl = prunelab.evaluate(base, **test)["perplexity"]
    configs = {"wanda": lambda: Wanda(sparsity=0.5),
               "sparsegpt": lambda: SparseGPT(sparsity=0.5),
               "width": lambda: Width(unit="ffn", score="wanda-sp", ratio=0.2)}
    rows = []
    for name in opts.methods.split(","):
        got = {}
        for dtype in ("float32", "bfloat16"):
            lm = prunelab.load("smollm2-135m")
            start = time.perf_counter()
            if name == "probe":
                res = prunelab.probe(lm, "block-influence", calib, batch_size=8,
                                     calib_dtype=dtype, bootstrap=0)
                seconds = time.perf_counter() - start
                got[dtype] = (seconds, res.layer_values())
            else:
                prunelab.prune(lm, configs[name](), calib, batch_size=8, calib_dtype=dtype)
                seconds = time.perf_counter() - start
                got[dtype] = (seconds, prunelab.evaluate(lm, **test)["perplexity"])
            print(f"{name:10} {dtype:9} {seconds:7.1f} s ({seconds / f32_pass:.2f} passes)",
                  flush=True)
            del lm
        (t32, q32), (t16, q16) = got["float32"], got["bfloat16"]
        if name == "probe":
            rho = spearmanr(q32, q16).statistic
            quality = f"ranking Spearman {rho:.3f}"
        else:
            quality = f"{q32:.3f} / {q16:.3f} ({100 * (q16 / q32 - 1):+.2f} %)"
        rows.append(f"| {name} | {t32:.1f} | {t32 / f32_pass:.2f} | {t16:.1f} | "
                    f"{t16 / f32_pass:.2f} | {t16 / t32:.2f} | {quality} |")
    table = "\n".join(["| method | float32 s | float32 passes | bfloat16 s | bfloat16 passes "
                       "| time ratio | test perplexity float32 / bfloat16 |",
                       "|---|---|---|---|---|---|---|", *rows])
    print(table)
    if opts.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        cpu = next((ln.split(":", 1)[1].strip() for ln in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), platform.processor())
        flags = Path("/proc/cpuinfo").read_text()
        bf16 = "avx512_bf16" if "avx512_bf16" in flags else "no avx512_bf16"
        amx = ", amx_bf16" if "amx_bf16" in flags else ""
        text = (f"# bfloat16 calibration\n\nMeasured {datetime.date.today()} at commit "
                f"{commit} on {os.cpu_count()} cores ({cpu}; {bf16}{amx}), torch "
                f"{torch.__version__}, {opts.threads} threads.\n\nCommand: `python "
                f"{' '.join(sys.argv)}`\n\nCalibration: {opts.samples} x {opts.seqlen} tokens "
                f"of wiki-vital:calib. One float32 pass: {f32_pass:.1f} s; with bfloat16 "
                f"matmuls: {bf16_pass:.1f} s ({bf16_pass / f32_pass:.2f}). Dense test "
                f"perplexity {dense_ppl:.3f} (16 x 512 tokens of wiki-vital:test).\n\n"
                + table + "\n")
        opts.out.write_text(text)
        print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
