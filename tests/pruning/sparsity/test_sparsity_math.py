"""Pure maths of unstructured / N:M sparsity: masks, scores, SparseGPT, ROSE, allocation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prunelab.errors import ConfigError
from prunelab.pruning.sparsity import (
    achieved_sparsity,
    hessian_blend,
    magnitude_scores,
    nm_mask,
    outlier_ratio,
    owl,
    pals,
    parse_pattern,
    qk_wanda_scores,
    ramp,
    rescale_to_target,
    rose_permutation,
    rose_prune,
    shared_budget_masks,
    sparsegpt_prune,
    uniform,
    unstructured_mask,
    wanda_scores,
)

FAST = settings(max_examples=40, deadline=None)
PATTERNS = [(1, 2), (2, 4), (4, 8), (3, 4)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- patterns and masks


def test_parse_pattern():
    assert parse_pattern("2:4") == (2, 4)
    assert parse_pattern(" 4:8 ") == (4, 8)
    assert parse_pattern("unstructured") is None
    assert parse_pattern(None) is None
    for bad in ["4:2", "2:2", "0:4", "a:b", "2:4:8", "24"]:
        with pytest.raises(ConfigError, match=bad):
            parse_pattern(bad)


def test_wanda_row_mask_hand_example():
    W = torch.tensor([[1.0, -2.0, 3.0, -4.0],
                      [4.0, 3.0, -2.0, 1.0],
                      [0.5, -1.0, 2.0, 0.1]])
    col_sq_norm = torch.tensor([4.0, 1.0, 0.25, 1.0])  # sqrt: [2, 1, 0.5, 1]
    # scores: row0 [2, 2, 1.5, 4]; row1 [8, 3, 1, 1]; row2 [1, 1, 1, 0.1]
    # prune 2 per row; ties prune the lower column first.
    expected = torch.tensor([[False, True, False, True],
                             [True, True, False, False],
                             [False, True, True, False]])
    scores = wanda_scores(W, col_sq_norm)
    assert scores.dtype == torch.float32
    assert torch.equal(unstructured_mask(scores, 0.5, group="row"), expected)
    # magnitude alone would prune the two smallest |W| of row 0 instead
    assert unstructured_mask(magnitude_scores(W), 0.5)[0].tolist() == [False, False, True, True]


@FAST
@given(rows=st.integers(1, 6), cols=st.integers(1, 40), s=st.floats(0.0, 0.95),
       seed=st.integers(0, 10_000))
def test_unstructured_row_mask_exact_per_row(rows, cols, s, seed):
    scores = torch.rand(rows, cols, generator=_gen(seed))
    keep = unstructured_mask(scores, s, group="row")
    pruned_per_row = (~keep).sum(dim=1)
    assert torch.all(pruned_per_row == math.floor(cols * s + 1e-9))
    assert torch.all((pruned_per_row.double() / cols - s).abs() <= 1.0 / cols)
    achieved = achieved_sparsity(torch.where(keep, scores + 1.0, torch.zeros(())))
    assert abs(achieved - s) <= 1.0 / cols
    for r in range(rows):  # every kept score >= every pruned score of the row
        if keep[r].any() and (~keep[r]).any():
            assert scores[r][keep[r]].min() >= scores[r][~keep[r]].max()


@FAST
@given(rows=st.integers(1, 6), cols=st.integers(1, 30), s=st.floats(0.0, 0.95),
       seed=st.integers(0, 10_000))
def test_unstructured_layer_mask_exact_count(rows, cols, s, seed):
    scores = torch.randn(rows, cols, generator=_gen(seed))
    keep = unstructured_mask(scores, s, group="layer")
    assert int((~keep).sum()) == math.floor(rows * cols * s + 1e-9)
    if keep.any() and (~keep).any():
        assert scores[keep].min() >= scores[~keep].max()


def test_unstructured_mask_rejects_bad_input():
    with pytest.raises(ConfigError):
        unstructured_mask(torch.rand(2, 4), 1.0)
    with pytest.raises(ConfigError):
        unstructured_mask(torch.rand(2, 4), 0.5, group="column")
    assert unstructured_mask(torch.rand(4, 100), 0.29).logical_not().sum(1).eq(29).all()


@FAST
@given(nm=st.sampled_from(PATTERNS), rows=st.integers(1, 8), groups=st.integers(1, 6),
       seed=st.integers(0, 10_000))
def test_nm_mask_exactly_n_per_group(nm, rows, groups, seed):
    n, m = nm
    scores = torch.randn(rows, groups * m, generator=_gen(seed))
    keep = nm_mask(scores, n, m)
    g_keep = keep.reshape(rows, groups, m)
    assert torch.all(g_keep.sum(dim=2) == n)
    g_scores = scores.reshape(rows, groups, m)
    kept_min = torch.where(g_keep, g_scores, torch.full((), math.inf)).amin(dim=2)
    pruned_max = torch.where(~g_keep, g_scores, torch.full((), -math.inf)).amax(dim=2)
    assert torch.all(kept_min >= pruned_max)


def test_nm_mask_needs_divisible_width():
    with pytest.raises(ConfigError, match="divisible"):
        nm_mask(torch.rand(2, 6), 2, 4)


# ---------------------------------------------------------------- scores


def test_qk_wanda_hand_case():
    Wq = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    Wk = torch.tensor([[1.0, -1.0], [2.0, 0.5]])
    xq = torch.tensor([1.0, 2.0])
    k_act = torch.tensor([10.0, 20.0])
    q_act = torch.tensor([1.0, 2.0, 3.0, 4.0])
    sq, sk = qk_wanda_scores(Wq, Wk, xq, k_act, q_act, num_heads=2, num_kv_heads=1, head_dim=2)
    assert sq.dtype == torch.float64 and sk.dtype == torch.float64
    expected_q = torch.tensor([[10.0, 80.0], [180.0, 640.0], [250.0, 720.0], [980.0, 2560.0]])
    expected_k = torch.tensor([[4.0, 8.0], [24.0, 3.0]])  # q sums: c0 1+3=4, c1 2+4=6
    assert torch.allclose(sq, expected_q.double())
    assert torch.allclose(sk, expected_k.double())


def test_qk_wanda_gqa_mapping_matches_loop():
    g = _gen(0)
    nh, nkv, hd, d_in = 4, 2, 3, 5
    Wq, Wk = torch.randn(nh * hd, d_in, generator=g), torch.randn(nkv * hd, d_in, generator=g)
    xq, k_act, q_act = (torch.rand(d_in, generator=g), torch.rand(nkv * hd, generator=g),
                        torch.rand(nh * hd, generator=g))
    sq, sk = qk_wanda_scores(Wq, Wk, xq, k_act, q_act, nh, nkv, hd)
    G = nh // nkv
    for r in range(nh * hd):
        h, c = divmod(r, hd)
        for j in range(d_in):
            want = Wq[r, j].double() ** 2 * xq[j] * k_act[(h // G) * hd + c]
            assert math.isclose(float(sq[r, j]), float(want), rel_tol=1e-6)
    for r in range(nkv * hd):
        kv, c = divmod(r, hd)
        qsum = sum(float(q_act[h * hd + c]) for h in range(nh) if h // G == kv)
        for j in range(d_in):
            want = float(Wk[r, j]) ** 2 * float(xq[j]) * qsum
            assert math.isclose(float(sk[r, j]), want, rel_tol=1e-6)


@FAST
@given(s=st.floats(0.0, 0.95), seed=st.integers(0, 10_000))
def test_shared_budget_masks_joint_count(s, seed):
    g = _gen(seed)
    a, b = torch.rand(4, 6, generator=g), torch.rand(2, 6, generator=g) * 3
    ka, kb = shared_budget_masks([a, b], s)
    assert ka.shape == a.shape and kb.shape == b.shape
    assert int((~ka).sum() + (~kb).sum()) == math.floor(36 * s + 1e-9)
    kept = torch.cat([a[ka], b[kb]])
    pruned = torch.cat([a[~ka], b[~kb]])
    if kept.numel() and pruned.numel():
        assert kept.min() >= pruned.max()


# ---------------------------------------------------------------- SparseGPT and ROSE


def _layer(seed: int = 0, rows: int = 32, cols: int = 64, tokens: int = 256):
    g = _gen(seed)
    X = torch.randn(tokens, 16, generator=g) @ torch.randn(16, cols, generator=g)
    X = X + 0.1 * torch.randn(tokens, cols, generator=g)  # correlated columns
    W = torch.randn(rows, cols, generator=g)
    return X, W


def _err(X, W, W_hat):
    return float(torch.linalg.norm(X @ W.T - X @ W_hat.T))


@pytest.mark.parametrize("blocksize", [16, 128])
def test_sparsegpt_beats_wanda(blocksize):
    X, W = _layer()
    W_sg, keep = sparsegpt_prune(W, X.T @ X, 0.5, blocksize=blocksize)
    W_wanda = W * unstructured_mask(wanda_scores(W, (X**2).sum(0)), 0.5)
    assert W_sg.dtype == W.dtype and keep.dtype == torch.bool
    for w_hat in (W_sg, W_wanda):
        assert torch.all((w_hat == 0).sum(dim=1) == 32)
    assert torch.equal(W_sg == 0, ~keep)
    assert _err(X, W, W_sg) < _err(X, W, W_wanda)


def test_sparsegpt_update_is_damped_least_squares():
    # When the pruned columns form a prefix, sequential OBS equals the joint optimum:
    # the kept weights solve the damped normal equations on the kept columns.
    X, W = (t.double() for t in _layer(8, rows=8))
    W[:, :32] *= 1e-8
    H = X.T @ X
    W_new, keep = sparsegpt_prune(W, H, 0.5, blocksize=64)
    assert not keep[:, :32].any() and keep[:, 32:].all()
    Hd = H + 0.01 * H.diagonal().mean() * torch.eye(64, dtype=torch.float64)
    kept = torch.arange(32, 64)
    W_opt = torch.linalg.solve(Hd[kept][:, kept], (W @ Hd[:, kept]).T).T
    assert torch.allclose(W_new[:, kept], W_opt, atol=1e-9)
    # float32 maths agrees with float64 maths
    W32, keep32 = sparsegpt_prune(W.float(), H.float(), 0.5, blocksize=64)
    assert torch.equal(keep32, keep) and torch.allclose(W32.double(), W_new, atol=1e-4)


def test_sparsegpt_block_mask_group():
    X, W = _layer(9)
    _, keep = sparsegpt_prune(W, X.T @ X, 0.3, blocksize=16, mask_group="block")
    for b in range(0, 64, 16):
        assert int((~keep[:, b:b + 16]).sum()) == math.floor(32 * (b + 16) * 0.3) - math.floor(
            32 * b * 0.3)


@pytest.mark.parametrize("nm", PATTERNS)
def test_sparsegpt_nm_pattern(nm):
    n, m = nm
    X, W = _layer(1)
    W_sg, keep = sparsegpt_prune(W, X.T @ X, pattern=nm, blocksize=16)
    assert torch.all(keep.reshape(32, -1, m).sum(dim=2) == n)
    assert torch.all(W_sg[~keep] == 0) and torch.all(W_sg[keep] != 0)
    # lazy batching is exact: the result does not depend on the block size
    W_big, keep_big = sparsegpt_prune(W, X.T @ X, pattern=f"{n}:{m}", blocksize=64)
    assert torch.equal(keep, keep_big)
    assert torch.allclose(W_sg, W_big, atol=1e-4, rtol=1e-4)


def test_sparsegpt_sparsity_zero_is_identity():
    X, W = _layer(2)
    W_new, keep = sparsegpt_prune(W, X.T @ X, 0.0)
    assert torch.equal(W_new, W) and bool(keep.all())


def test_sparsegpt_dead_column_and_dtypes():
    X, W = _layer(3)
    X[:, 5] = 0.0
    W_new, keep = sparsegpt_prune(W.to(torch.bfloat16), (X.T @ X).double(), 0.5)
    assert W_new.dtype == torch.bfloat16 and torch.isfinite(W_new.float()).all()
    assert torch.all(W_new[:, 5] == 0)
    assert torch.all((~keep).sum(dim=1) == 32)
    W_id, _ = sparsegpt_prune(W, X.T @ X, 0.5, perm=torch.arange(64))
    assert torch.equal(W_id, sparsegpt_prune(W, X.T @ X, 0.5)[0])
    with pytest.raises(ConfigError):
        sparsegpt_prune(W, X.T @ X, 0.5, perm=torch.zeros(64, dtype=torch.long))


def test_rose_without_reorder_is_sparsegpt():
    X, W = _layer(4)
    H, norm = X.T @ X, (X**2).sum(0)
    a = rose_prune(W, H, norm, 0.5, reorder=False, blocksize=16)
    b = sparsegpt_prune(W, H, 0.5, blocksize=16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _columnar_layer():
    X, W = _layer(5)
    scale = torch.ones(64)
    scale[48:] = 30.0  # the last 16-column block carries huge activations
    X = X * scale
    return X, W


def test_rose_columnar_layer_is_reordered():
    X, W = _columnar_layer()
    H, norm = X.T @ X, (X**2).sum(0)
    perm, info = rose_permutation(W, norm, 0.5, blocksize=16)
    assert info["columnar"] and info["relative_range"] > 0.5
    assert perm is not None and perm.dtype == torch.long
    assert torch.equal(perm.sort().values, torch.arange(64))
    assert set(perm[:16].tolist()) == set(range(48, 64))  # heaviest block first
    # inside a block, columns by pruned-score loss descending
    scores = wanda_scores(W, norm).double()
    first = scores[:, perm[:16]]
    loss = (first * ~unstructured_mask(first, 0.5, group="layer")).sum(0)
    assert torch.all(loss[:-1] >= loss[1:])
    # a per-row pre-mask prunes little of the heavy block, which then goes last
    perm_row, _ = rose_permutation(W, norm, 0.5, blocksize=16, pre_mask="row")
    assert perm_row is not None and set(perm_row[-16:].tolist()) == set(range(48, 64))
    W_new, keep = rose_prune(W, H, norm, 0.5, blocksize=16)
    assert torch.all((W_new == 0).sum(dim=1) == 32) and torch.equal(W_new == 0, ~keep)
    # a layer with even activations is not columnar
    X2, W2 = _layer(6)
    assert rose_permutation(W2, (X2**2).sum(0), 0.5, blocksize=16)[0] is None


def test_rose_nm_keeps_groups():
    X, W = _columnar_layer()
    perm, _ = rose_permutation(W, (X**2).sum(0), 0.5, pattern=(2, 4))
    assert perm is not None
    assert torch.equal(perm.reshape(-1, 4) // 4, (perm.reshape(-1, 4)[:, :1] // 4).expand(-1, 4))
    W_new, keep = rose_prune(W, X.T @ X, (X**2).sum(0), 0.5, pattern="2:4")
    assert torch.all(keep.reshape(32, -1, 4).sum(dim=2) == 2)
    assert torch.all(W_new[~keep] == 0)


def test_hessian_blend_trace_normalised():
    X, _ = _layer(7)
    xtx = X.T @ X
    taylor = X.T @ torch.diag(torch.rand(256, generator=_gen(0))) @ X
    assert torch.allclose(hessian_blend(xtx, taylor, 0.0), xtx / xtx.trace())
    h = hessian_blend(xtx, taylor, 0.3)
    want = 0.7 * xtx / xtx.trace() + 0.3 * taylor / taylor.trace()
    assert torch.allclose(h, want, rtol=1e-5, atol=1e-8)
    assert abs(float(h.trace()) - 1.0) < 1e-5
    with pytest.raises(ConfigError):
        hessian_blend(xtx, taylor, 1.5)


# ---------------------------------------------------------------- allocation


def test_owl_hand_example():
    assert owl([0.1, 0.2, 0.3], 0.5, lam=0.08) == pytest.approx([0.58, 0.5, 0.42], abs=1e-12)


def test_outlier_ratio():
    a = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0]])  # mean 10.9
    b = torch.ones(2, 5)
    assert outlier_ratio([a, b], m=5.0) == pytest.approx(1 / 20)


def test_pals_hand_examples():
    assert pals([1.0, 2.0, 3.0], 0.5) == pytest.approx([0.55, 0.5, 0.45], abs=1e-12)
    # z = [0, 0, 1] -> [0.55, 0.55, 0.45]; re-centring with the clip converges to
    # [0.525, 0.525, 0.45] (fixed point: (2x + 0.45) / 3 = 0.5).
    out = pals([0.0, 0.0, 10.0], 0.5, delta=0.05)
    assert out == pytest.approx([0.525, 0.525, 0.45], abs=2e-4)
    assert sum(out) / 3 == pytest.approx(0.5, abs=1e-9)


def test_ramp_and_uniform():
    assert ramp(3, 0.5, span=0.1) == pytest.approx([0.4, 0.5, 0.6])
    assert ramp(3, 0.5, span=0.1, increasing=False) == pytest.approx([0.6, 0.5, 0.4])
    assert uniform(4, 0.3) == pytest.approx([0.3] * 4)


def _weighted_mean(values, weights):
    return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 12), target=st.floats(0.05, 0.9))
def test_allocations_keep_weighted_mean(data, n, target):
    floats = st.floats(0.0, 10.0, allow_nan=False)
    weights = data.draw(st.lists(st.floats(0.1, 1e3), min_size=n, max_size=n))
    stats = data.draw(st.lists(floats, min_size=n, max_size=n))
    results = [
        uniform(n, target, weights=weights),
        owl(stats, target, weights=weights),
        owl(stats, target, lam=0.3, weights=weights),
        pals(stats, target, weights=weights),
        ramp(n, target, span=0.3, weights=weights),
        ramp(n, target, increasing=False, weights=weights),
        rescale_to_target(data.draw(st.lists(st.floats(0.0, 0.999), min_size=n, max_size=n)),
                          weights, target),
    ]
    for out in results:
        assert len(out) == n
        assert all(0.0 <= v < 1.0 for v in out)
        assert _weighted_mean(out, weights) == pytest.approx(target, abs=1e-6)


def test_rescale_to_target_rejects_out_of_range():
    with pytest.raises(ConfigError):
        rescale_to_target([0.5, 0.5], None, 1.0)
    with pytest.raises(ConfigError):
        uniform(3, 0.5, weights=[1.0, -1.0, 1.0])


def test_sparsegpt_factor_cache_gives_the_same_result():
    """Linears sharing one Hessian reuse its inverse factor: results are identical to
    separate calls, and the cache holds the factor after the first call."""
    torch.manual_seed(3)
    x = torch.randn(200, 32)
    h = x.t() @ x
    h[:, 5] = h[5, :] = 0.0  # a dead column
    cache = {}
    for rows in (16, 8):
        w = torch.randn(rows, 32)
        a, ma = sparsegpt_prune(w, h, 0.5, blocksize=8)
        b, mb = sparsegpt_prune(w, h, 0.5, blocksize=8, factor_cache=cache)
        assert torch.equal(a, b) and torch.equal(ma, mb)
        assert (b[:, 5] == 0).all()
    assert set(cache) == {"key", "dead", "U"}


def test_prune_lowest_k_is_the_first_k_of_a_stable_sort():
    """The selection (kthvalue + ties to the lower index) against the definition, on
    ties, half precision, infinities and NaN; and a hand case."""
    from prunelab.pruning.sparsity.masks import prune_lowest_k

    def by_sort(scores, k):
        keep = torch.ones(scores.shape, dtype=torch.bool)
        order = torch.sort(scores.double(), dim=1, stable=True).indices
        keep.scatter_(1, order[:, :k], False)
        return keep

    g = torch.Generator().manual_seed(0)
    odd = torch.randn(6, 40, generator=g)
    odd[0, ::3] = float("nan")
    odd[1, :5] = float("-inf")
    odd[2, 7:9] = float("inf")
    odd[3] = float("nan")
    few = torch.randn(40, 64, generator=g)  # ties in one row only: the per-row tie pass
    few[7] = torch.randint(0, 3, (64,), generator=g).float()
    for scores in (few, torch.randint(0, 3, (50, 64), generator=g).float(),  # many ties
                   torch.randn(30, 128, generator=g).half(), odd,
                   torch.randint(0, 4, (5, 33), generator=g)):  # integers
        for k in range(scores.shape[1] + 2):
            assert torch.equal(prune_lowest_k(scores, k), by_sort(scores, k)), k
    row = torch.tensor([[2.0, 1.0, 1.0, 0.0, 1.0]])
    assert prune_lowest_k(row, 3).tolist() == [[True, False, False, False, True]]


def test_pruned_lowest_k_down_matches_the_stable_sort_with_ties():
    from prunelab.pruning.sparsity.masks import prune_lowest_k, pruned_lowest_k_down

    g = torch.Generator().manual_seed(0)
    for m in (2, 4, 8, 17):
        for scores in (torch.randint(0, 3, (m, 500), generator=g).float(),  # many ties
                       torch.randn(m, 500, generator=g).half()):
            for k in range(m + 1):
                want = ~prune_lowest_k(scores.t(), k).t()
                assert torch.equal(pruned_lowest_k_down(scores, k), want), (m, k)
    # hand case: column (3, 1, 1, 0) with k=2 prunes 0 and the first 1 (index 1)
    col = torch.tensor([[3.0], [1.0], [1.0], [0.0]])
    assert pruned_lowest_k_down(col, 2).reshape(-1).tolist() == [False, True, False, True]


def _logit_change_cost(x, Wq, Wk, heads, kv_heads, hd, which, r, j, causal):
    """Brute force: sum of squared changes of the attention logits q_t . k_s (per head,
    within each sequence, s <= t when causal) when weight (r, j) of Wq / Wk is deleted."""
    def logits(wq, wk):
        q = (x @ wq.t()).reshape(*x.shape[:2], heads, hd)
        k = (x @ wk.t()).reshape(*x.shape[:2], kv_heads, hd)
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        return torch.einsum("bthc,bshc->bhts", q, k)

    wq, wk = Wq.clone(), Wk.clone()
    (wq if which == "q" else wk)[r, j] = 0.0
    diff = logits(wq, wk) - logits(Wq, Wk)
    if causal:
        T = x.shape[1]
        diff = diff * torch.ones(T, T, dtype=diff.dtype).tril()
    return float(diff.square().sum())


@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (4, 2)])
def test_qk_wanda_causal_scores_equal_brute_force_logit_changes(heads, kv_heads):
    from prunelab.pruning.sparsity.scores import qk_wanda_causal_scores, qk_wanda_causal_stats

    g = torch.Generator().manual_seed(1)
    hd, d = 2, 3
    x = torch.randn(2, 5, d, generator=g, dtype=torch.float64)
    Wq = torch.randn(heads * hd, d, generator=g, dtype=torch.float64)
    Wk = torch.randn(kv_heads * hd, d, generator=g, dtype=torch.float64)
    a_q = a_k = 0
    for b in range(2):  # two batches of one sequence each: the stats add up
        dq, dk = qk_wanda_causal_stats(x[b:b + 1], x[b:b + 1] @ Wq.t(), x[b:b + 1] @ Wk.t())
        a_q, a_k = a_q + dq, a_k + dk
    sq, sk = qk_wanda_causal_scores(Wq, Wk, a_q, a_k, heads, kv_heads, hd)
    for which, scores in (("q", sq), ("k", sk)):
        for r in range(scores.shape[0]):
            for j in range(d):
                want = _logit_change_cost(x, Wq, Wk, heads, kv_heads, hd, which, r, j, True)
                assert scores[r, j].item() == pytest.approx(want, rel=1e-10), (which, r, j)
    # one sequence: the unmasked scores are the same brute force without the mask
    x1 = x[:1]
    uq, uk = qk_wanda_scores(Wq, Wk, x1.square().reshape(-1, d).sum(0),
                             (x1 @ Wk.t()).square().reshape(-1, kv_heads * hd).sum(0),
                             (x1 @ Wq.t()).square().reshape(-1, heads * hd).sum(0),
                             heads, kv_heads, hd)
    for which, scores in (("q", uq), ("k", uk)):
        for r in range(scores.shape[0]):
            for j in range(d):
                want = _logit_change_cost(x1, Wq, Wk, heads, kv_heads, hd, which, r, j, False)
                assert scores[r, j].item() == pytest.approx(want, rel=1e-10), (which, r, j)
