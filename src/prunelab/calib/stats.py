"""Pure statistics accumulators over a linear layer's inputs.

Each accumulator takes activation matrices ``x`` of shape ``[tokens, d_in]`` through
``update`` (any dtype; maths in float32 or float64) and exposes its result. They know
nothing about models or hooks: the calibration runner feeds them.
"""

from __future__ import annotations

import abc
import contextlib
import threading

import torch

_PRODUCTS = threading.local()  # the dtype of the Gram products inside low_precision_products


@contextlib.contextmanager
def low_precision_products(dtype: torch.dtype | None):
    """Inside, with ``dtype=torch.bfloat16``: :class:`Gram` products of CPU tensors are
    bfloat16 matmuls accumulated and returned in float32 (oneDNN's
    ``fp32_precision="bf16"``: AMX or AVX512-BF16 where the CPU has them), added to the
    Gram's own accumulator (float32 or float64). The inputs are rounded to bfloat16 once,
    every product of two rounded inputs is exact in float32, and the sums are float32:
    the Gram of the bfloat16-rounded activations. ``None`` (or a torch without that
    switch, or another device): the exact products, as outside."""
    prev = getattr(_PRODUCTS, "dtype", None)
    _PRODUCTS.dtype = dtype if dtype == torch.bfloat16 and _bf16_switch() else None
    try:
        yield
    finally:
        _PRODUCTS.dtype = prev


def _bf16_switch():
    """oneDNN's float32-matmul precision switch, or ``None`` in a torch without it."""
    mm = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    return mm if mm is not None and hasattr(mm, "fp32_precision") else None


@contextlib.contextmanager
def _bf16_matmuls():
    mm = _bf16_switch()
    prev = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = prev


class Accumulator(abc.ABC):
    """Base class: ``update(x)`` with ``x`` of shape ``[tokens, d_in]``."""

    tokens: int = 0

    @abc.abstractmethod
    def update(self, x: torch.Tensor) -> None:
        """Add a batch of activations."""


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class SumSquares(Accumulator):
    """Per input channel ``sum_t x[t, j]^2`` (summed in float64) and the token and row
    counts.

    ``rows`` counts the sequences seen (the leading batch dimension of the raw input), as
    Wanda's ``||X_j||^2`` is averaged over calibration sequences.
    """

    def __init__(self) -> None:
        self.sum_sq: torch.Tensor | None = None
        self.tokens = 0
        self.rows = 0

    def update(self, x: torch.Tensor) -> None:
        self.rows += x.shape[0] if x.dim() > 2 else 1
        x = _flat(x)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.to(torch.float32)
        # squares and the batch's (pairwise) sum in x's dtype, the running sum in float64:
        # a float64 reduction over the tokens costs three times as much on a CPU
        s = x.square().sum(0).to(torch.float64)
        self.sum_sq = s if self.sum_sq is None else self.sum_sq + s
        self.tokens += x.shape[0]

    def mean_sq(self) -> torch.Tensor:
        """``E_t x_j^2``, shape ``[d_in]``."""
        return self.sum_sq / max(self.tokens, 1)

    def norm(self) -> torch.Tensor:
        """``||X_j||_2`` over all tokens, shape ``[d_in]``."""
        return self.sum_sq.sqrt()


class Gram(Accumulator):
    """``X^T X`` summed over tokens (``[d_in, d_in]``, float64 by default).

    Only the upper triangle is accumulated, in ``GRAM_PANELS`` row panels (one in-place
    ``addmm`` each: a panel's rows against the columns from its own start), which skips
    about a third of the multiply-adds of a full ``x^T x``; :attr:`xtx` mirrors the upper
    triangle into an exactly symmetric matrix the first time it is read after an update.
    Below ``PANEL_MIN`` input channels one full product is used. Inside
    :func:`low_precision_products` (bfloat16 calibration) the products are bfloat16
    matmuls with float32 accumulation.
    """

    GRAM_PANELS = 3
    PANEL_MIN = 256

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        self.dtype = dtype
        self.tokens = 0
        self._acc: torch.Tensor | None = None
        self._sym: torch.Tensor | None = None

    def update(self, x: torch.Tensor) -> None:
        x = _flat(x)
        d = x.shape[1]
        if self._acc is None:
            self._acc = torch.zeros((d, d), dtype=self.dtype, device=x.device)
        if getattr(_PRODUCTS, "dtype", None) is not None and x.device.type == "cpu":
            self._add_low(x.to(torch.float32))
        else:
            self._add(self._acc, x.to(self.dtype))
        self._sym = None
        self.tokens += x.shape[0]

    def _add(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        """``acc += upper(x^T x)`` in panels (``acc`` and ``x`` of one dtype)."""
        d = x.shape[1]
        if d < self.PANEL_MIN:
            acc.addmm_(x.t(), x)
            return
        step = -(-d // self.GRAM_PANELS)
        for a in range(0, d, step):
            acc[a:a + step, a:].addmm_(x[:, a:a + step].t(), x[:, a:])

    def _add_low(self, x: torch.Tensor) -> None:
        """The products as bfloat16 matmuls with float32 accumulation (``x`` float32),
        added to the accumulator in its dtype."""
        with _bf16_matmuls():
            if self._acc.dtype == torch.float32:
                self._add(self._acc, x)
                return
            part = torch.zeros(self._acc.shape, dtype=torch.float32, device=x.device)
            self._add(part, x)
        self._acc += part

    @property
    def xtx(self) -> torch.Tensor | None:
        """The symmetric ``X^T X`` (``None`` before the first update)."""
        if self._acc is None:
            return None
        if self._sym is None:
            upper = self._acc.triu()
            self._sym = upper + upper.triu(1).t()
        return self._sym

    def take(self) -> torch.Tensor | None:
        """The symmetric ``X^T X`` handed over to the caller, made in the accumulator's own
        storage (the values of :attr:`xtx`, without its copies); the Gram is empty
        afterwards (``xtx`` is ``None``, ``tokens`` kept). For a caller that consumes the
        matrix (SparseGPT factorises it in place): one ``[d_in, d_in]`` matrix alive, not
        three."""
        out = self._sym if self._sym is not None else self._acc
        if self._sym is None and out is not None:
            mirror_upper_(out)
        self._acc = self._sym = None
        return out

    def mean(self) -> torch.Tensor:
        """``X^T X / tokens``."""
        return self.xtx / max(self.tokens, 1)


def mirror_upper_(a: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``a`` (square) made symmetric in place from its upper triangle (diagonal
    included): the strict lower triangle becomes the transposed strict upper one, in row
    panels of ``chunk`` (temporaries of at most ``chunk^2`` numbers). Returns ``a``."""
    d = a.shape[0]
    for s in range(0, d, chunk):
        e = min(s + chunk, d)
        a[e:, s:e] = a[s:e, e:].t()
        blk = a[s:e, s:e]
        blk.copy_(blk.triu() + blk.triu(1).t())
    return a


class MeanVar(Accumulator):
    """Per-channel mean and (population) variance, from float64 sums."""

    def __init__(self) -> None:
        self.s1: torch.Tensor | None = None
        self.s2: torch.Tensor | None = None
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        x = _flat(x).to(torch.float64)
        a, b = x.sum(0), (x * x).sum(0)
        self.s1 = a if self.s1 is None else self.s1 + a
        self.s2 = b if self.s2 is None else self.s2 + b
        self.tokens += x.shape[0]

    def mean(self) -> torch.Tensor:
        return self.s1 / max(self.tokens, 1)

    def var(self) -> torch.Tensor:
        m = self.mean()
        return (self.s2 / max(self.tokens, 1) - m * m).clamp_min(0.0)


class AbsQuantile(Accumulator):
    """Quantiles of ``|x|`` over all entries, from a seeded uniform subsample.

    Keeps the ``max_samples`` entries with the largest random keys (a uniform sample
    without replacement); exact when fewer entries were seen. Same seed, same data ->
    same answer.
    """

    def __init__(self, max_samples: int = 1_000_000, seed: int = 0) -> None:
        self.max_samples = int(max_samples)
        self.gen = torch.Generator().manual_seed(seed)
        self.values = torch.zeros(0)
        self.keys = torch.zeros(0)
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        v = _flat(x).abs().reshape(-1).float().cpu()
        self.tokens += _flat(x).shape[0]
        k = torch.rand(v.numel(), generator=self.gen)
        vals, keys = torch.cat([self.values, v]), torch.cat([self.keys, k])
        if vals.numel() > self.max_samples:
            top = torch.topk(keys, self.max_samples).indices
            vals, keys = vals[top], keys[top]
        self.values, self.keys = vals, keys

    def quantile(self, q: float) -> float:
        if self.values.numel() == 0:
            raise ValueError("no activations seen")
        return float(torch.quantile(self.values.double(), q))
