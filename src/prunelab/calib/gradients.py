"""Curvature from gradients: the Taylor (Fisher) term of MOONSHOT-style Hessians.

For each requested linear, ``T = sum_t ||g_t||^2 x_t x_t^T`` (float64, ``[d_in, d_in]``),
``x_t`` the layer's input at token ``t`` and ``g_t`` the gradient of the calibration loss
(summed next-token NLL, :func:`prunelab.eval.divergence.nll_sum`) with respect to the
layer's output at ``t``.

The pass goes through the block runner, so ``offload`` holds (weights stay on the CPU;
each block, and the final norm and head, visit the device only for their turn): a dense
forward keeps the hidden state at every block boundary (no autograd graph); the loss
gradient at the last boundary comes from the final norm and the head; then the blocks run
backwards one at a time, each recomputed from its stored input with autograd on, and
``torch.autograd.grad`` carries the gradient to the block's input while tensor hooks on
the requested linears' outputs accumulate the terms. The model's parameters get no
gradients; hooks are registered here and always removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from prunelab.calib.runner import BlockRunner, StateStore
from prunelab.errors import UnsupportedOperationError
from prunelab.eval.divergence import nll_sum
from prunelab.log import progress


def taylor_terms(lm, input_ids: torch.Tensor, modules: dict[str, nn.Module],
                 batch_size: int = 4, store: str = "memory", accumulate=None
                 ) -> dict[str, torch.Tensor]:
    """``{name: X^T diag(||g||^2) X}`` (float64, on the CPU) for every linear in
    ``modules`` (each inside a block of ``lm``). ``store``: where the boundary hidden
    states wait for the backward sweep (``"memory"`` or ``"disk"``, see
    :class:`StateStore`). ``accumulate(terms, name, x, g)``: another statistic of each
    linear's inputs ``x`` and output gradients ``g`` (default: the Taylor term)."""
    ad = lm.adapter
    if ad.head() is None:
        raise UnsupportedOperationError(f"{ad.family}: Taylor terms need the LM loss; this "
                                        "model has no LM head")
    owner = _owners(ad, modules)
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    terms: dict[str, torch.Tensor] = {}
    if not modules:
        return terms
    lowest = min(owner.values())
    with StateStore(store) as states:
        runner.run(states=states, desc="gradients: forward")
        grads = _loss_grads(runner, states.get(ad.num_blocks))
        for i in progress(range(ad.num_blocks - 1, lowest - 1, -1),
                          total=ad.num_blocks - lowest, desc="gradients: backward"):
            targets = {n: m for n, m in modules.items() if owner[n] == i}
            grads = _block_backward(runner, i, states.get(i), grads, targets, terms,
                                    input_grads=i > lowest,
                                    accumulate=accumulate or _accumulate)
    return {n: terms[n] for n in modules}


def _owners(ad, modules: dict[str, nn.Module]) -> dict[str, int]:
    """``{name: index of the block holding the module}``."""
    where = {id(m): i for i in range(ad.num_blocks) for m in ad.block(i).modules()}
    missing = [n for n, m in modules.items() if id(m) not in where]
    if missing:
        raise ValueError(f"taylor_terms: {', '.join(missing)} not inside a block")
    return {n: where[id(m)] for n, m in modules.items()}


def _loss_grads(runner: BlockRunner, hidden: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Gradient of each batch's summed NLL with respect to the last block's output."""
    ad = runner.adapter
    norm = ad.final_norm()
    grads = []
    with runner._on_device(ad.head()), _maybe_on_device(runner, norm), torch.enable_grad():
        for ids, h in zip(runner.batches, hidden, strict=True):
            h = h.to(runner.device).detach().requires_grad_(True)
            logits = ad.logits(norm(h) if norm is not None else h)
            (g,) = torch.autograd.grad(nll_sum(logits, ids), h)
            grads.append(g.to(runner.store_device))
    return grads


def _maybe_on_device(runner: BlockRunner, module: nn.Module | None):
    return contextlib.nullcontext() if module is None else runner._on_device(module)


def _block_backward(runner: BlockRunner, index: int, hidden: Sequence[torch.Tensor],
                    grads_out: Sequence[torch.Tensor], targets: dict[str, nn.Module],
                    terms: dict[str, torch.Tensor], input_grads: bool = True,
                    accumulate=None) -> list[torch.Tensor]:
    """Recompute block ``index`` on every batch with autograd, pull ``grads_out`` (the
    loss gradient at its output) back to its input, and add each target linear's term to
    ``terms``. Returns the gradients at the block's input (``[]`` without
    ``input_grads``)."""
    accumulate = accumulate or _accumulate

    def hook_for(name):
        def hook(_module, inputs, output):
            x = inputs[0].detach()
            output.register_hook(lambda g: accumulate(terms, name, x, g))
        return hook

    blk = runner.adapter.block(index)
    handles = [m.register_forward_hook(hook_for(n)) for n, m in targets.items()]
    grads_in = []
    try:
        with runner._on_device(blk), torch.enable_grad():
            for b, (h, g_out) in enumerate(zip(hidden, grads_out, strict=True)):
                h = h.to(runner.device).detach().requires_grad_(True)
                args, kwargs = runner.call_args(index, b)
                runner.block_evals += 1
                out = blk(h, *args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                (g_in,) = torch.autograd.grad(out, h, grad_outputs=g_out.to(runner.device))
                if input_grads:
                    grads_in.append(g_in.to(runner.store_device))
    finally:
        for handle in handles:
            handle.remove()
    return grads_in


def _accumulate(terms: dict[str, torch.Tensor], name: str, x: torch.Tensor,
                g: torch.Tensor) -> None:
    """``terms[name] += X^T diag(||g_t||^2) X`` over the tokens of one batch (float64)."""
    x = x.reshape(-1, x.shape[-1]).double()
    g = g.reshape(-1, g.shape[-1]).double()
    w = g.pow(2).sum(-1, keepdim=True)
    t = ((x * w).t() @ x).cpu()
    terms[name] = t if name not in terms else terms[name] + t
