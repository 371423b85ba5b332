"""Input Gram matrices of a model's linears and the whitening they define.

* :func:`collect_grams`: ``X^T X / tokens`` (float64) of the input of every selected
  linear in the *dense* model, block by block on the :class:`~prunelab.calib.runner.BlockRunner`
  (one block pass each; linears reading the same tensor -- q/k/v, gate/up, a fused
  ``qkv_proj`` -- share one Gram object).
* :class:`CrossGram` and :class:`KeepInputs`: accumulators for a least-squares refit that
  pairs the inputs a linear receives in the compressed model with those it receives in
  the dense model, token by token.
* :func:`whitening`: the damped Cholesky factor ``S`` of a Gram (``S S^T = G + lambda I``),
  with an eigen-decomposition square root when the Cholesky factorization fails;
  :func:`whitened_spectra`: the singular values of ``W S`` of a model's linears from the
  dense Grams (what a global rank allocation ranks).
* :func:`dense_inputs`: a dense block's linear inputs kept for a pairing with the
  compressed stream.

Calibration windows from :func:`prunelab.data.tokens_for` carry no attention mask, so
every token counts (no padding to mask).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from prunelab import linalg
from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Accumulator, Gram, _flat
from prunelab.models.linear import weight_out_in


def blocks_prefix(lm) -> str:
    """The module path of the model's block list (``model.layers``, ``transformer.h``)."""
    blocks = lm.adapter.blocks()
    return next(name for name, m in lm.model.named_modules() if m is blocks)


def each_block_grams(lm, input_ids: torch.Tensor, *, batch_size: int,
                     select: Callable[[int], dict[str, torch.nn.Module]],
                     visit: Callable[[int, dict[str, torch.Tensor]], None],
                     runner: BlockRunner | None = None) -> BlockRunner:
    """Run the dense model block by block; for block ``i`` call ``visit(i, {path: G})``
    with the normalised input Gram of every linear ``select(i)`` returns (paths inside
    the block; one tensor object per distinct input). Returns the runner used."""
    runner = runner if runner is not None else BlockRunner(lm, input_ids, batch_size)

    def on_block(i, inputs):
        chosen = select(i)
        if not chosen:
            return None
        outs: list[torch.Tensor] = []
        accs = runner.collect(i, inputs, chosen, lambda _n: Gram(), stop_early=False,
                              outputs=outs, share=True)
        means: dict[int, torch.Tensor] = {}
        grams = {}
        for path, (acc,) in accs.items():
            if id(acc) not in means:
                means[id(acc)] = acc.mean()
            grams[path] = means[id(acc)]
        visit(i, grams)
        return outs  # the (unchanged) block's outputs: no second pass

    runner.run(on_block=on_block, propagate="modified", desc="input Grams")
    return runner


def collect_grams(lm, input_ids: torch.Tensor, *, batch_size: int,
                  modules: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Dense-model input Grams ``X^T X / tokens`` (float64, ``[d_in, d_in]``) of the
    adapter's prunable linears, by full module path (``model.layers.3.mlp.up_proj``).

    ``modules``: the full paths to collect (default: every linear of
    ``lm.adapter.linears(i)``). Linears that read the same tensor get the same tensor
    object. The model is not changed.
    """
    prefix = blocks_prefix(lm)
    wanted = None if modules is None else set(modules)
    out: dict[str, torch.Tensor] = {}

    def select(i):
        return {p: m for p, m in lm.adapter.linears(i).items()
                if wanted is None or f"{prefix}.{i}.{p}" in wanted}

    def visit(i, grams):
        for path, g in grams.items():
            out[f"{prefix}.{i}.{path}"] = g

    each_block_grams(lm, input_ids, batch_size=batch_size, select=select, visit=visit)
    return out


class KeepInputs(Accumulator):
    """Keeps every batch of inputs (``[tokens, d_in]``, on ``device`` when given) in
    arrival order."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.batches: list[torch.Tensor] = []
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        x = _flat(x)
        self.batches.append(x.detach().to(self.device or x.device, copy=True))
        self.tokens += x.shape[0]


class CrossGram(Accumulator):
    """``X^T Y / tokens`` (float64) of the inputs ``X`` it is fed against the paired
    batches ``Y`` of a :class:`KeepInputs` (batch ``b`` of ``X`` with batch ``b`` of ``Y``;
    same tokens, same order)."""

    def __init__(self, paired: KeepInputs) -> None:
        self.paired = paired
        self.calls = 0
        self.tokens = 0
        self._acc: torch.Tensor | None = None

    def update(self, x: torch.Tensor) -> None:
        x = _flat(x).to(torch.float64)
        y = self.paired.batches[self.calls].to(device=x.device, dtype=torch.float64)
        if y.shape[0] != x.shape[0]:
            raise RuntimeError(f"paired batch {self.calls} has {y.shape[0]} tokens, "
                               f"expected {x.shape[0]}")
        prod = x.t() @ y
        self._acc = prod if self._acc is None else self._acc + prod
        self.calls += 1
        self.tokens += x.shape[0]

    def mean(self) -> torch.Tensor:
        return self._acc / max(self.tokens, 1)


@dataclass
class Whitening:
    """``S`` with ``S S^T = G + lambda I``: lower-triangular Cholesky factor, or (when
    Cholesky failed) ``Q diag(sqrt(e))`` from the eigen-decomposition ``G + lambda I =
    Q diag(e) Q^T`` (eigenvalues clamped to ``1e-12`` of the largest)."""

    s: torch.Tensor
    damping: float  # the absolute lambda added to the diagonal
    eigvals: torch.Tensor | None = None  # set for the eigen fallback
    eigvecs: torch.Tensor | None = None

    @property
    def cholesky(self) -> bool:
        return self.eigvals is None

    def right_solve(self, m: torch.Tensor) -> torch.Tensor:
        """``M S^{-1}``."""
        if self.cholesky:
            return linalg.solve_triangular(self.s, m, upper=False, left=False)
        return (m / self.eigvals.sqrt()) @ self.eigvecs.t()


def whitening(gram: torch.Tensor, damping: float) -> Whitening:
    """The whitening factor of ``gram`` (float64) with ``lambda = damping *
    mean(diag(gram))`` added to the diagonal (``damping`` itself when the diagonal is all
    zero)."""
    g = gram.to(torch.float64)
    scale = float(g.diagonal().mean())
    lam = damping * (scale if scale > 0 else 1.0)
    g = g + lam * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    chol, info = linalg.cholesky_ex(g)
    if int(info) == 0:
        return Whitening(chol, lam)
    e, q = linalg.eigh(g)
    top = float(e.max()) if float(e.max()) > 0 else 1.0
    e = e.clamp_min(top * 1e-12)
    return Whitening(q * e.sqrt(), lam, e, q)


def dense_inputs(runner: BlockRunner, index: int, hidden: list, chosen: dict
                 ) -> tuple[dict, list]:
    """Inputs of ``chosen`` in the dense block ``index`` (run on the dense stream
    ``hidden``) and the block's outputs, in one pass."""
    outs: list = []
    if not chosen:
        return {}, runner.run_block(index, hidden)
    kept = runner.collect(index, hidden, chosen, lambda _n: KeepInputs(runner.store_device),
                          stop_early=False, outputs=outs, share=True)
    return kept, outs


def whitened_spectrum(w: torch.Tensor, white: Whitening) -> torch.Tensor:
    """Singular values of ``W S`` (decreasing, float64)."""
    return linalg.svdvals(w.detach().to(device=white.s.device, dtype=torch.float64)
                                @ white.s)


def whitened_spectra(lm, input_ids: torch.Tensor, names: dict[str, tuple], *,
                     batch_size: int, damping: float, runner: BlockRunner | None = None
                     ) -> dict[str, torch.Tensor]:
    """Singular values of ``W S`` of every linear in ``names`` (full path -> ``(block,
    path in block)``) from the dense model's Grams (one dense pass)."""
    by_block: dict[int, dict[str, str]] = {}
    for name, (i, path) in names.items():
        by_block.setdefault(i, {})[path] = name
    out: dict[str, torch.Tensor] = {}

    def select(i):
        return {p: m for p, m in lm.adapter.linears(i).items() if p in by_block.get(i, {})}

    def visit(i, grams):
        chosen = select(i)
        whites: dict[int, Whitening] = {}  # linears reading one input share its whitening
        for path, gram in grams.items():
            if id(gram) not in whites:
                whites[id(gram)] = whitening(gram, damping)
            white = whites[id(gram)]
            out[by_block[i][path]] = whitened_spectrum(weight_out_in(chosen[path]),
                                                       white).cpu()

    each_block_grams(lm, input_ids, batch_size=batch_size, select=select, visit=visit,
                     runner=runner)
    return out
