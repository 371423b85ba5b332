"""CPU seconds and module counts of the CLI's help paths, each in a fresh interpreter.

    PYTHONPATH=src python benchmarks/cli_startup.py [--repeat 3]

For each of ``prunelab --help``, ``prunelab prune --help`` and ``prunelab prune sparsity
--help``: the child's user + system CPU seconds (best of ``--repeat``), the number of
modules it imported, and whether torch / transformers were among them. The catalog the
help reads is built once beforehand (a first run after a source change rebuilds it in a
child process, which this script does not time)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CASES = (["--help"], ["prune", "--help"], ["prune", "sparsity", "--help"])
PROBE = ("import sys, json, io, contextlib\n"
         "from prunelab.cli import cli_main\n"
         "with contextlib.redirect_stdout(io.StringIO()):\n"
         "    code = cli_main(json.loads(sys.argv[1]))\n"
         "print(json.dumps({'code': code, 'modules': len(sys.modules),\n"
         "                  'torch': 'torch' in sys.modules,\n"
         "                  'transformers': 'transformers' in sys.modules}))\n")


def run_once(args: list[str]) -> tuple[float, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True,
                         text=True, env=dict(os.environ, COLUMNS="100"), check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    opts = ap.parse_args()
    run_once(["prune", "sparsity", "--help"])  # warm the catalog and the disk cache
    print(f"{'command':32} {'cpu s':>6} {'modules':>8} torch transformers")
    for args in CASES:
        runs = [run_once(args) for _ in range(opts.repeat)]
        cpu, info = min(runs, key=lambda r: r[0])
        print(f"{'prunelab ' + ' '.join(args):32} {cpu:6.2f} {info['modules']:8d} "
              f"{str(info['torch']):5} {info['transformers']}")


if __name__ == "__main__":
    main()
