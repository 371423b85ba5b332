"""Single- vs multi-threaded float64 decompositions at SmolLM2 / 0.5B sizes on this CPU,
printed side by side (the reason :mod:`prunelab.linalg` runs them on one thread).

Run::

    python benchmarks/linalg_threads.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    many = torch.get_num_threads()
    print(f"| operation | shape | 1 thread s | {many} threads s | ratio |")
    print("|---|---|---|---|---|")
    for d, m in ((576, 1536), (896, 4864)):
        a = torch.randn(d, d, dtype=torch.float64)
        sym = a @ a.T + d * torch.eye(d, dtype=torch.float64)
        rect = torch.randn(m, d, dtype=torch.float64)
        ops = {"eigh": (lambda s=sym: torch.linalg.eigh(s), f"{d}x{d}"),
               "svd": (lambda r=rect: torch.linalg.svd(r, full_matrices=False), f"{m}x{d}"),
               "cholesky": (lambda s=sym: torch.linalg.cholesky(s), f"{d}x{d}"),
               "qr": (lambda r=rect: torch.linalg.qr(r), f"{m}x{d}")}
        for name, (fn, shape) in ops.items():
            torch.set_num_threads(1)
            one = best(fn, args.repeats)
            torch.set_num_threads(many)
            multi = best(fn, args.repeats)
            print(f"| {name} | {shape} | {one:.4f} | {multi:.4f} | {multi / one:.1f}x |")


if __name__ == "__main__":
    main()
