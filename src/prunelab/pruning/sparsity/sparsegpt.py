"""SparseGPT one-shot pruning with OBS weight updates, and the MOONSHOT Hessian blend.

Source: Frantar & Alistarh 2023, "SparseGPT: Massive Language Models Can Be Accurately
Pruned in One-Shot" (Algorithm 1, with lazy column blocks); MOONSHOT (derived in
prunelab): a trace-normalised blend of the reconstruction Hessian and a Taylor
(Fisher) term.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from prunelab import linalg
from prunelab.errors import ConfigError
from prunelab.models.memory import release_free_memory
from prunelab.pruning.sparsity.masks import (
    check_sparsity,
    parse_pattern,
    prune_count,
    prune_lowest_k,
    pruned_lowest_k_down,
)

__all__ = ["hessian_blend", "no_tf32", "sparsegpt_prune"]


@contextmanager
def no_tf32() -> Iterator[None]:
    """Context with TF32 off for CUDA matmuls and cuDNN (float32 maths stays float32);
    the previous settings are restored on exit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prev = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def _check_perm(perm: torch.Tensor, d_in: int) -> torch.Tensor:
    perm = torch.as_tensor(perm).long().reshape(-1)
    if perm.numel() != d_in or not torch.equal(perm.sort().values.cpu(), torch.arange(d_in)):
        raise ConfigError(f"perm is not a permutation of the {d_in} input columns")
    return perm


@contextmanager
def _threads(n: int) -> Iterator[None]:
    prev = torch.get_num_threads()
    if n != prev:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != prev:
            torch.set_num_threads(prev)


def _column_threads(rows: int) -> int:
    """Threads for the sequential column updates: each touches at most ``rows x
    blocksize`` numbers, where a parallel region costs more than it saves on a CPU
    (and spins badly when the cores are shared); GPUs are unaffected."""
    return 1 if rows <= 8192 else torch.get_num_threads()


def _upper_inverse_factor_(A: torch.Tensor, percdamp: float) -> torch.Tensor:
    """``U`` upper-triangular with ``U^T U = (A + damp I)^{-1}``, ``damp = percdamp *
    mean(diag A)``; if a Cholesky fails the damping is multiplied by 10 (up to 6 times).
    ``A`` (square, C-contiguous, symmetric) is consumed: ``U`` is built in its storage
    (returned as a column-major view).

    One Cholesky and one triangular inverse: with ``J`` the reversal permutation and
    ``J (A + damp I) J = L L^T``, ``A + damp I = R R^T`` for the upper ``R = J L J``, so
    ``(A + damp I)^{-1} = R^{-T} R^{-1}`` and ``U = R^{-1} = J L^{-1} J`` (the unique
    Cholesky factor of the inverse, without forming the inverse). At most two ``d x d``
    matrices are alive at once (``A`` or ``L^{-1}``, and ``L``); the numbers are those of
    ``L^{-1} = solve(L, I)`` on ``J A J + damp I``, bit for bit."""
    mean_diag = float(A.diagonal().mean())
    damp = percdamp * mean_diag
    _flip_(A)
    A.add_(0.0)  # as ``J A J + damp * I`` did off the diagonal (-0.0 becomes +0.0)
    diag = A.diagonal().clone()
    for _ in range(7):
        A.diagonal().copy_(diag).add_(damp)
        chol, info = linalg.cholesky_ex(A)
        if int(info) == 0 and _inverse_lower_(chol, A):
            return _flip_(A).mT  # column-major, as ``solve_triangular`` returns it
        del chol
        damp = max(damp * 10.0, 1e-8 * mean_diag)
    raise ConfigError("SparseGPT: the Hessian is not positive definite even after damping")


def _inverse_lower_(chol: torch.Tensor, A: torch.Tensor, chunk: int = 1024) -> bool:
    """``A^T`` <- ``L^{-1}`` (``chol`` = ``L`` lower, ``A`` the matrix it factors), solved in
    ``A``'s storage; True when finite. Otherwise ``A`` is restored off its diagonal (the
    caller's) from a copy of its strict lower triangle kept in ``L``'s unused strict upper
    one, and False is returned."""
    d = A.shape[0]
    for s in range(0, d, chunk):  # stash: L[j, i] = A[i, j] for i > j
        e = min(s + chunk, d)
        chol[s:e, e:] = A[e:, s:e].t()
        blk = chol[s:e, s:e]
        blk.copy_(torch.where(_strict_upper(e - s, A.device), A[s:e, s:e].t(), blk))
    A.zero_()
    A.diagonal().fill_(1.0)
    X = A.mT  # column-major, like the result torch allocates: the same LAPACK call
    linalg.solve_triangular(chol, X, upper=False, out=X)  # reads L's lower triangle only
    if all(bool(torch.isfinite(A[s:s + chunk]).all()) for s in range(0, d, chunk)):
        return True
    for s in range(0, d, chunk):  # A symmetric again from the stash
        e = min(s + chunk, d)
        A[e:, s:e] = chol[s:e, e:].t()
        A[s:e, e:] = chol[s:e, e:]
        blk = chol[s:e, s:e]
        A[s:e, s:e] = torch.where(_strict_upper(e - s, A.device), blk, blk.t())
    return False


def _strict_upper(n: int, device) -> torch.Tensor:
    return torch.ones((n, n), dtype=torch.bool, device=device).triu(1)


def _flip_(A: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``A`` <- ``J A J`` (rows and columns reversed: ``A.flip(0, 1)``) in place, by
    swapping row panels of at most ``chunk`` rows. Returns ``A``."""
    d = A.shape[0]
    half = d // 2
    for s in range(0, half, chunk):
        e = min(s + chunk, half)
        top = A[s:e].flip(0, 1)
        A[s:e] = A[d - e:d - s].flip(0, 1)
        A[d - e:d - s] = top
    if d % 2:
        A[half] = A[half].flip(0)
    return A


def sparsegpt_prune(
    W: torch.Tensor,
    H: torch.Tensor | None,
    sparsity: float = 0.5,
    pattern: tuple[int, int] | str | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    perm: torch.Tensor | None = None,
    mask_group: str = "row",
    factor_cache: dict | None = None,
    overwrite_h: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune ``W`` with SparseGPT; returns ``(W_new, kept_mask)``.

    ``W``: ``[d_out, d_in]``; ``H``: ``[d_in, d_in]``, ``X^T X`` up to any positive scale
    (the paper's ``2/N X^T X``). Maths runs on float32 copies (float64 if ``W`` or ``H`` is
    float64) with TF32 off; ``W_new`` comes back in ``W``'s dtype, ``kept_mask`` is bool.

    Algorithm: dead columns (``H_jj = 0``) get ``H_jj = 1`` and ``W[:, j] = 0``;
    ``H += percdamp * mean(diag H) * I``; ``U = chol_upper(H^{-1})``. Columns are processed
    left to right in lazy blocks of ``blocksize``. Unstructured (``pattern=None``): at each
    block start the block's mask is chosen from the saliency ``W^2 / diag(U)^2`` of the
    current (already updated) weights. ``mask_group="row"`` (default) prunes, per row, the
    lowest ``floor(e * s) - floor(b * s)`` of the block ``[b, e)``, so every row ends with
    exactly ``floor(d_in * s)`` zeros; ``mask_group="block"`` is the reference code's joint
    choice over the whole ``[d_out, block]`` slice (per-row counts then vary). N:M
    (``pattern=(n, m)`` or ``"n:m"``): at every column ``i`` with ``i % m == 0`` each row
    prunes the ``m - n`` lowest saliencies of ``[i, i + m)`` (``blocksize`` is rounded down
    to a multiple of ``m``, at least ``m``; ``sparsity`` is then unused). For each column
    ``j``: ``q = w * keep``, ``err = (w - q) / U_jj``, ``W[:, j:] -= err (x) U[j, j:]``
    inside the block; after the block ``W[:, end:] -= Err @ U[block, end:]``.

    ``perm``: optional column order (ROSE): SparseGPT runs on ``W[:, perm]`` and
    ``H[perm][:, perm]``, and ``W_new`` / the mask are un-permuted. ``sparsity=0`` without a
    pattern returns an exact copy of ``W`` and an all-True mask. Dead columns are zero in
    ``W_new`` even where the mask keeps them. Defaults follow the paper: ``blocksize=128``,
    ``percdamp=0.01``.

    ``factor_cache``: a dict shared by calls with one and the same ``H`` (q/k/v see the same
    inputs): the inverse Cholesky factor is computed once and reused; ``H`` may then be
    ``None`` in the calls after the first. ``overwrite_h``: ``H`` is not read afterwards,
    so its storage is the factorisation's workspace (and, for a float32 ``H``, the cached
    factor's): at most two ``[d_in, d_in]`` matrices are alive instead of three. The
    results are the same either way, bit for bit.
    """
    s = check_sparsity(sparsity)
    nm = parse_pattern(pattern) if isinstance(pattern, str) or pattern is None else pattern
    h_shape, h_dtype = _hessian_meta(H, factor_cache)
    if W.dim() != 2 or h_shape != (W.shape[1], W.shape[1]):
        raise ConfigError(
            f"SparseGPT: W {tuple(W.shape)} and H {h_shape} must be [d_out, d_in] and "
            "[d_in, d_in]"
        )
    if blocksize < 1 or percdamp < 0:
        raise ConfigError(f"SparseGPT: blocksize={blocksize} must be >= 1, percdamp >= 0")
    if mask_group not in ("row", "block"):
        raise ConfigError(f"SparseGPT mask_group {mask_group!r} must be 'row' or 'block'")
    rows, cols = W.shape
    if nm is None and s == 0.0:
        return W.detach().clone(), torch.ones(W.shape, dtype=torch.bool, device=W.device)
    if nm is not None:
        n, m = int(nm[0]), int(nm[1])
        if not (1 <= n < m) or cols % m:
            raise ConfigError(f"SparseGPT N:M {n}:{m}: needs 1 <= N < M and d_in={cols} % M == 0")
        blocksize = max(m, blocksize // m * m)
        nm = (n, m)

    dtype = torch.float64 if torch.float64 in (W.dtype, h_dtype) else torch.float32
    with no_tf32():
        Wf = W.detach().to(dtype=dtype).clone()
        if perm is not None:
            perm = _check_perm(perm, cols).to(W.device)
            Wf = Wf[:, perm]
        dead, U = _dead_and_factor(H, W.device, dtype, perm, percdamp, factor_cache,
                                   overwrite_h)
        Wf[:, dead] = 0.0
        pruned = torch.zeros((rows, cols), dtype=torch.bool, device=W.device)
        for b in range(0, cols, blocksize):
            e = min(b + blocksize, cols)
            U1 = U[b:e, b:e]
            if nm is None:
                mask1 = _unstructured_block_mask(Wf[:, b:e], U1.diagonal(), b, e, s,
                                                 mask_group)
            else:
                mask1 = torch.zeros((rows, e - b), dtype=torch.bool, device=W.device)
            T = Wf[:, b:e].t().contiguous()
            gone = mask1.t().contiguous()  # True = pruned
            errs = _sweep_columns(T, gone, U1, nm, rows)
            Wf[:, b:e] = T.t()
            pruned[:, b:e] = gone.t()
            if e < cols:
                Wf[:, e:].addmm_(errs.t(), U[b:e, e:], alpha=-1.0)
        if perm is not None:
            inv = torch.argsort(perm)
            Wf, pruned = Wf[:, inv], pruned[:, inv]
    return Wf.to(W.dtype), ~pruned


# below this size of H the C heap is not trimmed before the factorisation (a trim costs
# tens of milliseconds; the matrices are then small next to the activations just freed)
_TRIM_BYTES = 64 * 2**20


def _hessian_meta(H: torch.Tensor | None, factor_cache: dict | None
                  ) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of ``H``, or of the factor cached for it when ``H`` is None."""
    if H is not None:
        return tuple(H.shape), H.dtype
    if not factor_cache or "U" not in factor_cache:
        raise ConfigError("SparseGPT: no Hessian given and none factorised in factor_cache")
    return tuple(factor_cache["U"].shape), factor_cache["U"].dtype


def _dead_and_factor(H: torch.Tensor | None, device, dtype: torch.dtype,
                     perm: torch.Tensor | None, percdamp: float, factor_cache: dict | None,
                     overwrite_h: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dead columns (``H_jj = 0``, then set to 1) and the upper inverse factor ``U`` of
    the (permuted) ``H``; reused from / stored in ``factor_cache`` for the same key.
    ``overwrite_h``: ``H`` (in ``dtype`` on ``device``, contiguous) is the working
    matrix and ``U`` is built in its storage (no copy of ``H``)."""
    key = (dtype, device, percdamp, None if perm is None else perm.tolist())
    if factor_cache is not None and factor_cache.get("key") == key:
        return factor_cache["dead"], factor_cache["U"]
    if H is None:
        raise ConfigError("SparseGPT: no Hessian given and none factorised in factor_cache")
    if H.shape[0] ** 2 * H.element_size() >= _TRIM_BYTES:
        release_free_memory()  # the stage's freed activations, before two d x d matrices
    Hf = _working_copy(H, device, dtype, overwrite_h)
    if perm is not None:
        Hf = Hf[perm][:, perm]
    dead = Hf.diagonal() == 0
    Hf[dead, dead] = 1.0
    U = _upper_inverse_factor_(Hf, percdamp)
    del Hf
    if factor_cache is not None:
        factor_cache.update(key=key, dead=dead, U=U)
    return dead, U


def _working_copy(H: torch.Tensor, device, dtype: torch.dtype, overwrite: bool
                  ) -> torch.Tensor:
    """``H`` in ``dtype`` on ``device``, C-contiguous, that may be changed in place:
    ``H`` itself when ``overwrite`` allows it, otherwise a copy."""
    Hf = H.detach().to(device=device, dtype=dtype)
    if (Hf.data_ptr() == H.data_ptr() and not overwrite) or not Hf.is_contiguous():
        Hf = Hf.clone(memory_format=torch.contiguous_format)
    return Hf


def _unstructured_block_mask(Wb: torch.Tensor, d1: torch.Tensor, b: int, e: int, s: float,
                             mask_group: str) -> torch.Tensor:
    """**Pruned** mask of the column block ``[b, e)`` (``Wb`` its current weights, ``d1``
    the diagonal of ``U`` there) from the saliency ``W^2 / d^2``: per row the lowest
    ``floor(e s) - floor(b s)``, or jointly over the block (``mask_group="block"``)."""
    rows = Wb.shape[0]
    sal = Wb.square() / d1.square()[None, :]
    if mask_group == "row":
        return ~prune_lowest_k(sal, prune_count(e, s) - prune_count(b, s))
    k = prune_count(rows * e, s) - prune_count(rows * b, s)
    return ~prune_lowest_k(sal.reshape(1, -1), k).reshape(sal.shape)


def _sweep_columns(T: torch.Tensor, gone: torch.Tensor, U1: torch.Tensor,
                   nm: tuple[int, int] | None, rows: int) -> torch.Tensor:
    """The OBS sweep over one column block, in place; returns the scaled errors.

    ``T``: the block's weights column-major (column ``i`` is the contiguous row
    ``T[i]``); ``gone``: its pruned mask, same layout (with N:M filled in here, group by
    group, from the updated weights). Per column, two ops: ``err = w * (pruned / U_ii)``,
    then the rank-1 update of the later columns of the block (row ``i`` itself is zeroed
    where pruned at the end, and kept entries of row ``i`` are unchanged by its own
    update)."""
    d1 = U1.diagonal()
    inv_d = d1.reciprocal()
    scale = torch.empty_like(T)  # pruned / U_ii, per column
    if nm is None:
        torch.mul(gone, inv_d[:, None], out=scale)
    errs = torch.empty_like(T)
    t_rows, e_rows, s_rows, u_rows = T.unbind(0), errs.unbind(0), scale.unbind(0), \
        U1.unbind(0)
    width = T.shape[0]
    with _threads(_column_threads(rows)):
        for i in range(width):
            if nm is not None and i % nm[1] == 0:  # this group's mask, per row
                m = nm[1]
                sal = T[i:i + m].square().div_(d1[i:i + m, None].square())
                gone[i:i + m] = pruned_lowest_k_down(sal, m - nm[0])
                torch.mul(gone[i:i + m], inv_d[i:i + m, None], out=scale[i:i + m])
            torch.mul(t_rows[i], s_rows[i], out=e_rows[i])
            if i + 1 < width:
                T[i + 1:].addr_(u_rows[i][i + 1:], e_rows[i], alpha=-1.0)
    T.masked_fill_(gone, 0.0)
    return errs


def hessian_blend(xtx: torch.Tensor, taylor: torch.Tensor, alpha: float) -> torch.Tensor:
    """MOONSHOT-style curvature: ``(1 - a) * xtx / tr(xtx) + a * taylor / tr(taylor)``.

    ``xtx``: ``[d_in, d_in]`` reconstruction Hessian ``X^T X``; ``taylor``: ``[d_in, d_in]``
    Taylor/Fisher term ``X^T diag(||g_t||^2) X`` (``g_t`` the loss gradient w.r.t. the
    layer output at token ``t``, computed by the caller); ``alpha`` in ``[0, 1]``. Computed
    in float64, returned in the promoted input dtype (at least float32); feed it to
    :func:`sparsegpt_prune`. A term with weight 0 is skipped; a used term needs a positive
    trace. Source: MOONSHOT (derived in prunelab).
    """
    a = float(alpha)
    if not (0.0 <= a <= 1.0):
        raise ConfigError(f"hessian_blend alpha {alpha!r} must lie in [0, 1]")
    if xtx.shape != taylor.shape or xtx.dim() != 2 or xtx.shape[0] != xtx.shape[1]:
        raise ConfigError(
            f"hessian_blend: shapes {tuple(xtx.shape)} and {tuple(taylor.shape)} must be equal "
            "and square"
        )
    out_dtype = torch.promote_types(torch.promote_types(xtx.dtype, taylor.dtype), torch.float32)
    out = torch.zeros(xtx.shape, dtype=torch.float64, device=xtx.device)
    for weight, term, name in ((1.0 - a, xtx, "xtx"), (a, taylor, "taylor")):
        if weight == 0.0:
            continue
        t = term.detach().to(device=xtx.device, dtype=torch.float64)
        tr = float(t.trace())
        if not tr > 0.0:
            raise ConfigError(f"hessian_blend: tr({name}) = {tr} must be positive")
        out += (weight / tr) * t
    return out.to(out_dtype)
