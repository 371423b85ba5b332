"""Peak memory of pruning with and without layer-wise loading from disk (``--stream``).

For each method of ``--methods`` (default Wanda and SparseGPT at ``--sparsity`` 0.5) the
model ``--model`` (default the embedded ``smollm2-135m``; e.g. ``qwen2.5-coder-1.5b``) is
loaded, pruned on ``--samples`` windows of ``--seqlen`` tokens of ``wiki-vital:calib``
(seed 0) and saved, once resident (``prunelab.load(spec)``) and once streamed
(``prunelab.load(spec, stream=True)``: blocks read from the safetensors shards one at a
time, pruned blocks staged to disk, the checkpoint assembled shard by shard). Every run is
a fresh process (this script with ``--job``). Reported per run:

- peak RSS: ``VmHWM`` (peak RSS) of the job process (load +
  prune + save; includes Python, torch and the calibration activations of all samples;
  the windows are tokenized once by this script, so the corpus is not counted), and
  above imports: the same minus the RSS after importing torch, transformers and
  prunelab;
- ratio: peak RSS / the model's float32 bytes;
- wall s: load + prune + save, and the prune call alone;
- test ppl: perplexity of the saved checkpoint on ``--test-samples`` windows of
  ``wiki-vital:test`` (scored streamed in a separate process; streamed and resident
  evaluation give the same number, see tests/models/test_streaming.py).

Run (about 10 min on 2 cores for SmolLM2 at the defaults)::

    python benchmarks/stream_memory.py [--model smollm2-135m] [--methods wanda,sparsegpt]
        [--samples 32 --seqlen 256] [--test-samples 16] [--threads 1] [--json out.json]
        [--modes resident,stream]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_rss() -> int:
    """This process's peak RSS in bytes: ``VmHWM`` of ``/proc/self/status`` (Linux), which
    starts afresh at ``exec``; ``ru_maxrss`` keeps the high-water mark of the parent at
    ``fork`` (the driver holds the tokenized corpus), so it is used only as a fallback."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _job(args) -> dict:
    """One load + prune + save in this (fresh) process; the result as a dict."""
    import torch

    import prunelab
    from prunelab.pruning.base import METHODS

    torch.set_num_threads(args.threads)
    calib = torch.load(args.calib, weights_only=False)
    rss_imports = _peak_rss()
    t0 = time.perf_counter()
    lm = prunelab.load(args.model, dtype="float32", stream=args.stream)
    float32_bytes = lm.size_before["params"] * 4
    if args.stream:
        lm.streamer.work_dir = Path(args.out).parent
    rss_loaded = _peak_rss()
    cfg = METHODS.make(args.method, sparsity=args.sparsity)
    t1 = time.perf_counter()
    rep = prunelab.prune(lm, cfg, calib, batch_size=8)
    t2 = time.perf_counter()
    prunelab.save(lm, args.out, data=rep["data"])
    t3 = time.perf_counter()
    return {"model": args.model, "method": args.method, "stream": args.stream,
            "peak_rss_bytes": _peak_rss(),
            "rss_after_load_bytes": rss_loaded, "rss_imports_bytes": rss_imports,
            "float32_bytes": float32_bytes,
            "wall_s": t3 - t0, "prune_s": t2 - t1,
            "achieved_sparsity": rep["achieved_sparsity"]}


def _eval_job(args) -> dict:
    import torch

    import prunelab

    torch.set_num_threads(args.threads)
    lm = prunelab.load(args.out, dtype="float32", stream=True)
    res = prunelab.evaluate(lm, torch.load(args.test, weights_only=False), batch_size=4)
    return {"perplexity": res["perplexity"],
            "eval_peak_rss_bytes": _peak_rss()}


def _tokens(args, work: Path) -> list[str]:
    """Calibration and test windows made once here (the corpus and the tokenizer are not
    part of the measured jobs), passed to every job as files."""
    import torch
    import transformers

    from prunelab.data import make_batches
    from prunelab.models.loading import resolve_source

    tok = transformers.AutoTokenizer.from_pretrained(resolve_source(args.model))
    for name, data, n in (("calib", "wiki-vital:calib", args.samples),
                          ("test", "wiki-vital:test", args.test_samples)):
        b = make_batches(tok, data, seqlen=args.seqlen, samples=n, seed=0, mode=name)
        # the windows may view the whole tokenized corpus: save only their own tokens
        b = dataclasses.replace(b, input_ids=b.input_ids.clone().contiguous())
        torch.save(b, work / f"{name}.pt")
        print(f"{name}: {n} x {args.seqlen} tokens, sha256 {b.sha256[:12]}", file=sys.stderr,
              flush=True)
    return ["--calib", str(work / "calib.pt"), "--test", str(work / "test.pt")]


def _spawn(flags: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONWARNINGS="ignore")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result = Path(fh.name)
    try:
        proc = subprocess.run([sys.executable, __file__, *flags, "--result", str(result)],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"job {flags} failed:\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())
    finally:
        result.unlink(missing_ok=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="wanda,sparsegpt")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--test-samples", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", default="resident,stream",
                   help="which runs per method: resident, stream or both (default)")
    p.add_argument("--json", type=Path)
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--eval-job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--calib", help=argparse.SUPPRESS)
    p.add_argument("--test", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job or args.eval_job:
        args.result.write_text(json.dumps(_job(args) if args.job else _eval_job(args)))
        return
    common = ["--model", args.model, "--sparsity", str(args.sparsity), "--samples",
              str(args.samples), "--seqlen", str(args.seqlen), "--test-samples",
              str(args.test_samples), "--threads", str(args.threads)]
    rows = []
    work = Path(tempfile.mkdtemp(prefix="stream-bench-"))
    try:
        common += _tokens(args, work)
        for method in args.methods.split(","):
            for stream in [m == "stream" for m in args.modes.split(",")]:
                out = work / f"{method}-{'stream' if stream else 'resident'}"
                flags = [*common, "--method", method, "--out", str(out)]
                row = _spawn(["--job", *flags, *(["--stream"] if stream else [])],
                             args.threads)
                row.update(_spawn(["--eval-job", *flags], args.threads))
                shutil.rmtree(out, ignore_errors=True)
                rows.append(row)
                print(f"done: {method} stream={stream}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _print(rows, args)
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=2, default=str))


def _print(rows: list[dict], args) -> None:
    f32 = rows[0]["float32_bytes"]
    print(f"{args.model}: float32 weights {_mib(f32)} MiB; {args.samples} x {args.seqlen} "
          f"calibration tokens, {args.test_samples} x {args.seqlen} test tokens, "
          f"{args.threads} thread(s)")
    print(f"{'method':<10} {'mode':<9} {'peak RSS MiB':>12} {'/ f32':>6} "
          f"{'above imports':>13} {'wall s':>7} {'prune s':>8} {'test ppl':>9}")
    for r in rows:
        above = r['peak_rss_bytes'] - r['rss_imports_bytes']
        print(f"{r['method']:<10} {'stream' if r['stream'] else 'resident':<9} "
              f"{_mib(r['peak_rss_bytes']):>12} {r['peak_rss_bytes'] / f32:>6.2f} "
              f"{_mib(above):>13} "
              f"{r['wall_s']:>7.1f} {r['prune_s']:>8.1f} {r['perplexity']:>9.3f}")


if __name__ == "__main__":
    main()
