"""Second moments at module inputs for sensitivity-aware slicing: the output Fisher
``F = E[g g^T]`` and the activation covariance ``C = E[h h^T]`` (both float64, per token).

Fisher by sampling (the "empirical Fisher" uses the data's labels; the true Fisher, which is
the Hessian of the KL to the model, draws the labels from the model itself). For one
window, let ``s_t = d log p(y_t | x_<=t) / d h`` with ``y_t ~ p(. | x_<=t)`` drawn
independently at each position, the inputs ``x`` being the calibration tokens (teacher
forcing). The gradient of the summed log-likelihood at position ``u`` of the stream is
``g_u = sum_t s_{t,u}``; its outer product has cross terms ``s_{t,u} s_{t',u}^T``
(``t != t'``) whose expectation vanishes because ``y_t`` and ``y_t'`` are independent
given ``x`` and each score has mean zero (``E_y[d log p(y) / d h] = d/dh sum_y p(y) = 0``).
So ``E[g_u g_u^T] = sum_t E[s_{t,u} s_{t,u}^T]``: one backward pass of the summed loss
gives an unbiased estimate of the Fisher of every output the stream at ``u`` feeds, for
all positions and all modules at once. The sum over ``u`` keeps only the per-position
blocks of the Fisher (the blocks coupling two stream positions are dropped, a block-diagonal
approximation). Padding is not masked: these functions take plain calibration windows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from prunelab.errors import UnsupportedOperationError
from prunelab.log import progress


def _inputs_of(modules: Sequence[nn.Module], store: list):
    """Forward pre-hooks recording each module's first input (once per forward)."""
    def hook_for(i):
        def hook(_module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            if store[i] is not None:
                raise ValueError(f"module {i} ran twice in one forward; pass modules that "
                                 "read the stream once")
            store[i] = x
        return hook
    return [m.register_forward_pre_hook(hook_for(i), with_kwargs=True)
            for i, m in enumerate(modules)]


@contextlib.contextmanager
def _frozen_params(model: nn.Module):
    """Parameters without gradients (restored afterwards) and the model in eval mode."""
    states = [(p, p.requires_grad) for p in model.parameters()]
    training = model.training
    try:
        for p, _ in states:
            p.requires_grad_(False)
        model.eval()
        yield
    finally:
        for p, flag in states:
            p.requires_grad_(flag)
        model.train(training)


def _batches(input_ids: torch.Tensor, batch_size: int, desc: str):
    if input_ids.ndim != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [batch, seq] tensor, got "
                         f"{tuple(input_ids.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    starts = range(0, input_ids.shape[0], batch_size)
    for s in progress(starts, total=len(starts), desc=desc):
        yield input_ids[s:s + batch_size]


def _outer(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
    return (x.T @ x).cpu()


def activation_covariance(lm, input_ids: torch.Tensor, modules: Sequence[nn.Module], *,
                          batch_size: int) -> list[torch.Tensor]:
    """``C = (1/N) sum_tokens x x^T`` (float64, CPU) of each module's input, ``N`` the
    number of tokens, in the order of ``modules``."""
    model = lm.model
    device = next(model.parameters()).device
    sums = [None] * len(modules)
    with _frozen_params(model), torch.no_grad():
        for ids in _batches(input_ids, batch_size, "activation covariance"):
            seen = [None] * len(modules)
            handles = _inputs_of(modules, seen)
            try:
                model(input_ids=ids.to(device), use_cache=False)
            finally:
                for h in handles:
                    h.remove()
            for i, x in enumerate(_require_all(seen)):
                sums[i] = _outer(x) if sums[i] is None else sums[i].add_(_outer(x))
    return [s / input_ids.numel() for s in sums]


def _require_all(seen: list) -> list[torch.Tensor]:
    missing = [i for i, x in enumerate(seen) if x is None]
    if missing:
        raise ValueError(f"modules {missing} were not called in the forward pass")
    return seen


def output_fisher(lm, input_ids: torch.Tensor, modules: Sequence[nn.Module], *,
                  batch_size: int, samples: int = 1, seed: int = 0) -> list[torch.Tensor]:
    """``F = (1/(N S)) sum_tokens sum_draws g g^T`` (float64, CPU) at each module's input,
    ``g`` the gradient with respect to that input of ``sum_t log p(y_t | x_<=t)`` with
    ``y_t`` drawn from the model's own next-token distribution (``samples`` = ``S``
    independent draws per window, from a generator seeded with ``seed``), ``N`` the number
    of tokens. One forward and ``S`` backward passes per window serve every module
    (``batch_size`` is accepted for symmetry and not used: peak memory is one window's
    graph). Only the
    gradients with respect to the captured inputs are computed (``torch.autograd.grad``);
    parameters get none and their ``requires_grad`` flags are restored."""
    if lm.adapter.head() is None:
        raise UnsupportedOperationError(f"{lm.adapter.family}: the output Fisher needs the "
                                        "LM head; this model has none")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    model = lm.model
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    sums = [None] * len(modules)
    embed = lm.adapter.embeddings()
    with _frozen_params(model):
        # one window per backward: the graph, the logits and the sampling probabilities
        # of a single window are alive at a time, whatever batch_size is (the sums are
        # d x d per boundary: memory does not grow with the number of windows)
        for ids in _batches(input_ids, 1, "output Fisher"):
            for i, part in enumerate(_fisher_batch(model, embed, modules, ids.to(device),
                                                   samples, gen)):
                sums[i] = part if sums[i] is None else sums[i].add_(part)
    return [s / (input_ids.numel() * samples) for s in sums]


def _fisher_batch(model: nn.Module, embed: nn.Module, modules: Sequence[nn.Module],
                  ids: torch.Tensor, samples: int, gen: torch.Generator
                  ) -> list[torch.Tensor]:
    """``sum g g^T`` over this batch's tokens and ``samples`` draws, per module."""
    seen = [None] * len(modules)
    handles = _inputs_of(modules, seen)
    # the parameters are frozen: the graph starts at the embedding output
    handles.append(embed.register_forward_hook(lambda _m, _a, out: out.requires_grad_(True)))
    try:
        with torch.enable_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    inputs = _require_all(seen)
    if not all(x.requires_grad for x in inputs):
        raise UnsupportedOperationError("the output Fisher: a module's input does not "
                                        "depend on the embeddings")
    logp = torch.log_softmax(logits.float(), dim=-1)
    probs = logp.detach().exp().reshape(-1, logp.shape[-1]).cpu().double()
    draws = torch.multinomial(probs, samples, replacement=True, generator=gen)
    flat = logp.reshape(-1, logp.shape[-1])
    out = [torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64) for x in inputs]
    for s in range(samples):
        y = draws[:, s].to(flat.device)
        total = flat.gather(1, y[:, None]).sum()
        grads = torch.autograd.grad(total, inputs, retain_graph=s < samples - 1)
        for acc, g in zip(out, grads, strict=True):
            acc += _outer(g)
    return out
