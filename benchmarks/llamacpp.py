"""Speed, size and perplexity of pruned SmolLM2 exports where they are served: inside
llama.cpp (through llama-cpp-python), on the same threads, side by side with the dense model.

    python benchmarks/llamacpp.py [--threads 2] [--types f16,q8_0] [--windows 8]
        [--out benchmarks/results/serving.md]

For the dense model and each structured result (depth 6 of 30 folded, 20 % FFN width
uniform, 20 % FFN width global (deci), four sublayers removed (deci), 50 % Wanda): the
model is pruned in memory (calibration: 16 x 256 tokens of wiki-vital:calib), written as
GGUF f16 (quantized types through llama.cpp's own quantizer, ``llama_model_quantize``),
then, in llama.cpp: prompt processing of 512 tokens and generation of 128 tokens (tokens
per second, best of 2), the file size, and the perplexity of wiki-vital:test windows of 256
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
import time
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


def _quantize(src: Path, dst: Path, kind: str) -> None:
    import llama_cpp

    ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
             "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}[kind]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({kind}) returned {rc}")


def _speed(path: Path, threads: int, prompt: list[int], gen: int) -> tuple[float, float]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + gen + 8,
                          n_batch=len(prompt), n_threads=threads, verbose=False, seed=0)
    best_pp = best_tg = 0.0
    for _ in range(2):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        best_pp = max(best_pp, len(prompt) / (time.perf_counter() - t))
        t = time.perf_counter()
        for i in range(gen):  # one token at a time: decode speed, token ids fixed
            llm.eval([prompt[i % len(prompt)]])
        best_tg = max(best_tg, gen / (time.perf_counter() - t))
    llm.close() if hasattr(llm, "close") else None
    return best_pp, best_tg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--cases", default="dense,depth-6,ffn-20-uniform,ffn-20-global,"
                    "sublayers-4,wanda-50")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()

    from prunelab.checkpoint.gguf_export import write_gguf
    from prunelab.data import make_batches
    from prunelab.eval.llamacpp import compare_with_llamacpp

    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="prunelab-llamacpp-"))
    prompt = list(range(1000, 1512))
    for case in opts.cases.split(","):
        lm = _prune(case)
        windows = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=256,
                               samples=opts.windows, mode="test").input_ids
        f16 = tmp / f"{case}-f16.gguf"
        rep = write_gguf(lm, f16, "f16")
        for kind in opts.types.split(","):
            path = f16 if kind == "f16" else tmp / f"{case}-{kind}.gguf"
            if kind != "f16":
                _quantize(f16, path, kind)
            cmp = compare_with_llamacpp(lm, path, windows, threads=opts.threads)
            pp, tg = _speed(path, opts.threads, prompt, 128)
            rows.append(dict(case=case, type=kind, arch=rep["arch"],
                             mib=path.stat().st_size / 2**20, pp=pp, tg=tg,
                             ppl=cmp["perplexity"], ppl_cpp=cmp["llamacpp_perplexity"]))
            print(f"{case:15} {kind:5} {rows[-1]['mib']:7.1f} MiB  pp {pp:7.1f}  tg {tg:6.1f}"
                  f"  ppl {cmp['perplexity']:.3f} / llama.cpp {cmp['llamacpp_perplexity']:.3f}",
                  flush=True)
        del lm
    dense = {r["type"]: r for r in rows if r["case"] == "dense"}
    lines = ["| model | type | GGUF arch | MiB | prompt tok/s (512) | x dense | generation "
             "tok/s (128) | x dense | ppl prunelab f32 | ppl llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = dense.get(r["type"], r)
        lines.append(f"| {r['case']} | {r['type']} | {r['arch']} | {r['mib']:.1f} | "
                     f"{r['pp']:.1f} | {r['pp'] / d['pp']:.2f} | {r['tg']:.1f} | "
                     f"{r['tg'] / d['tg']:.2f} | {r['ppl']:.3f} | {r['ppl_cpp']:.3f} |")
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
        note = ("Speeds are the best of 2 runs on a 2-core machine. 50 % unstructured "
                "sparsity stores the same dense tensors as the dense model (llama.cpp has no "
                "sparse kernel), so its ratio (expected 1.00) shows this run's noise. "
                "Quantized widths that are not multiples of 32 (the 20 % FFN rows: 1,232 "
                "channels) fall back to f16 in llama.cpp's quantizer.\n\n")
        opts.out.write_text(head + note + table + "\n")
        print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
