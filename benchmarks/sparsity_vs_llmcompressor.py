"""Unstructured and 2:4 sparsity: prunelab against llm-compressor on the embedded model.

On ``--model`` (default ``smollm2-135m``; any prunelab spec, e.g. ``qwen2.5-coder-1.5b``;
float32, CPU, or ``--dtype`` / ``--device``) both libraries prune the 30 blocks' linears with the
same calibration tokens (``--samples`` windows of ``--seqlen`` from ``wiki-vital:calib``,
seed 0) for each setting of ``--settings``: Wanda and SparseGPT at 50 % unstructured and
at 2:4. prunelab runs ``prunelab.prune(lm, Wanda(...)/SparseGPT(...), calib,
batch_size=8)``; llm-compressor runs ``oneshot`` with ``WandaPruningModifier`` /
``SparseGPTModifier`` (sequential pipeline, one ``LlamaDecoderLayer`` per subgraph,
``lm_head`` ignored) in its own virtual environment, ``.bench/llmc-venv``, created on first
use (llm-compressor pins an older ``transformers`` than prunelab's); ``--skip-llmc`` runs
prunelab alone.

Every measured job runs in a fresh process (this script spawned with ``--job``, or
``_llmc_worker.py`` under the venv's Python) and writes a JSON result. Reported per
setting and side:

- wall s: the pruning call alone (``prunelab.prune`` / ``oneshot``), model already loaded;
- peak MiB: peak RSS during that call (``prunelab.eval.speed.PeakRSS``, 2 ms sampling)
  minus the RSS just before it, after the weights were paged in and the free heap pages
  left by loading were returned to the system (``malloc_trim``, on both sides);
- test ppl: perplexity on ``--test-samples`` windows of ``wiki-vital:test``; both sides'
  pruned checkpoints are loaded with ``prunelab.load`` and scored in this process by
  ``prunelab.evaluate`` on one and the same test ``TokenBatches`` object;
- sparsity: zero fraction over the ``nn.Linear`` weights of the blocks;
- embed zeros: zero fraction of the input embedding (tied to ``lm_head`` in SmolLM2: it
  shows whether the LM head, and through the tie the embeddings, were pruned);

and the prunelab / llm-compressor ratio. Also printed: the dense test perplexity and the
lower bound on a pruning run's time, one calibration forward pass through the blocks
(``BlockRunner(lm, ids, batch_size=8).run()``). Targets (reported, not asserted):
prunelab wall time <= 0.5x llm-compressor's, test perplexity within +1 % of it.

Note on ``ignore``: with llm-compressor 0.14 the default ``targets=["Linear"]`` names a
matched module ``"lm_head."`` inside its own match, so the plain ``ignore=["lm_head"]``
does not match it and the LM head (and the tied embeddings) get pruned;
``"re:.*lm_head"`` (the form llm-compressor's own docs use) does match. Both are passed
by default (``--llmc-ignore``).

Run (20-40 min on 2 cores; the first run also installs the venv, about 1 min)::

    python benchmarks/sparsity_vs_llmcompressor.py [--samples 64 --seqlen 512]
        [--test-samples 32] [--settings wanda-0.5,sparsegpt-0.5,wanda-2:4,sparsegpt-2:4]
        [--skip-llmc] [--json out.json] [--model qwen2.5-coder-0.5b]
        [--dtype bfloat16 --device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_llmc_worker.py"
DEFAULT_VENV = ROOT / ".bench" / "llmc-venv"
TORCH_PIN = "torch==2.13.0"
LLMC_PIN = "llmcompressor==0.14.0.1"
SETTINGS = ("wanda-0.5", "sparsegpt-0.5", "wanda-2:4", "sparsegpt-2:4")
MiB = 2**20
MODEL = "smollm2-135m"  # --model; the jobs get it on their command line
DTYPE = "float32"
DEVICE = "cpu"


def _set_model(args) -> None:
    global MODEL, DTYPE, DEVICE
    MODEL, DTYPE, DEVICE = args.model, args.dtype, args.device


def _model_args() -> list[str]:
    return ["--model", MODEL, "--dtype", DTYPE, "--device", DEVICE]


def parse_setting(s: str) -> tuple[str, float, str | None]:
    """``"wanda-0.5"`` -> ("wanda", 0.5, None); ``"sparsegpt-2:4"`` -> (.., 0.5, "2:4")."""
    method, _, level = s.partition("-")
    if method not in ("wanda", "sparsegpt") or not level:
        raise SystemExit(f"bad setting {s!r}: use wanda-0.5, sparsegpt-2:4, ...")
    if ":" in level:
        n, m = (int(x) for x in level.split(":"))
        return method, 1.0 - n / m, level
    return method, float(level), None


def label(s: str) -> str:
    method, sparsity, pattern = parse_setting(s)
    return f"{method} {pattern}" if pattern else f"{method} {sparsity:.0%}"


# ----------------------------------------------------------------------------- jobs
# Each runs in a fresh process: ``python this.py --job NAME --workdir DIR``.

def _quiet():
    import transformers

    import prunelab.log

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    prunelab.log.set_quiet(True)


def _page_in(model) -> int:
    """Read every weight once (they load as a file-backed mmap), then return the RSS."""
    import gc

    import psutil
    import torch

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.sum()
    gc.collect()
    _trim_heap()
    return psutil.Process().memory_info().rss


def _trim_heap() -> None:
    """Both sides' baseline: the free heap pages left by loading go back to the system
    first (glibc ``malloc_trim``), so the peak over it counts what the pruning call holds."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def block_linear_sparsity(lm) -> tuple[float, int]:
    import torch

    zeros = total = 0
    for block in lm.adapter.blocks():
        for m in block.modules():
            if isinstance(m, torch.nn.Linear):
                zeros += int((m.weight == 0).sum())
                total += m.weight.numel()
    return zeros / max(total, 1), total


def embed_zero_fraction(lm) -> tuple[float, float, bool]:
    model = lm.model
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    return (float((emb == 0).sum()) / emb.numel(), float((head == 0).sum()) / head.numel(),
            emb is head)


def _load_model():
    import prunelab

    return prunelab.load(MODEL, dtype=DTYPE, device=DEVICE)


def job_prunelab(setting: str, workdir: Path, within_block: str = "default",
                 propagate: str = "default") -> dict:
    import torch

    import prunelab
    from prunelab.eval.speed import PeakRSS

    _quiet()
    method, sparsity, pattern = parse_setting(setting)
    cls = prunelab.Wanda if method == "wanda" else prunelab.SparseGPT
    kw = {k: v for k, v in (("within_block", within_block), ("propagate", propagate))
          if v != "default"}  # "default": the method's own (Wanda dense/dense, ...)
    cfg = cls(pattern=pattern, **kw) if pattern else cls(sparsity=sparsity, **kw)
    lm = _load_model()
    calib = torch.load(workdir / "calib.batches", weights_only=False)
    baseline = _page_in(lm.model)
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        report = prunelab.prune(lm, cfg, calib, batch_size=8)
        seconds = time.perf_counter() - t0
    achieved, params = block_linear_sparsity(lm)
    emb, head, tied = embed_zero_fraction(lm)
    save_dir = workdir / f"prunelab-{setting.replace(':', '_')}"
    prunelab.save(lm, save_dir, overwrite=True)
    return {"side": "prunelab", "method": method, "sparsity_target": sparsity,
            "pattern": pattern, "config": repr(cfg), "seconds": seconds,
            "report_seconds": report["seconds"], "report_achieved_sparsity":
            report["achieved_sparsity"], "baseline_rss": baseline, "peak_rss": rss.peak,
            "extra_peak": rss.peak - baseline, "achieved_sparsity": achieved,
            "pruned_linear_params": params, "embed_zero_fraction": emb,
            "lm_head_zero_fraction": head, "tied_after": tied,
            "threads": torch.get_num_threads(), "save_dir": str(save_dir),
            "cuda_peak_bytes": (torch.cuda.max_memory_allocated()
                                if torch.cuda.is_available() else None)}


def job_lower_bound(workdir: Path) -> dict:
    import torch

    from prunelab.calib.runner import BlockRunner
    from prunelab.eval.speed import PeakRSS

    _quiet()
    lm = _load_model()
    calib = torch.load(workdir / "calib.batches", weights_only=False)
    baseline = _page_in(lm.model)
    runner = BlockRunner(lm, calib.input_ids, batch_size=8)
    with torch.no_grad(), PeakRSS() as rss:
        t0 = time.perf_counter()
        runner.run()
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "extra_peak": rss.peak - baseline,
            "blocks": lm.adapter.num_blocks, "block_evals": runner.block_evals,
            "threads": torch.get_num_threads()}


def run_job(args) -> None:
    _set_model(args)
    workdir = Path(args.workdir)
    if args.job == "lower-bound":
        out = job_lower_bound(workdir)
    elif args.job.startswith("prunelab-"):
        out = job_prunelab(args.job.removeprefix("prunelab-"), workdir, args.within_block,
                           args.propagate)
    else:
        raise SystemExit(f"unknown job {args.job!r}")
    Path(args.result).write_text(json.dumps(out, indent=2))


# ------------------------------------------------------------------- llm-compressor venv

def _pip(py: Path, *pkgs: str, log) -> None:
    cmd = [str(py), "-m", "pip", "install", "--progress-bar", "off", *pkgs]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def _venv_ok(py: Path) -> str | None:
    """The venv's ``llmcompressor`` / ``torch`` versions if it is usable, else None."""
    if not py.is_file():
        return None
    probe = ("import llmcompressor, torch, datasets, psutil, transformers; "
             "print('VERSIONS', llmcompressor.__version__, torch.__version__, "
             "transformers.__version__)")
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("VERSIONS ")]
    return lines[-1].removeprefix("VERSIONS ") if r.returncode == 0 and lines else None


def ensure_llmc_venv(venv: Path) -> tuple[Path | None, dict]:
    """Create ``venv`` with llm-compressor on first use; reuse it when it works.

    torch is pinned first (a CPU wheel that lies on this machine's disk): an unpinned
    torch pulled by llm-compressor would be a multi-GB CUDA build. Returns the venv's
    Python (None if the install failed) and the steps with their durations.
    """
    py = venv / "bin" / "python"
    info: dict = {"venv": str(venv), "steps": []}
    found = _venv_ok(py)
    if found:
        print(f"llm-compressor venv: reusing {venv} (llmcompressor, torch, transformers = "
              f"{found})", flush=True)
        info["reused"] = found
        return py, info
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = venv.parent / "llmc-venv-install.log"
    print(f"llm-compressor venv: installing into {venv} (log {log_path})", flush=True)
    steps = [("create venv", lambda log: subprocess.run(
                 [sys.executable, "-m", "venv", str(venv)], check=True, stdout=log,
                 stderr=subprocess.STDOUT)),
             (f"pip install {TORCH_PIN}", lambda log: _pip(py, TORCH_PIN, log=log)),
             (f"pip install {TORCH_PIN} {LLMC_PIN} psutil",
              lambda log: _pip(py, TORCH_PIN, LLMC_PIN, "psutil", log=log))]
    with open(log_path, "a") as log:
        for name, step in steps:
            print(f"  {name} ...", end=" ", flush=True)
            t0 = time.perf_counter()
            try:
                step(log)
            except (subprocess.CalledProcessError, OSError) as exc:
                print("FAILED", flush=True)
                print(f"llm-compressor could not be installed ({name}: {exc}); see "
                      f"{log_path}. Skipping the llm-compressor side.", flush=True)
                info["steps"].append({"step": name, "seconds": time.perf_counter() - t0,
                                      "error": str(exc)})
                return None, info
            dt = time.perf_counter() - t0
            info["steps"].append({"step": name, "seconds": dt})
            print(f"{dt:.0f} s", flush=True)
    found = _venv_ok(py)
    if not found:
        print(f"llm-compressor venv at {venv} does not import llmcompressor/torch/datasets; "
              "skipping the llm-compressor side.", flush=True)
        return None, info
    if "+cpu" not in found.split()[1]:
        print(f"warning: the venv's torch is {found.split()[1]}, not the CPU build",
              flush=True)
    print(f"  installed: llmcompressor, torch, transformers = {found}", flush=True)
    info["installed"] = found
    return py, info


# ------------------------------------------------------------------------ driver

def spawn(cmd: list[str], result: Path, log: Path, env: dict | None = None) -> dict:
    """Run one job in a fresh process; returns its JSON result or {"error": ...}."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not result.is_file():
        tail = log.read_text(errors="replace").splitlines()[-15:]
        print(f"    job failed (exit {rc}); last lines of {log}:", flush=True)
        for line in tail:
            print(f"      {line}", flush=True)
        return {"error": f"exit {rc}", "log": str(log)}
    out = json.loads(result.read_text())
    out["process_seconds"] = time.perf_counter() - t0
    return out


def evaluate_dir(path: str, test) -> float:
    import prunelab

    lm = prunelab.load(path, dtype=DTYPE, device=DEVICE)
    ppl = float(prunelab.evaluate(lm, test, batch_size=4)["perplexity"])
    del lm
    return ppl


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def print_table(results: dict, dense_ppl: float, lower: dict, args) -> None:
    print()
    print(f"{MODEL}, {DTYPE}, {DEVICE}, {lower.get('threads', '?')} threads; calibration "
          f"{args.samples} x {args.seqlen} tokens of wiki-vital:calib (seed 0), test "
          f"{args.test_samples} x {args.seqlen} of wiki-vital:test")
    print(f"dense test ppl {dense_ppl:.3f}; lower bound (one calibration pass through the "
          f"{lower.get('blocks', '?')} blocks, BlockRunner batch 8): "
          f"{fmt(lower.get('seconds'), '.1f')} s")
    rows = [("wall s", "seconds", ".1f"), ("peak MiB (over base)", "extra_peak_mib", ".0f"),
            ("test ppl", "ppl", ".3f"), ("sparsity (blocks)", "achieved_sparsity", ".4f"),
            ("embed zero fraction", "embed_zero_fraction", ".4f")]
    head = f"{'setting':<15}{'':<22}{'prunelab':>12}{'llm-compressor':>16}{'ratio':>8}"
    print(head)
    print("-" * len(head))
    for s in args.settings:
        r = results[s]
        for i, (name, key, spec) in enumerate(rows):
            a, b = r["prunelab"].get(key), r["llmc"].get(key)
            rat = ratio(a, b) if key in ("seconds", "extra_peak_mib", "ppl") else ""
            print(f"{label(s) if i == 0 else '':<15}{name:<22}{fmt(a, spec):>12}"
                  f"{fmt(b, spec):>16}{rat:>8}")
        a, b = r["prunelab"], r["llmc"]
        if a.get("seconds") and b.get("seconds") and a.get("ppl") and b.get("ppl"):
            t, p = a["seconds"] / b["seconds"], a["ppl"] / b["ppl"] - 1
            lb = lower.get("seconds")
            extra = f", prunelab = {a['seconds'] / lb:.2f}x the lower bound" if lb else ""
            print(f"{'':<15}targets: wall <= 0.5x: {'yes' if t <= 0.5 else 'NO'} "
                  f"({t:.2f}x); ppl <= +1 %: {'yes' if p <= 0.01 else 'NO'} "
                  f"({p:+.2%}){extra}")
    print()


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=MODEL, help="prunelab model spec (default %(default)s)")
    ap.add_argument("--dtype", default=DTYPE, choices=("float32", "bfloat16"),
                    help="both sides load the model in this dtype")
    ap.add_argument("--device", default=DEVICE, help="prunelab: cpu or cuda (llm-compressor's "
                    "sequential pipeline uses the GPU by itself when there is one)")
    ap.add_argument("--samples", type=int, default=64, help="calibration windows")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--test-samples", type=int, default=32, help="test windows")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--skip-llmc", action="store_true", help="run prunelab alone")
    ap.add_argument("--skip-prunelab", action="store_true", help="run llm-compressor alone "
                    "(e.g. when prunelab's side is measured by benchmarks/stream_memory.py)")
    ap.add_argument("--skip-lower-bound", action="store_true",
                    help="do not time the one-pass lower bound")
    ap.add_argument("--skip-dense", action="store_true",
                    help="do not score the dense model (saves one evaluation pass)")
    ap.add_argument("--skip-eval", action="store_true",
                    help="do not score the pruned checkpoints (time and memory only)")
    ap.add_argument("--within-block", default="default",
                    choices=("default", "sequential", "dense"),
                    help="prunelab's order inside a block (see prune sparsity --within-block); "
                    "default: each method's own (Wanda dense, SparseGPT sequential)")
    ap.add_argument("--propagate", default="default", choices=("default", "modified", "dense"),
                    help="prunelab: pass on the pruned or the dense block outputs; default: "
                    "each method's own (Wanda dense, SparseGPT modified)")
    ap.add_argument("--venv", default=str(DEFAULT_VENV), help="llm-compressor venv")
    ap.add_argument("--llmc-batch-size", type=int, default=8,
                    help="oneshot batch_size (default 8, as prunelab's)")
    ap.add_argument("--llmc-ignore", default="lm_head,re:.*lm_head",
                    help="comma-separated ignore list for the llm-compressor modifiers")
    ap.add_argument("--json", metavar="PATH", help="also write all figures as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the pruned checkpoints")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _set_model(args)
    if args.job:
        run_job(args)
        return None
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in args.settings:
        parse_setting(s)

    import torch
    import transformers

    import prunelab
    import prunelab.log
    from prunelab.data import make_batches

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    prunelab.log.set_quiet(True)
    started = time.time()

    llmc_py, install = (None, {"skipped": True})
    if not args.skip_llmc:
        llmc_py, install = ensure_llmc_venv(Path(args.venv))

    lm = _load_model()
    source = str(lm.source)
    calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=args.seqlen,
                         samples=args.samples, seed=0)
    test = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=args.seqlen,
                        samples=args.test_samples)
    bench_dir = ROOT / ".bench"
    bench_dir.mkdir(exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="sparsity-vs-llmc-", dir=bench_dir))
    torch.save(calib, workdir / "calib.batches")
    torch.save(calib.input_ids.clone(), workdir / "calib_ids.pt")
    print(f"work dir {workdir}; calibration sha256 {calib.sha256[:12]}, test sha256 "
          f"{test.sha256[:12]}", flush=True)

    dense_ppl = float("nan")
    if not args.skip_dense:
        print("dense test perplexity ...", flush=True)
        dense_ppl = float(prunelab.evaluate(lm, test, batch_size=4)["perplexity"])
        print(f"  {dense_ppl:.3f}", flush=True)
    emb0 = float((lm.model.get_input_embeddings().weight == 0).float().mean())
    del lm

    me = [sys.executable, str(Path(__file__).resolve())]
    lower: dict = {}
    if not args.skip_lower_bound:
        print("lower bound: one BlockRunner pass ...", flush=True)
        lower = spawn(me + [*_model_args(), "--job", "lower-bound", "--workdir",
                            str(workdir), "--result", str(workdir / "lower-bound.json")],
                      workdir / "lower-bound.json", workdir / "lower-bound.log")
        print(f"  {fmt(lower.get('seconds'), '.1f')} s", flush=True)

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    results: dict = {}
    for s in args.settings:
        method, sparsity, pattern = parse_setting(s)
        tag = s.replace(":", "_")
        results[s] = {"prunelab": {}, "llmc": {}}
        if not args.skip_prunelab:
            print(f"{label(s)}: prunelab ...", flush=True)
            results[s]["prunelab"] = spawn(
                me + ["--job", f"prunelab-{s}", "--workdir", str(workdir), "--result",
                      str(workdir / f"prunelab-{tag}.json"), "--within-block",
                      args.within_block, *_model_args(), "--propagate", args.propagate],
                workdir / f"prunelab-{tag}.json", workdir / f"prunelab-{tag}.log")
        if llmc_py is not None:
            print(f"{label(s)}: llm-compressor ...", flush=True)
            save_dir = workdir / f"llmc-{tag}"
            cmd = [str(llmc_py), str(WORKER), "--model-dir", source, "--calib",
                   str(workdir / "calib_ids.pt"), "--method", method, "--sparsity",
                   str(sparsity), "--mask-structure", pattern or "0:0", "--ignore",
                   args.llmc_ignore, "--batch-size", str(args.llmc_batch_size),
                   "--save-dir", str(save_dir), "--result", str(workdir / f"llmc-{tag}.json"),
                   "--dtype", DTYPE]
            results[s]["llmc"] = spawn(cmd, workdir / f"llmc-{tag}.json",
                                       workdir / f"llmc-{tag}.log", env=env)
        for side in ("prunelab", "llmc"):
            r = results[s][side]
            if "save_dir" not in r:
                continue
            r["extra_peak_mib"] = r["extra_peak"] / MiB
            r["ppl"] = None if args.skip_eval else evaluate_dir(r["save_dir"], test)
            if not args.keep:
                shutil.rmtree(r["save_dir"], ignore_errors=True)
            print(f"  {side}: {r['seconds']:.1f} s, +{r['extra_peak_mib']:.0f} MiB "
                  f"(peak {r['peak_rss'] / MiB:.0f} MiB), ppl "
                  f"{fmt(r['ppl'], '.3f')}, sparsity {r['achieved_sparsity']:.4f}, embed zeros "
                  f"{r['embed_zero_fraction']:.4f}", flush=True)

    print_table(results, dense_ppl, lower, args)
    print(f"total {(time.time() - started) / 60:.1f} min; logs in {workdir}")
    out = {"model": MODEL, "dtype": DTYPE, "device": DEVICE, "samples": args.samples,
           "seqlen": args.seqlen,
           "test_samples": args.test_samples, "calib": calib.to_dict(), "test": test.to_dict(),
           "dense_ppl": dense_ppl, "dense_embed_zero_fraction": emb0, "lower_bound": lower,
           "llmc_install": install, "llmc_batch_size": args.llmc_batch_size,
           "llmc_ignore": args.llmc_ignore, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
