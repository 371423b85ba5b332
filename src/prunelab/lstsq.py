"""Ridge least squares from accumulated normal equations (float64)."""

from __future__ import annotations

import torch

from prunelab import linalg


class NormalEquations:
    """Accumulates ``A^T A`` and ``A^T B`` over row batches (float64), optionally with a
    column of ones appended to ``A`` (affine fits)."""

    def __init__(self, affine: bool = False):
        self.affine = affine
        self.ata: torch.Tensor | None = None
        self.atb: torch.Tensor | None = None
        self.rows = 0

    def update(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """``a``: ``[..., d_in]``, ``b``: ``[..., d_out]`` with the same leading shape."""
        a = a.reshape(-1, a.shape[-1]).double().cpu()
        b = b.reshape(-1, b.shape[-1]).double().cpu()
        if self.affine:
            a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], dim=1)
        ata, atb = a.t() @ a, a.t() @ b
        self.ata = ata if self.ata is None else self.ata + ata
        self.atb = atb if self.atb is None else self.atb + atb
        self.rows += a.shape[0]

    def solve(self, ridge: float = 1e-6) -> torch.Tensor:
        """``X = (A^T A + lambda I)^{-1} A^T B`` with ``lambda = ridge * mean(diag(A^T A))``
        (the bias row of an affine fit is not penalised). Shape ``[d_in (+1), d_out]``."""
        return ridge_solve(self.ata, self.atb, ridge, unpenalised_last=self.affine)


def ridge_solve(ata: torch.Tensor, atb: torch.Tensor, ridge: float = 1e-6,
                unpenalised_last: bool = False) -> torch.Tensor:
    """Solve the (relative-)ridge normal equations by Cholesky, with a damping cascade
    (x10 up to 6 times) and a least-squares fallback when the system is singular."""
    d = ata.shape[0]
    diag_mean = float(ata.diagonal().mean()) if d else 0.0
    scale = diag_mean if diag_mean > 0 else 1.0
    penalty = torch.ones(d, dtype=ata.dtype)
    if unpenalised_last:
        penalty[-1] = 0.0
    lam = ridge * scale
    for _ in range(7):
        system = ata + torch.diag(penalty * lam)
        chol, info = linalg.cholesky_ex(system)
        if int(info) == 0:
            return torch.cholesky_solve(atb, chol)
        lam = max(lam * 10, 1e-10 * scale)
    return linalg.lstsq(ata + torch.diag(penalty * lam), atb).solution
