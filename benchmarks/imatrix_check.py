"""prunelab's importance matrix against llama.cpp's own ``llama-imatrix`` on the same text.

    python benchmarks/imatrix_check.py [--model smollm2-135m] [--chunks 16] [--ctx 256]
        [--llama-bin DIR] [--out benchmarks/results/served-front-imatrix.md]

The dense model is written as an f16 GGUF; the first ``--chunks x --ctx`` tokens of the
wiki-vital:calib text, as llama.cpp tokenizes it (``llama-imatrix`` reads a text file,
tokenizes it with the file's own tokenizer, cuts chunks of ``--ctx`` tokens and puts BOS
first in each chunk when the vocabulary asks for one), are the calibration windows of
both: ``llama-imatrix -c CTX -b CTX --chunks N`` on the text file, and
:func:`prunelab.calib.imatrix.collect_imatrix` on exactly those token ids (prunelab's
float32 forward; llama.cpp's f16 weights and its own kernels). For every weight the
quantizer reads, the mean squared input per column (what the quantizer uses) is compared:
the largest relative difference of the per-column means, the relative difference of the
whole vector (``||a - b|| / ||b||``), and the Pearson correlation. Then both matrices
quantize the model to q4_k_m and q3_k_m and the two files' perplexities in llama.cpp are
compared. ``llama-imatrix`` comes from ``scripts/build_llama_tools.sh`` (llama.cpp's sources
of the installed llama-cpp-python, fetched by pip) unless --llama-bin names a folder.
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

import numpy as np
import torch

import prunelab
from prunelab.calib.imatrix import collect_imatrix
from prunelab.checkpoint.gguf_export import quantize_gguf, write_gguf
from prunelab.checkpoint.imatrix import read_imatrix
from prunelab.data.sources import load_text_source
from prunelab.eval.llamacpp import llamacpp_perplexity
from prunelab.models.gguf_llama import require_llama_cpp


def llama_bin(given: str | None) -> Path:
    if given:
        return Path(given)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(["bash", str(root / "scripts" / "build_llama_tools.sh")],
                          capture_output=True, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def llama_chunks(gguf_path: Path, text: str, ctx: int, chunks: int) -> torch.Tensor:
    """The token windows ``llama-imatrix`` processes for ``text`` (see the docstring)."""
    llama_cpp = require_llama_cpp()
    with llama_cpp.suppress_stdout_stderr(disable=False):
        llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    bos = ids[0] == llm.token_bos()
    n = min(chunks, len(ids) // ctx)
    windows = torch.tensor(ids[:n * ctx]).reshape(n, ctx)
    if bos:
        windows[:, 0] = llm.token_bos()
    return windows


def compare(ours: dict, theirs: dict) -> list[dict]:
    rows = []
    for name in sorted(theirs):
        a, b = ours.get(name), theirs[name]
        if a is None or a.shape != b.shape:
            rows.append({"name": name, "missing": True})
            continue
        a, b = a.astype(np.float64), b.astype(np.float64)
        rows.append({"name": name, "max_rel": float(np.max(np.abs(a - b) / np.maximum(b, 1e-12))),
                     "rel": float(np.linalg.norm(a - b) / np.linalg.norm(b)),
                     "corr": float(np.corrcoef(a, b)[0, 1])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8, help="held-out windows (perplexity)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-bin")
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()

    tools = llama_bin(opts.llama_bin)
    tmp = Path(tempfile.mkdtemp(prefix="prunelab-imatrix-"))
    lm = prunelab.load(opts.model)
    f16 = tmp / "dense.f16.gguf"
    write_gguf(lm, f16, "f16")
    text = load_text_source("wiki-vital:calib").text()
    (tmp / "calib.txt").write_text(text)
    windows = llama_chunks(f16, text, opts.ctx, opts.chunks)
    theirs_path = tmp / "llama.imatrix.gguf"
    subprocess.run([str(tools / "llama-imatrix"), "-m", str(f16), "-f", str(tmp / "calib.txt"),
                    "-c", str(opts.ctx), "-b", str(opts.ctx), "--chunks",
                    str(windows.shape[0]), "-o", str(theirs_path), "--no-ppl", "-t",
                    str(opts.threads)], check=True, capture_output=True)
    theirs = read_imatrix(theirs_path)
    ours = collect_imatrix(lm, windows, dataset="wiki-vital:calib")
    rows = compare(ours.means(), theirs.means())
    ok = [r for r in rows if not r.get("missing")]
    test = prunelab.api.tokens_for(lm, "wiki-vital:test", seqlen=256, samples=opts.windows,
                                   mode="test").input_ids
    ppl = {}
    for kind in ("q4_k_m", "q3_k_m", "iq3_xxs"):
        for who, im in (("prunelab", ours), ("llama-imatrix", theirs)):
            path = tmp / f"{who}.{kind}.gguf"
            quantize_gguf(f16, path, kind, threads=opts.threads, imatrix=im)
            ppl[kind, who] = llamacpp_perplexity(path, test, threads=opts.threads)["perplexity"]
    lines = [f"Weights compared: {len(ok)} of {len(rows)} in llama-imatrix's file "
             f"({sum(1 for r in rows if r.get('missing'))} missing from prunelab's); tokens "
             f"counted: prunelab {next(iter(ours.counts.values()))}, llama-imatrix "
             f"{next(iter(theirs.counts.values()))}.", "",
             "| per-column mean square, prunelab vs llama-imatrix | worst weight | median |",
             "|---|---|---|"]
    for key, label, worst in (("max_rel", "largest relative difference of a column", max),
                              ("rel", "relative difference of the vector", max),
                              ("corr", "Pearson correlation", min)):
        vals = [r[key] for r in ok]
        lines.append(f"| {label} | {worst(vals):.2e} | {float(np.median(vals)):.2e} |")
    lines += ["", "| type | perplexity, prunelab's matrix | perplexity, llama-imatrix's |",
              "|---|---|---|"]
    for kind in ("q4_k_m", "q3_k_m", "iq3_xxs"):
        lines.append(f"| {kind} | {ppl[kind, 'prunelab']:.3f} | "
                     f"{ppl[kind, 'llama-imatrix']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if opts.out:
        import llama_cpp

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        cpu = next((ln.split(":", 1)[1].strip() for ln in
                    Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), platform.processor())
        head = (f"# Importance matrix: prunelab against llama-imatrix\n\nMeasured "
                f"{datetime.date.today()} at commit {commit} on {os.cpu_count()} cores "
                f"({cpu}), llama.cpp of llama-cpp-python {llama_cpp.__version__}.\n\n"
                f"Command: `python {' '.join(sys.argv)}`\n\n"
                f"Model {opts.model}, {windows.shape[0]} chunks of {opts.ctx} tokens of "
                "wiki-vital:calib as llama.cpp tokenizes them; perplexity on "
                f"{test.shape[0]} x 256 tokens of wiki-vital:test inside llama.cpp.\n\n")
        opts.out.write_text(head + table + "\n")
        print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
