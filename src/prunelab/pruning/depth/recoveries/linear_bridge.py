"""Shared by ``ghost`` and ``lra``: a small linear module over each removed span (see
:mod:`prunelab.models.bridges`), attached to the module whose output is the stream at the
cut (the last kept block, or the embeddings). Checkpoints carry a modeling file and load
with ``trust_remote_code=True``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from prunelab.models.bridges import LinearBridge, attach_bridge, fit_bridge
from prunelab.pruning.depth.recoveries.base import Recovery, check_ridge, cut_error, ridge_field


def first_masks(hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """Bool ``[B, T]`` per batch marking position 0 (the token-aware bridge's first map)."""
    masks = []
    for h in hidden:
        m = torch.zeros(h.shape[0], h.shape[1], dtype=torch.bool)
        m[:, 0] = True
        masks.append(m)
    return masks


@dataclass(frozen=True)
class BridgeRecovery(Recovery):
    """A linear bridge fitted on ``X`` (the stream at the cut) -> ``Y`` (the dense state)."""

    token_aware: bool = field(default=False, metadata={
        "help": "ghost/lra: separate map for the first position"})
    ridge: float = ridge_field()

    needs_remote_code = True
    repairs_embeddings = True
    #: ``fit_bridge`` kind ("ghost" or "lra") and whether the bridge has a bias
    kind: ClassVar[str] = "ghost"
    bias: ClassVar[bool] = False

    def __post_init__(self):
        check_ridge(self.ridge)

    @property
    def bridge_rank(self) -> int | None:
        return None

    def make_bridge(self, xs, ys, dim: int, dtype) -> LinearBridge:
        """Fit and build the bridge mapping ``xs`` to ``ys`` (lists of ``[B, T, d]``)."""
        masks = first_masks(xs) if self.token_aware else None
        fits = fit_bridge(xs, ys, self.kind, rank=self.bridge_rank, ridge=self.ridge,
                          first_masks=masks)
        bridge = LinearBridge(dim, rank=self.bridge_rank, bias=self.bias,
                              token_aware=self.token_aware, dtype=dtype)
        bridge.load_fit(fits[0])
        if self.token_aware:
            bridge.load_fit(fits[1], prefix="first_")
        return bridge

    def _new_bridge(self, runner, xs, ys) -> LinearBridge:
        dtype = next(runner.model.parameters()).dtype
        return self.make_bridge(xs, ys, runner.adapter.hidden_size(), dtype)

    def at_embeddings(self, runner, xs, targets):
        bridge = self._new_bridge(runner, xs, targets)
        attach_bridge(runner.adapter.embeddings(), bridge)
        dtype = next(runner.model.parameters()).dtype
        new = [bridge(x.to(dtype), m if self.token_aware else None).detach()
               for x, m in zip(xs, first_masks(xs), strict=True)]
        return new, {"error_before": cut_error(xs, targets),
                     "error_after": cut_error(new, targets)}

    def at_block(self, runner, index, inputs, targets):
        xs = runner.run_block(index, inputs)
        attach_bridge(runner.adapter.block(index), self._new_bridge(runner, xs, targets))
        return {"error_before": cut_error(xs, targets),
                "error_after": cut_error(runner.run_block(index, inputs), targets)}
