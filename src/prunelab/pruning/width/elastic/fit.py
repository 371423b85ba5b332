"""Fitting the elastic ranking on calibration windows (the objective is in
:mod:`prunelab.pruning.width.elastic.ranking`): weights frozen, scores trained by Adam, a few
budgets per step, temperature annealed."""

from __future__ import annotations

import time

import torch

from prunelab.eval.divergence import kl_from_logits
from prunelab.eval.embedding import mean_pool
from prunelab.pruning.width.elastic.ranking import (
    Units,
    initial_scores,
    masked,
    model_units,
    soft_keep,
    temperature_at,
)


def model_output(lm, ids: torch.Tensor) -> torch.Tensor:
    """Logits (decoders) or mean-pooled last hidden states (encoders) of ``ids``."""
    ids = ids.to(lm.device)
    if lm.is_encoder:
        mask = torch.ones_like(ids)
        hidden = lm.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return mean_pool(hidden.float(), mask)
    return lm.model(input_ids=ids, use_cache=False).logits


def output_loss(lm, ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Mean ``KL(p_ref || p)`` per token (decoders) or mean ``1 - cos`` (encoders)."""
    if lm.is_encoder:
        return (1 - torch.nn.functional.cosine_similarity(out.float(), ref.float(), -1)).mean()
    return kl_from_logits(ref, out).mean()


def fit_ranking(lm, input_ids: torch.Tensor, *, budgets: tuple[float, float] = (0.1, 0.6),
                steps: int = 200, lr: float = 0.05, budgets_per_step: int = 2,
                t_start: float = 1.0, t_end: float = 0.05, batch_size: int = 8,
                seed: int = 0, cache_bytes: int = 256 * 2**20) -> dict:
    """Learn the elastic ranking of ``lm`` on ``input_ids`` ``[N, T]``; returns the ranking
    dict (:func:`ranking_dict`) with the fit's first/last loss and time. The dense outputs
    are cached up to ``cache_bytes``, else recomputed each step."""
    ad = lm.adapter
    units = model_units(ad)
    gen = torch.Generator().manual_seed(seed)
    scores = initial_scores(ad, units).clone().requires_grad_(True)
    opt = torch.optim.Adam([scores], lr=lr)
    batches = list(torch.as_tensor(input_ids).split(batch_size))
    frozen = [(p, p.requires_grad) for p in lm.model.parameters()]
    start, trace = time.perf_counter(), []
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        refs = _References(lm, batches, cache_bytes)
        for step in range(steps):
            temp = temperature_at(step, steps, t_start, t_end)
            j = step % len(batches)
            draws = budgets[0] + (budgets[1] - budgets[0]) * torch.rand(budgets_per_step,
                                                                       generator=gen)
            opt.zero_grad()
            ref = refs.get(j)  # outside the masks
            total = 0.0
            for b in draws.tolist():
                mask = soft_keep(scores, units.costs.float(), b, temp)
                with masked(lm, units, mask):
                    loss = output_loss(lm, ref, model_output(lm, batches[j]))
                (loss / budgets_per_step).backward()
                total += float(loss.detach()) / budgets_per_step
            opt.step()
            trace.append(total)
    finally:
        for p, req in frozen:
            p.requires_grad_(req)
    seconds = time.perf_counter() - start
    return ranking_dict(ad, units, scores.detach(), {
        "budgets": list(budgets), "steps": steps, "lr": lr, "budgets_per_step":
        budgets_per_step, "t_start": t_start, "t_end": t_end, "seed": seed,
        "windows": int(len(input_ids)), "seconds": seconds,
        "loss_first": trace[0] if trace else None, "loss_last": trace[-1] if trace else None})


class _References:
    """Dense outputs per batch: cached while they fit in ``cache_bytes`` (decoder logits
    of a large vocabulary do not: 32 x 256 tokens x 49k logits is 1.6 GB), else recomputed
    without grad when needed (one extra forward per step)."""

    def __init__(self, lm, batches: list[torch.Tensor], cache_bytes: int = 256 * 2**20):
        self.lm, self.batches = lm, batches
        width = 1 if lm.is_encoder else int(lm.model.config.vocab_size)
        size = sum(b.numel() for b in batches) * width * 4
        self.cache = None
        if size <= cache_bytes:
            with torch.no_grad():
                self.cache = [model_output(lm, b).detach() for b in batches]

    def get(self, j: int) -> torch.Tensor:
        if self.cache is not None:
            return self.cache[j]
        with torch.no_grad():
            return model_output(self.lm, self.batches[j]).detach()


FORMAT = "prunelab-elastic/1"


def ranking_dict(ad, units: Units, scores: torch.Tensor, fit: dict) -> dict:
    """The saved form: per block the KV-group and channel scores (6 significant digits),
    the unit shapes it applies to, and how it was fitted."""
    blocks = [{"heads": [float(f"{v:.6g}") for v in d["heads"].tolist()],
               "ffn": [float(f"{v:.6g}") for v in d["ffn"].tolist()]}
              for d in units.split(scores.float())]
    return {"format": FORMAT, "units": "kv-groups+ffn-channels", "family": ad.family,
            "heads_per_block": units.heads, "ffn_per_block": units.ffn, "blocks": blocks,
            "fit": fit}
