"""Width scores that run the model with units masked (ablation-kl, Putri heads, CoCurve
loss changes), block by block through the calibration runner.

A unit is masked by zeroing its input columns of the consumer projection (``o_proj`` /
``down_proj``): exactly the output of the model with that head or channel removed (the
consumer's bias, if any, does not depend on its input). Weights are restored on exit, so
no hook is registered. One dense pass caches the hidden state at every block boundary; a
masked model then runs only from its first changed block on (the blocks before it are
unchanged), each block on the device in turn, so ``offload`` holds (weights on the CPU;
the final norm and LM head stay on the device while an :class:`Ablator` is open).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from prunelab.calib.runner import BlockRunner, StateStore
from prunelab.eval.divergence import kl_from_logits_float64, token_nll
from prunelab.log import progress
from prunelab.models.linear import weight_out_in


class Unit(NamedTuple):
    """A maskable unit: consumer ``module`` of block ``block`` and its input ``cols``."""

    block: int
    module: nn.Module
    cols: torch.Tensor


@contextlib.contextmanager
def masked(units: Sequence[Unit]):
    """Within the context the given consumer input columns are zero."""
    saved = []
    try:
        with torch.no_grad():
            for u in units:
                w = weight_out_in(u.module)
                saved.append((u.module, u.cols, w[:, u.cols].clone()))
                w[:, u.cols] = 0
        yield
    finally:
        with torch.no_grad():
            for module, cols, old in reversed(saved):
                w = weight_out_in(module)  # fetched anew: offloading replaces the storage
                w[:, cols] = old.to(w.device)


class Ablator:
    """Dense block boundaries of ``lm`` on ``ids`` and the logits of masked models.

    Use as a context manager (it holds the cached states and, with offload, the final
    norm and head on the device)."""

    def __init__(self, lm, ids: torch.Tensor, batch_size: int, desc: str = "dense pass"):
        self.runner = BlockRunner(lm, ids, batch_size=batch_size)
        self.adapter = self.runner.adapter
        self.store = StateStore("memory")
        self._moved: list[nn.Module] = []
        try:
            self.runner.run(states=self.store, desc=desc)
            if self.runner.offload:
                for m in (self.adapter.final_norm(), self.adapter.head()):
                    if m is not None:
                        m.to(self.runner.device)
                        self._moved.append(m)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for m in self._moved:
            m.to("cpu")
        self._moved = []
        self.store.close()

    def __enter__(self) -> Ablator:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    @property
    def batches(self) -> list[torch.Tensor]:
        return self.runner.batches

    @torch.no_grad()
    def logits(self, start: int | None = None) -> list[torch.Tensor]:
        """Float32 next-token logits per batch of the model as it is now, assuming blocks
        before ``start`` unchanged (``None``: the dense model, from the cache)."""
        n = self.adapter.num_blocks
        start = n if start is None else start
        hidden = self.store.get(start)
        for b in range(start, n):
            hidden = self.runner.run_block(b, hidden)
        norm = self.adapter.final_norm()
        out = []
        for h in hidden:
            h = h.to(self.runner.device)
            out.append(self.adapter.logits(norm(h) if norm is not None else h).float())
        return out

    def masked_logits(self, units: Sequence[Unit]) -> list[torch.Tensor]:
        with masked(units):
            return self.logits(min(u.block for u in units))

    def token_nll(self, logits: list[torch.Tensor]) -> torch.Tensor:
        """Flattened float64 next-token NLL of every predicted position (``[N * (T-1)]``)."""
        return torch.cat([token_nll(lg, ids, torch.float64).reshape(-1).cpu()
                          for lg, ids in zip(logits, self.batches, strict=True)])


def ablation_kl(lm, ids: torch.Tensor, units: Sequence[Unit], batch_size: int = 4,
                desc: str = "ablation-kl") -> torch.Tensor:
    """Mean per-token ``KL(p_dense || p_masked)`` of the next-token distribution when each
    unit alone is masked (Michel et al. 2019 style head ablation, measured as KL).
    Returns ``[len(units)]`` (float64); costs the blocks from the unit's on, per unit."""
    with Ablator(lm, ids, batch_size) as ab:
        dense = ab.logits()
        scores = []
        for unit in progress(units, total=len(units), desc=desc):
            got = ab.masked_logits([unit])
            total = sum(float(kl_from_logits_float64(p, q).sum()) for p, q in zip(dense, got,
                                                                      strict=True))
            tokens = sum(p.shape[0] * p.shape[1] for p in dense)
            scores.append(total / max(tokens, 1))
    return torch.tensor(scores, dtype=torch.float64)


def loss_deltas(lm, ids: torch.Tensor, units: Sequence[Unit], batch_size: int = 4,
                desc: str = "cocurve ablations") -> torch.Tensor:
    """Per-token loss change ``delta_u[t] = nll_masked_u[t] - nll_dense[t]`` for each unit
    ablated alone (CoCurve's features). Returns ``[units, tokens]`` (float64)."""
    with Ablator(lm, ids, batch_size) as ab:
        base = ab.token_nll(ab.logits())
        rows = [ab.token_nll(ab.masked_logits([unit])) - base
                for unit in progress(units, total=len(units), desc=desc)]
    return torch.stack(rows) if rows else torch.zeros(0, base.numel(), dtype=torch.float64)


def putri_rounds(lm, window: torch.Tensor, units: Sequence[Unit], n_remove: int,
                 allowed: Callable[[list[int], int], bool], per_round: int = 1,
                 desc: str = "putri rounds") -> list[tuple[int, float]]:
    """Putri head selection (derived): round by round, mask each remaining unit on top of
    those already removed, measure the perplexity of one calibration ``window`` and remove
    the ``per_round`` units whose masking hurts least. ``allowed(removed, u)`` vetoes
    units (per-block limits). Returns ``[(unit, perplexity when removed)]`` in removal
    order (``n_remove`` entries or fewer when nothing more is allowed)."""
    removed: list[int] = []
    log: list[tuple[int, float]] = []
    rounds = -(-n_remove // per_round)
    with Ablator(lm, window, batch_size=1) as ab:
        for _ in progress(range(rounds), total=rounds, desc=desc):
            cands = [u for u in range(len(units)) if u not in removed and allowed(removed, u)]
            if not cands or len(removed) >= n_remove:
                break
            ppl = {}
            for u in cands:
                logits = ab.masked_logits([units[r] for r in removed] + [units[u]])
                ppl[u] = float(ab.token_nll(logits).mean().exp())
            taken = 0
            for u in sorted(cands, key=lambda u: (ppl[u], u)):
                if len(removed) >= n_remove or taken >= per_round:
                    break
                if allowed(removed, u):
                    removed.append(u)
                    log.append((u, ppl[u]))
                    taken += 1
    return log
