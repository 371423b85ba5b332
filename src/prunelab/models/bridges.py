"""Linear bridges over removed spans: Ghosted Layers and linear residual adapters.

A bridge maps the residual stream at a cut, ``x -> x W + b`` (``[..., d]``), and is
attached to the module whose output is the stream at the cut (the last kept block before
the cut, or the embeddings when the cut starts at block 0) as a forward hook.

* ``ghost`` (Ghosted Layers): ``Delta = Y - X``; ``(X^T X + eps I) M = X^T Delta`` with
  ``eps = 1e-6 * mean(diag(X^T X))``; ``W = I + M``, no bias.
* ``lra`` (linear residual adapter, SHIFT-LLM; derived): affine ``[M; b]`` by ridge least
  squares on ``[X, 1] -> Y - X``; with ``rank`` r the reduced-rank solution
  ``M_r = C^{-1/2} SVD_r(C^{1/2} M)``, ``C = X^T X``, stored as factors ``A B`` (``d x r``,
  ``r x d``): ``x -> x + x A B + b``.
* token-aware (VGGT layer study): separate maps for the first position (BOS / attention
  sink) and for the rest; the first position is position id 0 when the block receives
  ``position_ids``, else index 0 of a sequence longer than one token.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab import linalg
from prunelab.lstsq import NormalEquations, ridge_solve

BRIDGE_ATTR = "prunelab_bridge"


class LinearBridge(nn.Module):
    """``x -> x + x A B + b`` (low rank) or ``x -> x W + b`` (full), optionally with a
    second map for the first position (``first_*``)."""

    def __init__(self, dim: int, rank: int | None = None, bias: bool = False,
                 token_aware: bool = False, dtype=torch.float32):
        super().__init__()
        self.dim, self.rank, self.token_aware = dim, rank, token_aware
        self.has_bias = bias
        for prefix in ("", "first_") if token_aware else ("",):
            if rank is None:
                self.register_parameter(prefix + "weight",
                                        nn.Parameter(torch.eye(dim, dtype=dtype)))
            else:
                self.register_parameter(prefix + "down",
                                        nn.Parameter(torch.zeros(dim, rank, dtype=dtype)))
                self.register_parameter(prefix + "up",
                                        nn.Parameter(torch.zeros(rank, dim, dtype=dtype)))
            if bias:
                self.register_parameter(prefix + "bias",
                                        nn.Parameter(torch.zeros(dim, dtype=dtype)))

    def _map(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        if self.rank is None:
            y = x @ getattr(self, prefix + "weight").to(x.dtype)
        else:
            y = x + (x @ getattr(self, prefix + "down").to(x.dtype)) @ \
                getattr(self, prefix + "up").to(x.dtype)
        if self.has_bias:
            y = y + getattr(self, prefix + "bias").to(x.dtype)
        return y

    def forward(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """``first``: bool ``[B, T]`` marking first positions (token-aware bridges)."""
        y = self._map(x, "")
        if self.token_aware and first is not None and bool(first.any()):
            y = torch.where(first.unsqueeze(-1), self._map(x, "first_"), y)
        return y

    def load_fit(self, fit: dict, prefix: str = "") -> None:
        """Copy a fit (``weight`` or ``down``/``up``, and ``bias``) into the parameters."""
        with torch.no_grad():
            for key, value in fit.items():
                getattr(self, prefix + key).copy_(value.to(getattr(self, prefix + key).dtype))


def first_positions(hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Bool ``[B, T]``: where the position id is 0 (see module docstring)."""
    pos = kwargs.get("position_ids") if kwargs else None
    b, t = hidden.shape[0], hidden.shape[1]
    if pos is not None:
        return (pos == 0).expand(b, t) if pos.dim() == 2 else (pos == 0).reshape(1, -1).expand(b, t)
    first = torch.zeros(b, t, dtype=torch.bool, device=hidden.device)
    if t > 1:
        first[:, 0] = True
    return first


def _bridge_hook(module, args, kwargs, output):
    bridge = getattr(module, BRIDGE_ATTR)
    hidden = output[0] if isinstance(output, tuple) else output
    first = first_positions(hidden, kwargs) if bridge.token_aware else None
    new = bridge(hidden, first)
    return (new, *output[1:]) if isinstance(output, tuple) else new


def attach_bridge(module: nn.Module, bridge: LinearBridge) -> None:
    """Make ``bridge`` a submodule of ``module`` and apply it to its output (a hook that
    lives as long as the model; checkpoints re-attach it in their modeling file)."""
    if hasattr(module, BRIDGE_ATTR):
        raise ValueError("module already carries a bridge")
    module.add_module(BRIDGE_ATTR, bridge)
    module._prunelab_bridge_handle = module.register_forward_hook(_bridge_hook,
                                                                  with_kwargs=True)


def fit_bridge(xs, ys, kind: str, rank: int | None = None, ridge: float = 1e-6,
               first_masks=None) -> list[dict]:
    """Fit a bridge mapping ``xs`` to ``ys`` (lists of ``[B, T, d]``).

    Returns ``[rest_fit]`` or ``[rest_fit, first_fit]`` (token-aware when ``first_masks``
    is given), each ``{"weight"}`` (ghost), ``{"weight", "bias"}`` (lra) or
    ``{"down", "up", "bias"}`` (lra with rank).
    """
    if kind not in ("ghost", "lra"):
        raise ValueError(f"bridge kind must be ghost or lra, got {kind!r}")
    groups = [None] if first_masks is None else [False, True]
    fits = []
    for want_first in groups:
        eq = NormalEquations(affine=(kind == "lra"))
        gram = NormalEquations()
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            x, y = x.double(), y.double()
            if want_first is not None:
                sel = first_masks[i] if want_first else ~first_masks[i]
                x, y = x[sel], y[sel]
            if x.numel() == 0:
                continue
            eq.update(x, y - x)
            if rank is not None:
                gram.update(x, x[..., :1])
        if eq.ata is None:
            raise ValueError("no tokens to fit a bridge on")
        sol = eq.solve(ridge)
        d = sol.shape[1]
        m, b = (sol[:d], sol[d]) if kind == "lra" else (sol, None)
        if kind == "ghost":
            fits.append({"weight": torch.eye(d, dtype=m.dtype) + m})
        elif rank is None:
            fits.append({"weight": torch.eye(d, dtype=m.dtype) + m, "bias": b})
        else:
            down, up = reduced_rank(m, gram.ata, rank)
            fits.append({"down": down, "up": up, "bias": b})
    return fits


def reduced_rank(m: torch.Tensor, c: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``M_r = C^{-1/2} SVD_r(C^{1/2} M)`` as factors ``(A [d, r], B [r, d])``."""
    evals, evecs = linalg.eigh(c.double())
    evals = evals.clamp_min(evals.max() * 1e-12)
    c_half = (evecs * evals.sqrt()) @ evecs.t()
    c_ihalf = (evecs * evals.rsqrt()) @ evecs.t()
    u, s, vh = linalg.svd(c_half @ m.double(), full_matrices=False)
    r = min(rank, s.numel())
    return c_ihalf @ (u[:, :r] * s[:r]), vh[:r]


__all__ = ["BRIDGE_ATTR", "LinearBridge", "attach_bridge", "fit_bridge", "first_positions",
           "reduced_rank", "ridge_solve"]
