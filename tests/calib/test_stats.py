"""Accumulators on hand-computed cases."""

from __future__ import annotations

import torch

from prunelab.calib.stats import AbsQuantile, Gram, MeanVar, SumSquares

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
