"""Dense decompositions (eigh, SVD, QR, Cholesky, solves) for prunelab's float64 maths.

On CPU hosts with few cores, multi-threaded LAPACK calls on matrices of a few hundred to
a few thousand rows are many times slower than single-threaded ones (measured on the
2-core CI machine, SmolLM2 sizes: ``eigh`` of 576 x 576 float64 0.04 s on one thread,
0.3-6 s on two; ``svd`` of 1536 x 576 0.13 s vs 0.7 s), and far worse when another
process shares the cores. These wrappers run the decomposition on one thread when the
tensor is on the CPU and its matrices are at most :data:`SINGLE_THREAD_MAX` on a side,
and restore the thread count afterwards; everything else calls ``torch.linalg`` as is.
``benchmarks/linalg_threads.py`` prints the comparison on the current machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from scipy.stats import spearmanr

#: largest matrix side decomposed on a single CPU thread
SINGLE_THREAD_MAX = 4096


@contextlib.contextmanager
def _threads_for(t: torch.Tensor) -> Iterator[None]:
    n = torch.get_num_threads()
    single = t.device.type == "cpu" and n > 1 and max(t.shape[-2:]) <= SINGLE_THREAD_MAX
    if not single:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def eigh(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.eigh(a, *args, **kwargs)


def eigvalsh(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.eigvalsh(a, *args, **kwargs)


def svd(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.svd(a, *args, **kwargs)


def svdvals(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.svdvals(a, *args, **kwargs)


def qr(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.qr(a, *args, **kwargs)


def cholesky(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.cholesky(a, *args, **kwargs)


def cholesky_ex(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.cholesky_ex(a, *args, **kwargs)


def solve(a: torch.Tensor, b: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.solve(a, b, *args, **kwargs)


def solve_triangular(a: torch.Tensor, b: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.solve_triangular(a, b, *args, **kwargs)


def inv(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.inv(a, *args, **kwargs)


def lstsq(a: torch.Tensor, b: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.lstsq(a, b, *args, **kwargs)


def pinv(a: torch.Tensor, *args, **kwargs):
    with _threads_for(a):
        return torch.linalg.pinv(a, *args, **kwargs)


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman rank correlation (average ranks for ties); 0 when undefined."""
    if x.numel() < 2:
        return 0.0
    rho = spearmanr(x.double().numpy(), y.double().numpy()).statistic
    return 0.0 if rho != rho else float(rho)
