"""Choosing the sensitivity-aware slicing basis by the measured calibration KL.

The spectral bound behind :func:`~prunelab.pruning.factor.subspace.sensitivity_basis`
(``J(P) = 1/2 tr((I - P) F (I - P) C)``) is a second-order, per-boundary proxy: it treats
the boundaries as independent and a slice as a small perturbation. At the slice depths a
parameter budget asks for (a third of SmolLM2's hidden size at 0.8 of the parameters) it
ranks bases poorly: a Fisher-weighted basis that wins on the proxy at every boundary can
lose to plain PCA in the KL the whole sliced model actually has on the calibration windows.

So the basis is chosen from a one-parameter family by the quantity it is meant to lower.
With the damped Fisher ``F_mu = F + mu * mean(diag F) * I`` the proxy becomes
``J_mu(P) = J(P) + (mu mean(diag F) / 2) tr((I - P) C)``: ``mu = 0`` is the pure
sensitivity objective, ``mu -> inf`` is PCA's (up to scale), so ``mu`` blends the two.
Each candidate (PCA and every ``mu`` of ``select_grid``) slices a copy of the model with
the same Fisher estimate (computed once, on the dense model) and is scored by the mean
per-token ``KL(p_dense || p_sliced)`` on the first ``select_windows`` calibration windows;
the best one is then applied to the model. PCA is a candidate, so the chosen basis' KL on
those windows is never above PCA's. Cost: one Fisher pass, ``len(grid) + 2`` slicing runs
and ``len(grid) + 1`` KL passes over the selection windows.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

from prunelab.eval.divergence import kl_from_logits
from prunelab.log import info


def parse_grid(text: str) -> list[float]:
    """``"0.01,0.3"`` -> ``[0.01, 0.3]`` (empty entries skipped)."""
    return [float(x) for x in str(text).split(",") if x.strip()]


@torch.no_grad()
def mean_kl(reference, model, input_ids: torch.Tensor, *, batch_size: int) -> float:
    """Mean per-token ``KL(p_reference || p_model)`` (nats) over ``input_ids``
    (``[N, T]``, every position), computed ``batch_size`` windows at a time."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for s in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[s:s + batch_size].to(device)
        ref = reference(input_ids=ids, use_cache=False).logits
        out = model(input_ids=ids, use_cache=False).logits
        kl = kl_from_logits(ref, out)
        total += float(kl.double().sum())
        count += kl.numel()
    return total / max(count, 1)


def select_basis(lm, cfg, input_ids: torch.Tensor, *, batch_size: int, slicer: Callable,
                 fishers: list) -> dict:
    """Slice ``lm`` in place with the candidate basis (PCA or the Fisher-weighted one at a
    damping of ``cfg.select_grid``) whose sliced copy has the lowest calibration KL; the
    slicing report plus ``selection`` (every candidate's KL) and ``fisher_damping_used``.
    ``slicer``: the slicing run (:func:`~prunelab.pruning.factor.slicing.slice_stream`);
    ``fishers``: the boundaries' output Fisher matrices, measured once on the dense model."""
    windows = input_ids[:cfg.select_windows] if cfg.select_windows else input_ids
    kl_batch = max(1, min(batch_size, 2))
    candidates = [("pca", None)] + [("sensitivity", mu) for mu in parse_grid(cfg.select_grid)]
    scores = []
    preset = None  # per-block widths are allocated once, from the dense model
    for basis, mu in candidates:
        trial = _variant(cfg, basis, mu)
        sliced = copy.deepcopy(lm)
        rep = slicer(sliced, trial, input_ids, batch_size=batch_size,
                           fishers=fishers if basis == "sensitivity" else None, preset=preset)
        preset = preset or rep
        kl = mean_kl(lm.model, sliced.model, windows, batch_size=kl_batch)
        del sliced
        scores.append({"basis": basis, "fisher_damping": mu, "calib_kl": kl})
        info(f"slicegpt select: {basis} (damping {mu}) calibration KL {kl:.4f}")
    best = min(range(len(scores)), key=lambda i: (scores[i]["calib_kl"], i))
    basis, mu = candidates[best]
    report = slicer(lm, _variant(cfg, basis, mu), input_ids, batch_size=batch_size,
                          fishers=fishers if basis == "sensitivity" else None, preset=preset)
    report.update(basis=cfg.basis, basis_used=basis, fisher_damping_used=mu,
                  selection=scores, select_windows=int(windows.shape[0]))
    return report


def _variant(cfg, basis: str, mu: float | None):
    """``cfg`` with one basis and damping, and selection off (so it slices directly)."""
    return dataclasses.replace(cfg, basis=basis, select="proxy",
                               fisher_damping=cfg.fisher_damping if mu is None else mu)
