"""Healing losses and the block boundaries the hidden-state loss matches.

* ``ce``: mean next-token cross-entropy.
* ``kd``: logit distillation (Hinton et al. 2015), ``T^2 mean_t KL(p_t^T || p_s^T)`` with
  ``p^T = softmax(z / T)`` of teacher ``t`` and student ``s`` (float32).
* ``hidden``: hidden-state MSE at matched boundaries (after the distillation losses of
  DistilBERT / MiniLM-style layer matching): the stream *entering* kept block ``j`` of the
  student is matched to the stream entering the dense block at its original position
  ``positions[j]`` (what depth recovery fits at every cut), plus the final-normed outputs;
  each boundary's MSE is divided by the teacher's mean square there, so boundaries with
  large residual norms do not dominate. The kept positions come from the depth-pruning
  records of the model's history or manifest (``removed_blocks`` of each ``prune-depth``
  operation, 0-based in the numbering of the model it was applied to).

Block inputs are captured with forward pre-hooks (and the last block's output with a
forward hook, after any bridge hook on it) registered here and always removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from prunelab.errors import ConfigError


def kept_positions(operations: Sequence[dict], num_blocks: int) -> list[int]:
    """Original 0-based position of each current block, from the ``prune-depth`` records
    in ``operations`` (a manifest's ``operations`` / a model's ``history``), applied in
    order; identity when there are none."""
    removed_lists = [op.get("removed_blocks") or [] for op in operations
                     if op.get("operation") == "prune-depth"]
    total = num_blocks + sum(len(r) for r in removed_lists)
    positions = list(range(total))
    for removed in removed_lists:
        drop = {int(i) for i in removed}
        if any(not 0 <= i < len(positions) for i in drop):
            raise ConfigError(f"the depth record removes blocks {sorted(drop)} of "
                              f"{len(positions)}: the manifest does not fit this model")
        positions = [p for i, p in enumerate(positions) if i not in drop]
    return positions


def _hidden_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextlib.contextmanager
def capture_boundaries(adapter, wanted: Sequence[int]) -> Iterator[dict]:
    """Within the context, every forward fills ``{j: input of block j}`` for ``j`` in
    ``wanted`` and ``{"last": raw output of the last block}``."""
    store: dict = {}
    handles = []
    blocks = adapter.blocks()
    try:
        for j in wanted:
            def pre(module, args, kwargs, _j=j):
                store[_j] = _hidden_arg(args, kwargs)
            handles.append(blocks[j].register_forward_pre_hook(pre, with_kwargs=True))

        def post(module, args, output):
            store["last"] = output[0] if isinstance(output, tuple) else output
        handles.append(blocks[len(blocks) - 1].register_forward_hook(post))
        yield store
    finally:
        for h in handles:
            h.remove()


def ce_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits [B, T, V]`` on ``ids [B, T]``."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                           ids[:, 1:].reshape(-1).to(logits.device))


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """``T^2 mean over positions of KL(softmax(z_t/T) || softmax(z_s/T))``."""
    t = float(temperature)
    logp_s = torch.log_softmax(student_logits.float() / t, dim=-1)
    logp_t = torch.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)
    return kl.mean() * t * t


def hidden_loss(student: dict, teacher: dict, pairs: Sequence[tuple[int, int]],
                student_norm, teacher_norm) -> torch.Tensor:
    """Mean over matched boundaries of ``||h_s - h_t||^2 / ||h_t||^2`` (element means);
    ``pairs``: ``(student block j, teacher block p)`` whose inputs are compared; the
    final-normed outputs are always compared."""
    terms = []
    for j, p in pairs:
        terms.append(_nmse(student[j], teacher[p]))
    s_last = student_norm(student["last"]) if student_norm is not None else student["last"]
    t_last = teacher_norm(teacher["last"]) if teacher_norm is not None else teacher["last"]
    terms.append(_nmse(s_last, t_last))
    return torch.stack(terms).mean()


def _nmse(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = t.detach().float()
    return (s.float() - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12)


def matched_pairs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """``(j, positions[j])`` for every student block whose input can differ from the
    dense model's (block 0 is left out when it is the original block 0: both read the
    same embeddings)."""
    return [(j, p) for j, p in enumerate(positions) if not (j == 0 and p == 0)]


def check_hidden(student_lm, teacher_lm, positions: Sequence[int]) -> None:
    """Refuse a hidden-state loss the two models cannot give."""
    if student_lm.adapter.hidden_size() != teacher_lm.adapter.hidden_size():
        raise ConfigError("loss hidden needs the student's and the teacher's hidden sizes "
                          "to agree")
    n_t = teacher_lm.adapter.num_blocks
    if positions and max(positions) >= n_t:
        raise ConfigError(f"the student's blocks map to original positions up to "
                          f"{max(positions)}, the teacher has {n_t} blocks: give the "
                          "student's manifest (or the right teacher)")
