"""Width scores that run the whole model with units masked (ablation-kl, Putri heads,
CoCurve loss changes).

A unit is masked by zeroing its input columns of the consumer projection (``o_proj`` /
``down_proj``): exactly the output of the model with that head or channel removed (the
consumer's bias, if any, does not depend on its input). Weights are restored on exit, so
no hook is registered. Windows run with ``use_cache=False``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from prunelab.log import progress
from prunelab.models.linear import weight_out_in

Unit = tuple[torch.nn.Module, torch.Tensor]  # (consumer module, its input columns)


@contextlib.contextmanager
def masked(units: Sequence[Unit]):
    """Within the context the given consumer input columns are zero."""
    saved = []
    try:
        with torch.no_grad():
            for module, cols in units:
                w = weight_out_in(module)
                saved.append((w, cols, w[:, cols].clone()))
                w[:, cols] = 0
        yield
    finally:
        with torch.no_grad():
            for w, cols, old in reversed(saved):
                w[:, cols] = old


@torch.no_grad()
def _logits(model, ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    dev = next(model.parameters()).device
    return [model(input_ids=b.to(dev), use_cache=False).logits.float()
            for b in ids.split(batch_size)]


def token_nll(model, ids: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """Next-token negative log-likelihood of every predicted position, flattened
    (``[N * (T - 1)]``, float64)."""
    out = []
    for logits, b in zip(_logits(model, ids, batch_size), ids.split(batch_size), strict=True):
        lp = F.log_softmax(logits[:, :-1].double(), dim=-1)
        tgt = b[:, 1:].to(lp.device)
        out.append(-lp.gather(-1, tgt[..., None]).squeeze(-1).reshape(-1).cpu())
    return torch.cat(out)


def ablation_kl(model, ids: torch.Tensor, units: Sequence[Unit], batch_size: int = 4,
                desc: str = "ablation-kl") -> torch.Tensor:
    """Mean per-token ``KL(p_dense || p_masked)`` of the next-token distribution when each
    unit alone is masked (Michel et al. 2019 style head ablation, measured as KL).
    Returns ``[len(units)]`` (float64); costs one forward pass per unit."""
    dense = [F.log_softmax(x.double(), -1) for x in _logits(model, ids, batch_size)]
    scores = []
    for unit in progress(units, total=len(units), desc=desc):
        with masked([unit]):
            got = _logits(model, ids, batch_size)
        total = tokens = 0.0
        for p, q in zip(dense, got, strict=True):
            q = F.log_softmax(q.double(), -1)
            total += float((p.exp() * (p - q)).sum())
            tokens += p.shape[0] * p.shape[1]
        scores.append(total / max(tokens, 1))
    return torch.tensor(scores, dtype=torch.float64)


def loss_deltas(model, ids: torch.Tensor, units: Sequence[Unit], batch_size: int = 4,
                desc: str = "cocurve ablations") -> torch.Tensor:
    """Per-token loss change ``delta_u[t] = nll_masked_u[t] - nll_dense[t]`` for each unit
    ablated alone (CoCurve's features). Returns ``[units, tokens]`` (float64)."""
    base = token_nll(model, ids, batch_size)
    rows = []
    for unit in progress(units, total=len(units), desc=desc):
        with masked([unit]):
            rows.append(token_nll(model, ids, batch_size) - base)
    return torch.stack(rows) if rows else torch.zeros(0, base.numel(), dtype=torch.float64)


def putri_rounds(model, window: torch.Tensor, units: Sequence[Unit], n_remove: int,
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
    for _ in progress(range(rounds), total=rounds, desc=desc):
        cands = [u for u in range(len(units)) if u not in removed and allowed(removed, u)]
        if not cands or len(removed) >= n_remove:
            break
        ppl = {}
        with masked([units[u] for u in removed]):
            for u in cands:
                with masked([units[u]]):
                    ppl[u] = float(token_nll(model, window, 1).mean().exp())
        taken = 0
        for u in sorted(cands, key=lambda u: (ppl[u], u)):
            if len(removed) >= n_remove or taken >= per_round:
                break
            if allowed(removed, u):
                removed.append(u)
                log.append((u, ppl[u]))
                taken += 1
    return log
