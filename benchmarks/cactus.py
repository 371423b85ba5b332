"""CACTUS and the ADMM weight update against Wanda and SparseGPT on the embedded model.

On ``smollm2-135m`` (float32, CPU) every method prunes the selected linears of the 30
blocks (``--targets mlp``: the MLP projections; ``all``: every linear of a block) with the
same calibration tokens (``--calib`` windows of ``--seqlen`` from ``wiki-vital:calib``,
seed 0), at each of ``--settings`` (``0.5`` unstructured, ``2:4``). Methods
(``--methods``, comma-separated):

- ``wanda``, ``sparsegpt``: the baselines;
- ``admm-wanda``, ``admm-sparsegpt``, ``admm-magnitude``: the ADMM weight update (Boza
  2024; 20 iterations, rho 1, damping 0.1) on that method's mask;
- ``admm-gradual``: ADMM with the mask chosen in the first 15 iterations (cubic schedule);
- ``admm-warm``: ADMM on SparseGPT's mask started from SparseGPT's weights, stopped on
  the residuals (``--tolerance``, default 1e-3; at most 100 iterations);
- ``cactus``: ADMM on the Kronecker curvature G kron A (gradual mask);
- ``cactus-warm``: CACTUS on SparseGPT's mask (not gradual), warm start and tolerance as
  ``admm-warm``;
- ``cactus-r16``, ``cactus-r64``: CACTUS sparse + rank-16 / rank-64 low-rank (S + L
  stored as factors; parameters nnz(S) + r (m + n)).

Each run is a fresh process (this script with ``--job``) and reports: test perplexity on
``--test`` windows of ``wiki-vital:test``, gradient alignment to the dense model (mean
per-window cosine of the loss gradients with respect to every block's ``down_proj``, on
the first ``--grad-windows`` test windows), the pruning wall time (model loaded), the peak
RSS over the process's RSS before the call (``PeakRSS``), the stored parameters of the
pruned linears, and, per setting, ratios to SparseGPT: perplexity, the share of
SparseGPT's perplexity gap to the dense model closed (``(ppl_sgpt - ppl) / (ppl_sgpt -
ppl_dense)``) and wall time. Issue-15 targets (reported, not asserted): CACTUS closes >=
25 % of SparseGPT's gap at 50 %, its gradient alignment is above SparseGPT's, its wall
time <= 3x SparseGPT's.

Full run (hours on 2 cores)::

    python benchmarks/cactus.py [--calib 64 --test 32 --seqlen 512]
        [--settings 0.5,2:4] [--targets mlp,all] [--methods wanda,sparsegpt,cactus]
        [--grad-windows 32] [--json out.json]

Smoke test (a minute)::

    python benchmarks/cactus.py --calib 2 --test 2 --seqlen 64 --methods admm-wanda \\
        --settings 0.5 --targets mlp --grad-windows 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "smollm2-135m"
MiB = 2**20
METHODS = ("wanda", "sparsegpt", "admm-wanda", "admm-sparsegpt", "admm-magnitude",
           "admm-gradual", "admm-warm", "cactus", "cactus-warm", "cactus-r16", "cactus-r64")

TARGETS = {"mlp": ("mlp.*",), "all": ()}


def make_config(method: str, setting: str, targets: str, tolerance: float = 1e-3):
    """The prunelab config of a benchmark row."""
    import prunelab
    from prunelab.pruning.sparsity.methods.admm import Admm
    from prunelab.pruning.sparsity.methods.cactus import Cactus

    level = {"pattern": setting} if ":" in setting else {"sparsity": float(setting)}
    common = {"targets": TARGETS[targets], **level}
    if method == "wanda":
        return prunelab.Wanda(**common)
    if method == "sparsegpt":
        return prunelab.SparseGPT(**common)
    if method == "admm-gradual":
        return Admm(gradual=True, **common)
    warm = {"mask_from": "sparsegpt", "warm_start": True, "tolerance": tolerance,
            "iterations": 100}
    if method == "admm-warm":
        return Admm(**warm, **common)
    if method == "cactus-warm":
        return Cactus(gradual=False, **warm, **common)
    if method.startswith("admm-"):
        return Admm(mask_from=method.removeprefix("admm-"), **common)
    if method == "cactus":
        return Cactus(**common)
    if method.startswith("cactus-r"):
        return Cactus(rank=int(method.removeprefix("cactus-r")), **common)
    raise SystemExit(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def _page_in(model) -> int:
    import psutil
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return psutil.Process().memory_info().rss


def stored(lm, cfg) -> int:
    from prunelab.pruning.linears import selected_linears
    from prunelab.pruning.sparsity.sparse_lowrank import stored_params

    return sum(stored_params(m) for i in range(lm.adapter.num_blocks)
               for m in selected_linears(lm, i, cfg).values())


def job(spec: dict, workdir: Path) -> dict:
    """One row: prune (timed, peak RSS), then perplexity and gradient alignment."""
    import torch

    import prunelab
    from prunelab.eval.gradient_alignment import gradient_alignment
    from prunelab.eval.speed import PeakRSS

    calib = torch.load(workdir / "calib.batches", weights_only=False)
    test = torch.load(workdir / "test.batches", weights_only=False)
    lm = prunelab.load(MODEL)
    out: dict = {"method": spec["method"], "setting": spec["setting"],
                 "targets": spec["targets"]}
    if spec["method"] != "dense":
        cfg = make_config(spec["method"], spec["setting"], spec["targets"],
                          spec.get("tolerance", 1e-3))
        baseline = _page_in(lm.model)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            rep = prunelab.prune(lm, cfg, calib, batch_size=8)
            out["seconds"] = time.perf_counter() - t0
        out["extra_peak_mib"] = (rss.peak - baseline) / MiB
        out["achieved_sparsity"] = rep["achieved_sparsity"]
        out["stored_params"] = stored(lm, cfg)
        out["config"] = repr(cfg)
    out["ppl"] = prunelab.evaluate(lm, test, batch_size=4)["perplexity"]
    if spec["method"] == "dense":
        out["grad_alignment"] = 1.0
    else:
        dense = prunelab.load(MODEL)
        ga = gradient_alignment(lm, dense, test.input_ids[:spec["grad_windows"]],
                                batch_size=2)
        out["grad_alignment"] = ga["gradient_alignment"]
    return out


def run_in_process(spec: dict, workdir: Path) -> dict:
    result = workdir / "result.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, __file__, "--job", json.dumps(spec),
                    "--workdir", str(workdir), "--result", str(result)], check=True, env=env)
    return json.loads(result.read_text())


def print_table(rows: list[dict]) -> None:
    base = {(r["setting"], r["targets"]): r for r in rows if r["method"] == "sparsegpt"}
    dense = next((r["ppl"] for r in rows if r["method"] == "dense"), None)
    head = (f"{'targets':7} {'setting':7} {'method':15} {'ppl':>9} {'ppl/sgpt':>8} "
            f"{'gap closed':>10} {'grad cos':>8} {'wall s':>7} {'wall/sgpt':>9} "
            f"{'peak MiB':>8} {'params':>10}")
    print(head)
    for r in rows:
        b = base.get((r["setting"], r["targets"]))
        def ratio(k, r=r, b=b):
            return f"{r[k] / b[k]:.2f}" if b and k in r and b.get(k) else ""

        gap = ""
        if b and dense is not None and r["method"] != "dense" and b["ppl"] != dense:
            gap = f"{(b['ppl'] - r['ppl']) / (b['ppl'] - dense):+.0%}"
        print(f"{r['targets']:7} {r['setting']:7} {r['method']:15} {r['ppl']:9.2f} "
              f"{ratio('ppl'):>8} {gap:>10} {r['grad_alignment']:8.3f} "
              f"{r.get('seconds', 0):7.1f} {ratio('seconds'):>9} "
              f"{r.get('extra_peak_mib', 0):8.0f} {r.get('stored_params', 0):10d}")


def main(argv: list[str] | None = None) -> list[dict] | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calib", type=int, default=64, help="calibration windows")
    ap.add_argument("--test", type=int, default=32, help="test windows")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--settings", default="0.5,2:4")
    ap.add_argument("--targets", default="mlp,all", help="mlp and/or all")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--grad-windows", type=int, default=None,
                    help="test windows for the gradient alignment (default: all)")
    ap.add_argument("--tolerance", type=float, default=1e-3,
                    help="residual tolerance of the admm-warm / cactus-warm rows")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        res = job(json.loads(args.job), Path(args.workdir))
        Path(args.result).write_text(json.dumps(res))
        return None
    import torch

    import prunelab
    from prunelab.api import tokens_for

    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        make_config(m, "0.5", "mlp")  # unknown names fail before any work
    lm = prunelab.load(MODEL)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        torch.save(tokens_for(lm, "wiki-vital:calib", seqlen=args.seqlen,
                                       samples=args.calib, mode="calib"), work / "calib.batches")
        torch.save(tokens_for(lm, "wiki-vital:test", seqlen=args.seqlen,
                                       samples=args.test, mode="test"), work / "test.batches")
        del lm
        grad = args.grad_windows or args.test
        specs = [{"method": "dense", "setting": "-", "targets": "-", "grad_windows": grad}]
        specs += [{"method": m, "setting": s, "targets": t, "grad_windows": grad,
                   "tolerance": args.tolerance}
                  for t in args.targets.split(",") for s in args.settings.split(",")
                  for m in methods]
        for spec in specs:
            rows.append(run_in_process(spec, work))
            r = rows[-1]
            print(f"  {r['method']} {r['setting']} {r['targets']}: ppl {r['ppl']:.2f}, "
                  f"grad cos {r['grad_alignment']:.3f}, {r.get('seconds', 0):.1f} s",
                  flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
