"""Accumulators on hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from prunelab.calib.stats import (
    AbsQuantile,
    Gram,
    MeanVar,
    SumSquares,
    low_precision_products,
)

X1 = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
X2 = torch.tensor([[[0.0, 1.0]], [[2.0, 0.0]]])  # [batch 2, tokens 1, d 2]


def test_sum_squares_hand_computed():
    acc = SumSquares()
    acc.update(X1)
    acc.update(X2)
    assert acc.sum_sq.tolist() == [1 + 9 + 0 + 4, 4 + 16 + 1 + 0]
    assert acc.tokens == 4 and acc.rows == 1 + 2
    assert acc.mean_sq().tolist() == [14 / 4, 21 / 4]
    torch.testing.assert_close(acc.norm(), torch.tensor([14.0, 21.0], dtype=torch.float64).sqrt())


def test_gram_hand_computed():
    acc = Gram()
    acc.update(X1)
    acc.update(X2)
    # rows: (1,2) (3,-4) (0,1) (2,0)
    expected = [[1 + 9 + 0 + 4, 2 - 12 + 0 + 0], [2 - 12, 4 + 16 + 1 + 0]]
    assert acc.xtx.tolist() == expected
    assert acc.mean().tolist() == [[v / 4 for v in row] for row in expected]


def test_gram_panels_equal_full_product_exactly():
    # 300 channels takes the upper-triangle panel route; small integers keep every sum
    # exact, so the mirrored result must equal x^T x bit for bit, and stay symmetric.
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(-3, 4, (2, 50, 300), generator=g).float() for _ in range(3)]
    for dtype in (torch.float32, torch.float64):
        acc = Gram(dtype)
        acc.update(xs[0])
        first = acc.xtx.clone()
        for x in xs[1:]:
            acc.update(x)  # an update after a read must not serve the stale matrix
        full = torch.cat([x.reshape(-1, 300) for x in xs]).to(dtype)
        assert torch.equal(first, xs[0].reshape(-1, 300).to(dtype).t()
                           @ xs[0].reshape(-1, 300).to(dtype))
        assert torch.equal(acc.xtx, full.t() @ full)
        assert torch.equal(acc.xtx, acc.xtx.t()) and acc.tokens == 300


def test_mean_var_hand_computed():
    acc = MeanVar()
    acc.update(torch.tensor([[1.0], [3.0]]))
    acc.update(torch.tensor([[5.0]]))
    assert acc.mean().tolist() == [3.0]
    assert abs(acc.var().item() - 8 / 3) < 1e-12


def test_abs_quantile_exact_and_seeded():
    acc = AbsQuantile(max_samples=1000)
    acc.update(torch.arange(-50, 51, dtype=torch.float32).reshape(-1, 1))  # |x| 0..50, 101 vals
    assert acc.quantile(0.5) == 25.0 and acc.quantile(1.0) == 50.0
    data = torch.randn(4000, 8, generator=torch.Generator().manual_seed(1))
    a, b, c = AbsQuantile(500, seed=3), AbsQuantile(500, seed=3), AbsQuantile(500, seed=4)
    for acc in (a, b, c):
        acc.update(data[:2000])
        acc.update(data[2000:])
    assert a.values.numel() == 500
    assert a.quantile(0.99) == b.quantile(0.99)
    assert a.quantile(0.99) != c.quantile(0.99)
    exact = float(torch.quantile(data.abs().reshape(-1).double(), 0.9))
    assert abs(a.quantile(0.9) - exact) < 0.15


def _bf16_products_available():
    mm = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    return mm is not None and hasattr(mm, "fp32_precision")


@pytest.mark.skipif(not _bf16_products_available(), reason="no oneDNN fp32_precision switch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [40, 300])  # one product; panels
def test_gram_low_precision_products_are_the_gram_of_rounded_inputs(dtype, d):
    """Inside low_precision_products(bfloat16): the Gram of the bfloat16-rounded inputs
    (each product exact in float32, float32 sums), in the accumulator's dtype; the switch
    is restored on exit and the exact products come back outside."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, d, generator=gen) for _ in range(3)]
    low, exact = Gram(dtype), Gram(dtype)
    mm = torch.backends.mkldnn.matmul
    before = mm.fp32_precision
    with low_precision_products(torch.bfloat16):
        for x in xs:
            low.update(x)
    assert mm.fp32_precision == before and low.xtx.dtype == dtype
    for x in xs:
        exact.update(x.bfloat16().double())
    torch.testing.assert_close(low.xtx.double(), exact.xtx.double(), rtol=1e-5, atol=1e-4)
    plain = Gram(dtype)
    with low_precision_products(None):
        for x in xs:
            plain.update(x)
    ref = sum(x.double().t() @ x.double() for x in xs)
    torch.testing.assert_close(plain.xtx.double(), ref, rtol=1e-5, atol=1e-4)
    assert (low.xtx.double() - ref).abs().max() > 1e-3  # the rounding is there


def test_sum_squares_float32_batches_float64_running_sum():
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, 50, 7, generator=gen) for _ in range(4)]
    acc = SumSquares()
    for x in xs:
        acc.update(x)
    assert acc.sum_sq.dtype == torch.float64
    ref = sum(x.double().square().sum((0, 1)) for x in xs)
    torch.testing.assert_close(acc.sum_sq, ref, rtol=1e-6, atol=0)
