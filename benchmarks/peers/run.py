"""prunelab beside its peers: run one peer or all, write ``benchmarks/results/peers.md``.

Usage (pin to one core, as the page's figures were measured)::

    taskset -c 1 python benchmarks/peers/run.py --all
    taskset -c 1 python benchmarks/peers/run.py --peer kvpress [--peer torch-pruning]
    taskset -c 1 python benchmarks/peers/run.py --peer kvpress --quick   # smoke protocol
    taskset -c 1 python benchmarks/peers/run.py --peer kvpress --ratios 0.25 --windows 2

Each peer module (``peer_*.py``) installs its tool at a pinned version in its own venv
under ``.bench/peers/`` (``common.ensure_venv``), runs it and prunelab on the same token ids
in fresh processes, and returns a markdown section; this script rewrites that peer's
section of the page only (``table.update_page``), so peers can be rerun one at a time, and
saves the raw figures as ``.bench/peers/<peer>.json``. ``--quick`` runs each peer's small
smoke protocol and writes to ``.bench/peers/peers-quick.md`` unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import table  # noqa: E402

PAGE = common.ROOT / "benchmarks" / "results" / "peers.md"
MODULES = {"kvpress": "peer_kvpress", "snapkv-settings": "peer_snapkv_settings",
           "llm-compressor": "peer_llmcompressor",
           "torch-pruning": "peer_torch_pruning", "modelopt": "peer_modelopt",
           "mergekit": "peer_mergekit"}


@dataclass
class Context:
    model: str
    quick: bool
    workdir: Path
    commit: str
    machine: str
    command: str
    ratios: tuple[float, ...] | None = None
    windows: int | None = None


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(common.ROOT), "rev-parse", "--short=10",
                              "HEAD"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.strip()


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        cores = []
    return (f"{cpu}, {os.cpu_count()} cores, job pinned to core(s) "
            f"{','.join(map(str, cores)) or '?'}, 1 thread, Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="run every peer")
    ap.add_argument("--peer", action="append", choices=sorted(MODULES),
                    help="run this peer (repeatable)")
    ap.add_argument("--quick", action="store_true", help="small smoke protocol")
    ap.add_argument("--model", default="smollm2-135m", help="prunelab model spec")
    ap.add_argument("--ratios", help="comma-separated budgets instead of the peer's own "
                    "(kvpress: fractions of the cache removed, default 0.25,0.5,0.75)")
    ap.add_argument("--windows", type=int, help="kvpress: test windows instead of the "
                    "protocol's (full 6, quick 2)")
    ap.add_argument("--out", help=f"page to update (default {PAGE.relative_to(common.ROOT)}; "
                    "with --quick .bench/peers/peers-quick.md)")
    args = ap.parse_args(argv)
    if args.all == bool(args.peer):
        ap.error("give --all or --peer NAME (not both)")
    names = [n for n in table.ORDER if args.all or n in args.peer]
    out = Path(args.out) if args.out else (common.BENCH / "peers-quick.md" if args.quick
                                           else PAGE)
    cores = sorted(os.sched_getaffinity(0))
    pin = "" if len(cores) == os.cpu_count() else \
        f"taskset -c {','.join(str(c) for c in cores)} "
    command = pin + "python benchmarks/peers/run.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    common.BENCH.mkdir(parents=True, exist_ok=True)
    os.environ.update(common.ONE_THREAD)
    import torch
    import transformers

    import prunelab
    import prunelab.log

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    prunelab.log.set_quiet(True)
    ctx = Context(model=args.model, quick=args.quick,
                  workdir=common.BENCH / ("work-quick" if args.quick else "work"),
                  commit=git_commit(), machine=machine(), command=command,
                  ratios=tuple(float(r) for r in args.ratios.split(",")) if args.ratios
                  else None, windows=args.windows)
    failed = 0
    for name in names:
        mod = __import__(MODULES[name])
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            body, raw = mod.run(ctx)
        except common.IdsMismatch:
            raise
        except Exception as exc:  # one peer's failure must not lose the others' sections
            failed += 1
            body = (f"## {name}\n\nRun {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                    f"commit `{ctx.commit}`; command `{command}`.\n\nFailed: "
                    f"`{type(exc).__name__}: {exc}`")
            raw = {"error": repr(exc)}
        page = out.read_text() if out.is_file() else ""
        out.write_text(table.update_page(page, name, body))
        (common.BENCH / f"{name}{'-quick' if args.quick else ''}.json").write_text(
            json.dumps(raw, indent=2, default=str))
        print(body, flush=True)
        print(f"== {name}: {time.perf_counter() - t0:.0f} s; wrote {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
