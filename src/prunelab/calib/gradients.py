"""Curvature from gradients: the Taylor (Fisher) term of MOONSHOT-style Hessians.

For each requested linear, ``T = sum_t ||g_t||^2 x_t x_t^T`` (float64, ``[d_in, d_in]``),
``x_t`` the layer's input at token ``t`` and ``g_t`` the gradient of the calibration loss
(summed next-token NLL) with respect to the layer's output at ``t``. One forward and
backward pass of the whole (dense) model per batch; the model's parameters get no
gradients; hooks are registered here and always removed.
"""

from __future__ import annotations

import torch

from prunelab.log import progress


def taylor_terms(lm, input_ids: torch.Tensor, modules: dict[str, torch.nn.Module],
                 batch_size: int = 4) -> dict[str, torch.Tensor]:
    """``{name: X^T diag(||g||^2) X}`` for every module in ``modules``."""
    saved: dict[str, torch.Tensor] = {}
    terms: dict[str, torch.Tensor] = {}

    def fwd(name):
        def hook(_m, inputs, _out):
            saved[name] = inputs[0].detach()
        return hook

    def bwd(name):
        def hook(_m, _grad_in, grad_out):
            x = saved.pop(name)
            x = x.reshape(-1, x.shape[-1]).double()
            g = grad_out[0].reshape(-1, grad_out[0].shape[-1]).double()
            w = g.pow(2).sum(-1, keepdim=True)
            t = (x * w).t() @ x
            terms[name] = t.cpu() if name not in terms else terms[name] + t.cpu()
        return hook

    def embed_hook(_m, _inputs, out):
        return out.detach().requires_grad_(True)

    handles = [lm.adapter.embeddings().register_forward_hook(embed_hook)]
    for name, m in modules.items():
        handles.append(m.register_forward_hook(fwd(name)))
        handles.append(m.register_full_backward_hook(bwd(name)))
    try:
        with torch.enable_grad():
            for ids in progress(list(input_ids.split(batch_size)), desc="gradients"):
                ids = ids.to(lm.device)
                logits = lm.model(input_ids=ids, use_cache=False).logits
                logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
                loss = -logp.gather(-1, ids[:, 1:, None]).sum()
                loss.backward()
    finally:
        for h in handles:
            h.remove()
        saved.clear()
    return terms
