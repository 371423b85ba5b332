"""ADMM weight update for pruned layers (Boza 2024, "Fast and Effective Weight Update for
Pruned Large Language Models", arXiv:2401.02938) and its Kronecker-curvature form used by
CACTUS (:mod:`prunelab.pruning.sparsity.methods.cactus`).

Layer ``y = W x`` (``W`` ``[d_out, d_in]``), calibration inputs ``X``, ``A = X^T X``. For a
kept mask ``M`` solve ``min_W' tr((W - W') A (W - W')^T G)`` subject to ``W' = M * W'``
(``G = I``: the paper's ``||X W^T - X W'^T||^2``) by scaled ADMM on the split ``W = Z``:

    W <- argmin  1/2 tr((W - W0) A (W - W0)^T G) + rho/2 ||W - (Z - U)||^2
    Z <- M * (W + U)          U <- U + W - Z

From the paper (and the authors' public code): the problem is first normalised by the
column norms ``s_j = sqrt(A_jj)`` (``W_n = W diag(s)``, ``A_n = diag(1/s) A diag(1/s)``,
unit diagonal), ``A_n`` is damped by ``damp * mean(diag A_n)``, ``rho`` is then 1, 20
iterations; the gradual variant re-selects the mask from ``|W + U|`` (normalised
coordinates) in the first ``T_s = 15`` iterations with the cubic schedule
``s_t = s (1 - (1 - (t + 1) / T_s)^3)``. Our defaults are exactly these (``damp = 0.1``,
``rho = 1``, constant). Ours, not the paper's: ``rho_growth > 1`` multiplies ``rho`` after
every iteration (the usual geometric increase of ADMM practice, Boyd et al. 2011,
"Distributed Optimization and Statistical Learning via ADMM", sec. 3.4.1; off by default),
and the unstructured comparison group is the config's ``group`` (default per output row,
as Wanda; the authors' code compares over the whole layer unless asked per output).

Derived here (prunelab): the W-step is solved in the eigenbases of the damped, normalised
factors, ``A_n = R diag(a) R^T`` and ``G_n = P diag(g) P^T`` (one decomposition per layer,
cached for linears sharing an input): in ``W' = P^T W R`` the stationarity condition
``G_n (W - W0) A_n + rho (W - V) = 0`` is elementwise,
``W'_ij = (g_i a_j W0'_ij + rho V'_ij) / (g_i a_j + rho)``, so ``rho`` may change at no
cost. Without ``G`` (``P = I``, ``g = 1``) this is exactly the paper's
``W = (A_n + rho I)^{-1} (A_n W0 + rho (Z - U))`` (row form). The N:M gradual variant
keeps, at step ``t``, every weight the N:M mask of ``|W + U|`` keeps and prunes the lowest
``s_t`` of each row among the others, reaching the exact N:M mask at ``t = T_s - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prunelab import linalg
from prunelab.calib.stats import Gram
from prunelab.errors import ConfigError
from prunelab.pruning.base import METHODS
from prunelab.pruning.sparsity import masks
from prunelab.pruning.sparsity.config import SparsityConfig, find
from prunelab.pruning.sparsity.scores import magnitude_scores, wanda_scores
from prunelab.pruning.sparsity.sparsegpt import sparsegpt_prune
from prunelab.registry import check_range

MASK_SOURCES = ("wanda", "sparsegpt", "magnitude")


@dataclass
class Factor:
    """A curvature factor ``C`` ``[d, d]`` normalised to unit diagonal and damped:
    ``C_n = diag(1/scale) C diag(1/scale) + damp I = vecs diag(vals) vecs^T``
    (``vecs=None``: the identity factor, ``G = I``)."""

    scale: torch.Tensor
    vals: torch.Tensor
    vecs: torch.Tensor | None


def factor(c: torch.Tensor, damp: float) -> Factor:
    """Normalise (``scale = sqrt(diag C)``, floored for dead channels), damp by ``damp``
    times the mean normalised diagonal, and eigen-decompose ``c`` in float64."""
    c = c.double()
    d = c.diagonal().clamp_min(0).sqrt()
    scale = d.clamp_min(max(float(d.max()) * 1e-8, 1e-30)) if d.numel() else d
    cn = c / scale[:, None] / scale[None, :]
    cn = (cn + cn.t()) / 2
    cn.diagonal().add_(damp * float(cn.diagonal().mean()) + 1e-12)
    vals, vecs = linalg.eigh(cn)
    return Factor(scale, vals.clamp_min(1e-12 * float(vals.max())), vecs)


def identity_factor(d: int, device=None) -> Factor:
    """``G = I`` (no output curvature): unit scale, unit eigenvalues, no rotation."""
    one = torch.ones(d, dtype=torch.float64, device=device)
    return Factor(one, one, None)


class Coords:
    """Normalised and rotated coordinates of one layer: ``n(W) = diag(sg) W diag(sa)``,
    ``rot(M) = P^T M R`` (float32 matmuls; the factors were computed in float64)."""

    def __init__(self, fa: Factor, fg: Factor, device, dtype=torch.float32):
        self.sa, self.sg = fa.scale.to(device, dtype), fg.scale.to(device, dtype)
        self.a, self.g = fa.vals.to(device, dtype), fg.vals.to(device, dtype)
        self.r = fa.vecs.to(device, dtype)
        self.p = None if fg.vecs is None else fg.vecs.to(device, dtype)

    def norm(self, w):
        return w * self.sg[:, None] * self.sa[None, :]

    def unnorm(self, w):
        return w / self.sg[:, None] / self.sa[None, :]

    def rot(self, m):
        m = m @ self.r
        return m if self.p is None else self.p.t() @ m

    def unrot(self, m):
        m = m @ self.r.t()
        return m if self.p is None else self.p @ m


def lowrank_in_metric(c: Coords, m: torch.Tensor, rank: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` approximation of ``m`` (normalised coordinates) in the norm
    ``||G_n^{1/2} m A_n^{1/2}||_F``: truncated SVD of the whitened matrix, unwhitened.
    Returns ``(L, left, right)`` with ``L = left @ right`` (``[d_out, r] @ [r, d_in]``)."""
    rg, ra = c.g.sqrt(), c.a.sqrt()
    u, s, vh = _truncated_svd(c.rot(m) * rg[:, None] * ra[None, :], rank)
    left = u[:, :rank] * s[:rank] / rg[:, None]
    left = left if c.p is None else c.p @ left
    right = (vh[:rank] / ra[None, :]) @ c.r.t()
    return left @ right, left, right


def _truncated_svd(m: torch.Tensor, rank: int):
    """The leading ``rank`` singular triplets: a full SVD, or for ``rank`` below a quarter
    of ``min(m.shape)`` a randomized one (Halko et al. 2011; ``q = rank + 10``, 4 power
    iterations, a fixed seed so the same inputs give the same factors)."""
    if rank == 0 or 4 * rank > min(m.shape):
        return linalg.svd(m, full_matrices=False)
    with torch.random.fork_rng(devices=[m.device] if m.device.type == "cuda" else []):
        torch.manual_seed(0)
        u, s, v = torch.svd_lowrank(m, q=min(rank + 10, min(m.shape)), niter=4)
    return u, s, v.t()


def cubic_sparsity(target: float, t: int, steps: int) -> float:
    """Sparsity at 0-based iteration ``t`` of the cubic schedule over ``steps``."""
    return target * (1.0 - (1.0 - min(t + 1, steps) / steps) ** 3)


def gradual_mask(score: torch.Tensor, s_t: float, target: float,
                 nm: tuple[int, int] | None, group: str) -> torch.Tensor:
    """Kept mask at sparsity ``s_t``; with N:M, a superset of the N:M mask of ``score``
    equal to it at ``s_t = target``."""
    if nm is None:
        return masks.unstructured_mask(score, s_t, group=group)
    keep_nm = masks.nm_mask(score, *nm)
    if s_t >= target:
        return keep_nm
    return masks.unstructured_mask(score.masked_fill(keep_nm, float("inf")), s_t)


@dataclass
class AdmmSettings:
    """Iteration settings of :func:`admm_solve` (see the module docstring)."""

    iterations: int = 20
    gradual_iterations: int = 0
    rho: float = 1.0
    rho_growth: float = 1.0
    rank: int = 0
    target: float = 0.5
    nm: tuple[int, int] | None = None
    group: str = "row"
    tolerance: float = 0.0


def converged(w: torch.Tensor, s: torch.Tensor, s_prev: torch.Tensor, u: torch.Tensor,
              rho: float, tol: float) -> bool:
    """Boyd et al. 2011 (sec. 3.3.1) stopping rule with relative tolerances only, scaled
    form: primal residual ``||W - S||_F <= tol * max(||W||_F, ||S||_F)`` and dual residual
    ``rho ||S - S_prev||_F <= tol * rho ||U||_F`` (``rho U`` is the unscaled dual)."""
    if tol <= 0:
        return False
    primal = torch.linalg.vector_norm(w - s)
    dual = torch.linalg.vector_norm(s - s_prev)
    return bool(primal <= tol * torch.maximum(torch.linalg.vector_norm(w),
                                              torch.linalg.vector_norm(s))
                and dual <= tol * torch.linalg.vector_norm(u))


def admm_solve(w0: torch.Tensor, fa: Factor, fg: Factor, keep: torch.Tensor | None,
               st: AdmmSettings, start: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """ADMM on ``w0`` ``[d_out, d_in]`` with input factor ``fa`` and output factor ``fg``;
    ``keep``: a fixed kept mask, or ``None`` with ``st.gradual_iterations > 0`` (mask
    chosen inside the iterations). ``start``: the initial ``W = S`` (a warm start, e.g.
    SparseGPT's pruned weights; default ``w0``). With ``st.tolerance > 0`` the iterations
    stop early, once the mask is fixed, when :func:`converged`. With ``st.rank > 0`` the
    constrained variable is
    ``S + L`` (``S`` masked, ``L`` of rank ``st.rank`` in the metric), alternating
    ``S = M * (W + U - L)`` and ``L = SVD_r(W + U - S)``. Returns ``(S, left, right)`` in
    original coordinates, float32 (``left @ right = L``; ``None`` without rank)."""
    c = Coords(fa, fg, w0.device)
    wn0 = c.norm(w0.float())
    w0r = c.rot(wn0)
    curv = c.g[:, None] * c.a[None, :]
    w = wn0.clone() if start is None else c.norm(start.float())
    u = torch.zeros_like(wn0)
    s_prev = None
    low = torch.zeros_like(wn0)
    left = right = None
    rho = float(st.rho)
    if c.p is None and st.rho_growth == 1.0:  # G = I, fixed rho: one matmul per W-step
        k = (c.r / (c.a + rho)) @ c.r.t()  # (A_n + rho I)^{-1}
        base = (w0r * (c.a / (c.a + rho))) @ c.r.t()  # W0 A_n (A_n + rho I)^{-1}

        def w_step(v):
            return torch.addmm(base, v, k, alpha=rho)
    else:
        def w_step(v):
            return c.unrot((curv * w0r + rho * c.rot(v)) / (curv + rho))
    lowrank = st.rank > 0
    for t in range(st.iterations + 1):
        z = w + u  # W + U (- L): the constrained variable's target
        if lowrank:
            z.sub_(low)
        if keep is None or t < st.gradual_iterations:
            s_t = cubic_sparsity(st.target, t, max(st.gradual_iterations, 1))
            keep = gradual_mask(z.abs(), s_t, st.target, st.nm, st.group)
        s = z.mul_(keep)
        if lowrank:
            low, left, right = lowrank_in_metric(c, w + u - s, st.rank)
        target = s + low if lowrank else s  # the constrained variable W must equal
        if t == st.iterations or (
                s_prev is not None and t > st.gradual_iterations
                and converged(w, target, s_prev, u, rho, st.tolerance)):
            break
        s_prev = target if st.tolerance > 0 else None
        u.add_(w).sub_(s)  # U + W - S (- L)
        if lowrank:
            u.sub_(low)
            w = w_step(s + low - u)
        else:
            w = w_step(s - u)
        rho *= st.rho_growth
    if left is not None:
        left, right = left / c.sg[:, None], right / c.sa[None, :]
    return c.unnorm(s), left, right


def input_factor(accs: list, damp: float) -> Factor:
    """The damped, eigen-decomposed ``A = X^T X`` of a linear, cached on its ``Gram``
    (linears sharing one input share it)."""
    gram = find(accs, Gram)
    cache = gram.__dict__.setdefault("_admm_factor", {})
    if damp not in cache:
        cache[damp] = factor(gram.xtx, damp)
    return cache[damp]


def initial_mask(cfg, w: torch.Tensor, accs: list, sparsity: float) -> torch.Tensor:
    """The kept mask ``cfg.mask_from`` chooses on the dense ``w``."""
    if cfg.mask_from == "magnitude":
        return cfg.keep_mask(magnitude_scores(w), sparsity)
    xtx = find(accs, Gram).xtx
    if cfg.mask_from == "wanda":
        return cfg.keep_mask(wanda_scores(w, xtx.diagonal().to(w.device)), sparsity)
    return sparsegpt_start(cfg, w, accs, sparsity)[1]


def sparsegpt_start(cfg, w: torch.Tensor, accs: list, sparsity: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT's ``(pruned weights, kept mask)`` on the dense ``w``: the warm start."""
    xtx = find(accs, Gram).xtx
    new, keep = sparsegpt_prune(w, xtx.float(), sparsity, pattern=cfg.nm,
                                mask_group="block" if cfg.group == "layer" else "row")
    return new.to(w.device), keep


@METHODS.register("admm")
@dataclass(frozen=True)
class Admm(SparsityConfig):
    """ADMM weight update (Boza 2024) on the mask of ``mask_from`` (wanda, sparsegpt or
    magnitude, chosen on the dense weights), or with ``gradual=True`` on a mask chosen
    inside the iterations by the cubic schedule. Defaults: 20 iterations, 15 gradual,
    ``rho = 1`` on the column-normalised problem, damping 0.1 (the authors' code)."""

    mask_from: str = field(default="wanda", metadata={
        "help": "admm/cactus: mask from wanda, sparsegpt or magnitude (unless gradual)"})
    gradual: bool = field(default=False, metadata={
        "help": "admm/cactus: choose the mask inside the iterations (cubic schedule)"})
    iterations: int = field(default=20, metadata={"help": "admm/cactus: ADMM iterations"})
    gradual_iterations: int = field(default=15, metadata={
        "help": "admm/cactus: iterations of the cubic mask schedule (gradual)"})
    rho: float = field(default=1.0, metadata={
        "help": "admm/cactus: penalty rho (column-normalised problem)"})
    rho_growth: float = field(default=1.0, metadata={
        "help": "admm/cactus: rho multiplied by this after every iteration"})
    admm_damp: float = field(default=0.1, metadata={
        "help": "admm/cactus: damping of X^T X, a fraction of its mean normalised diagonal"})
    tolerance: float = field(default=0.0, metadata={
        "help": "admm/cactus: stop once the relative primal and dual residuals fall below "
                "this (0: always run every iteration)"})
    warm_start: bool = field(default=False, metadata={
        "help": "admm/cactus: start the iterations from SparseGPT's pruned weights "
                "(needs mask-from sparsegpt, not gradual)"})

    def __post_init__(self):
        super().__post_init__()
        if self.mask_from not in MASK_SOURCES:
            raise ConfigError(f"mask-from must be one of {', '.join(MASK_SOURCES)}, got "
                              f"{self.mask_from!r}")
        check_range("iterations", self.iterations, 1, 10_000, integer=True)
        check_range("gradual_iterations", self.gradual_iterations, 1, 10_000, integer=True)
        if self.gradual and self.gradual_iterations > self.iterations:
            raise ConfigError("gradual-iterations must not exceed iterations")
        check_range("rho", self.rho, 1e-8, 1e8)
        check_range("rho_growth", self.rho_growth, 1.0, 10.0)
        check_range("admm_damp", self.admm_damp, 0.0, 10.0)
        check_range("tolerance", self.tolerance, 0.0, 1.0)
        if self.warm_start and (self.gradual or self.mask_from != "sparsegpt"):
            raise ConfigError("warm-start starts from SparseGPT's weights: it needs "
                              "mask-from sparsegpt and no gradual mask")

    def accumulators(self):
        return lambda name: [Gram(torch.float32)]

    def settings(self, sparsity: float, rank: int = 0) -> AdmmSettings:
        return AdmmSettings(iterations=self.iterations,
                            gradual_iterations=self.gradual_iterations if self.gradual else 0,
                            rho=self.rho, rho_growth=self.rho_growth, rank=rank,
                            target=self.target_sparsity if self.nm else sparsity,
                            nm=self.nm, group=self.group, tolerance=self.tolerance)

    def output_factor(self, w: torch.Tensor, accs: list) -> Factor:
        """``G``: the identity for the plain ADMM update."""
        return identity_factor(w.shape[0])

    def solve(self, w: torch.Tensor, accs: list, sparsity: float, rank: int = 0):
        """``(S, left, right)`` of :func:`admm_solve` for this config."""
        start = None
        if self.warm_start:
            start, keep = sparsegpt_start(self, w, accs, sparsity)
        else:
            keep = None if self.gradual else initial_mask(self, w, accs, sparsity)
        return admm_solve(w, input_factor(accs, self.admm_damp), self.output_factor(w, accs),
                          None if keep is None else keep.to(w.device),
                          self.settings(sparsity, rank), start=start)

    def prune_weight(self, w, accs, sparsity):
        return self.solve(w, accs, sparsity)[0].to(w.dtype)
