"""SparseGPT's memory: the Hessian is factorised in its own storage (at most two
``d x d`` matrices alive), bit for bit as the copying version did, and a block's
statistics die before its final pass."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import prunelab
from prunelab import SparseGPT, linalg
from prunelab.calib.sequential import SequentialBlock
from prunelab.calib.stats import Gram, mirror_upper_
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.pruning.sparsity import sparsegpt as sg

from tiny_models import char_tokenizer, tiny_model, tiny_tokens


def copying_factor(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """The factorisation as it was before (copies of H, an identity, a flipped copy):
    the reference the in-place one must match bit for bit."""
    d = H.shape[0]
    mean_diag = float(H.diagonal().mean())
    damp = percdamp * mean_diag
    eye = torch.eye(d, dtype=H.dtype)
    flipped = H.flip(0, 1)
    for _ in range(7):
        chol, info = linalg.cholesky_ex(flipped + damp * eye)
        if int(info) == 0:
            inv_l = linalg.solve_triangular(chol, eye, upper=False)
            if bool(torch.isfinite(inv_l).all()):
                return inv_l.flip(0, 1)
        damp = max(damp * 10.0, 1e-8 * mean_diag)
    raise ConfigError("not positive definite")


def spd(d: int, seed: int, rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rank or d + 20, d, generator=g)
    return mirror_upper_((x.t() @ x).triu())


@pytest.mark.parametrize("d", [1, 2, 5, 8, 9])
@pytest.mark.parametrize("chunk", [1, 2, 3, 1024])
def test_flip_in_place_equals_flip(d, chunk):
    a = torch.arange(d * d, dtype=torch.float32).reshape(d, d)
    want = a.flip(0, 1)
    assert torch.equal(sg._flip_(a, chunk=chunk), want)


@pytest.mark.parametrize("d,chunk", [(1, 1), (7, 3), (10, 4), (300, 1024), (300, 64)])
def test_gram_take_is_xtx_in_place_and_empties_the_gram(d, chunk):
    x = torch.randn(50, d, generator=torch.Generator().manual_seed(d))
    g, ref = Gram(torch.float32), Gram(torch.float32)
    for part in x.split(20):
        g.update(part)
        ref.update(part)
    storage = g._acc.untyped_storage().data_ptr()
    if chunk == 1024:
        out = g.take()
        assert out.untyped_storage().data_ptr() == storage  # no copy
    else:
        out = mirror_upper_(g._acc, chunk=chunk)
    assert torch.equal(out, ref.xtx) and torch.equal(out, out.t())
    if chunk == 1024:
        assert g.xtx is None and g.take() is None and g.tokens == 50
    ref.xtx  # noqa: B018  (the cached symmetric matrix is what take hands over then)
    sym = ref._sym
    assert ref.take() is sym and ref.xtx is None


@pytest.mark.parametrize("d", [3, 33, 1100])
def test_in_place_factor_is_bit_identical_to_the_copying_one(d):
    H = spd(d, seed=d)
    want = copying_factor(H, 0.01)
    work = H.clone()
    got = sg._upper_inverse_factor_(work, 0.01)
    assert torch.equal(got, want) and got.stride() == want.stride()
    assert got.untyped_storage().data_ptr() == work.untyped_storage().data_ptr()


def test_in_place_factor_retries_like_the_copying_one(monkeypatch):
    """An indefinite matrix: Cholesky fails until the damping is large enough; the
    retries start from the same (restored) matrix."""
    H = spd(40, seed=1, rank=20) - 0.5 * torch.eye(40)
    want = copying_factor(H, 0.001)
    infos = []
    real = linalg.cholesky_ex
    monkeypatch.setattr(linalg, "cholesky_ex",
                        lambda a: infos.append(int((r := real(a))[1])) or r)
    got = sg._upper_inverse_factor_(H.clone(), 0.001)
    assert infos[0] != 0 and infos[-1] == 0 and len(infos) > 2
    assert torch.equal(got, want)


@pytest.mark.parametrize("d,chunk", [(9, 4), (12, 1024)])
def test_overflowing_inverse_restores_the_matrix(d, chunk):
    """A Cholesky factor whose inverse overflows: ``A`` comes back off its diagonal (from
    the copy stashed in the factor's unused triangle) and False is returned."""
    A = spd(d, seed=5)
    before = A.clone()
    chol = torch.linalg.cholesky(A)
    chol.diagonal()[3:7] = 1e-30  # L^{-1} overflows float32
    assert not sg._inverse_lower_(chol, A, chunk=chunk)
    off = ~torch.eye(d, dtype=torch.bool)
    assert torch.equal(A[off], before[off])
    good = torch.linalg.cholesky(before)
    assert sg._inverse_lower_(good.clone(), A, chunk=chunk)
    eye = torch.eye(d)
    assert torch.equal(A.mT, torch.linalg.solve_triangular(good, eye, upper=False))


def test_overwrite_h_reuses_its_storage_and_changes_no_result():
    H = spd(64, seed=2)
    H[:, 7] = H[7, :] = 0.0  # a dead column
    W = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    want, want_mask = sg.sparsegpt_prune(W, H, 0.5, blocksize=16)
    work, cache = H.clone(), {}
    got, mask = sg.sparsegpt_prune(W, work, 0.5, blocksize=16, factor_cache=cache,
                                   overwrite_h=True)
    assert torch.equal(got, want) and torch.equal(mask, want_mask)
    assert cache["U"].untyped_storage().data_ptr() == work.untyped_storage().data_ptr()
    again, _ = sg.sparsegpt_prune(W, None, 0.5, blocksize=16, factor_cache=cache)
    assert torch.equal(again, want)
    with pytest.raises(ConfigError, match="no Hessian"):
        sg.sparsegpt_prune(W, None, 0.5, factor_cache={})
    kept = H.clone()
    sg.sparsegpt_prune(W, kept, 0.5, blocksize=16)  # not overwritten by default
    assert torch.equal(kept, H)


def _live_squares(d: int) -> int:
    """Distinct storages of live float ``d x d`` tensors that are not parameters."""
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore")
        live = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    ptrs = {t.untyped_storage().data_ptr() for t in live
            if not isinstance(t, torch.nn.Parameter) and t.dim() == 2
            and tuple(t.shape) == (d, d) and t.is_floating_point()}
    return len(ptrs)


def test_down_proj_factor_holds_two_matrices_and_none_outlive_the_block(monkeypatch):
    """On a tiny Llama (down_proj input 48 wide, no other 48 x 48 tensor): while its
    Hessian is factorised, one 48 x 48 matrix is alive at the Cholesky (the Gram's own
    storage) and two at the triangular solve (it and the factor); none is alive when
    the block's final pass starts."""
    model = tiny_model("llama")
    d = model.config.intermediate_size
    assert d != model.config.hidden_size
    seen = {"chol": [], "solve": [], "final": []}
    chol, solve = linalg.cholesky_ex, linalg.solve_triangular

    def counting(kind, fn):
        def wrapped(a, *args, **kwargs):
            if a.shape[-1] == d:
                seen[kind].append(_live_squares(d))
            return fn(a, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(linalg, "cholesky_ex", counting("chol", chol))
    monkeypatch.setattr(linalg, "solve_triangular", counting("solve", solve))
    stage = SequentialBlock._stage

    def final_counted(self, g, targets, accs):
        if g == len(self.groups):
            seen["final"].append(_live_squares(d))
        return stage(self, g, targets, accs)

    monkeypatch.setattr(SequentialBlock, "_stage", final_counted)
    lm = wrap(model, char_tokenizer(), spec="tiny-llama")
    ids = tiny_tokens(6, 16)
    calib = TokenBatches(input_ids=ids, spec="tiny", seqlen=16, samples=6, seed=0,
                         mode="calib", total_windows=6, sha256="0")
    prunelab.prune(lm, SparseGPT(sparsity=0.5), calib, batch_size=3)
    blocks = model.config.num_hidden_layers
    assert seen["chol"] == [1] * blocks, seen
    assert seen["solve"] == [2] * blocks
    assert seen["final"] == [0] * blocks
