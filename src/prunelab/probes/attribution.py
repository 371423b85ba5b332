"""Direct logit attribution (DLA) of blocks, sublayers and attention heads.

After Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits": the final
residual stream of a pre-norm decoder is a sum of the embedding ``h_0`` and of every block's
attention and MLP residual contributions, and an attention contribution is a sum over heads
(head ``h``'s slice of the ``o_proj`` input times ``o_proj``'s matching columns) plus the
``o_proj`` bias. The final norm is linearised at the observed scale: for the actual final
residual ``x`` at a position, ``norm(c) ~ g * P c / s(x)`` with ``s(x)`` the RMS (RMSNorm)
or standard deviation (LayerNorm, ``P`` subtracts the mean) of ``x`` including ``eps`` and
``g`` the norm's effective gain; the norm's bias and the LM head's bias are constant terms.
The contribution of a component ``c`` to the logit of the correct next token ``y`` is then
``c . u`` with ``u = P (g * W_U[y] / s(x))``, and the terms (embedding, heads, ``o_proj``
biases, MLPs, constants) sum exactly to the model's logit before any soft-capping.

Gemma 2 / 3 normalise the attention output before the residual add: that norm is
linearised the same way at the scale of the block's ``o_proj`` output. The MLP
contribution is the rest of the block's residual update, ``h_out - h_in - attention``
(parallel-residual blocks such as GPT-NeoX included). Post-norm models (OPT with
``do_layer_norm_before=False``) and encoders have no such decomposition and are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from prunelab.errors import UnsupportedOperationError
from prunelab.log import progress
from prunelab.models.linear import weight_out_in
from prunelab.probes.base import PROBES, ProbeResult, config_dict


@dataclass
class NormMap:
    """A norm as ``y = gain * P x / s(x) + bias`` (``P``: mean removal when ``centred``;
    ``s(x) = sqrt(mean((P x)^2) + eps)``); ``gain is None`` is the identity."""

    centred: bool
    gain: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """``s(x)`` per position, ``[..., 1]`` (float64; ones for the identity)."""
        x = x.double()
        if self.gain is None:
            return torch.ones_like(x[..., :1])
        if self.centred:
            x = x - x.mean(-1, keepdim=True)
        return (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def read(self, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``r = P (gain * u / s(x))`` for a read-out direction ``u`` applied after the norm:
        ``(norm(x) - bias) . u == sum_c c . r`` over any parts ``c`` summing to ``x``
        (the norm linearised at ``x``'s own scale)."""
        if self.gain is None:
            return u.double()
        r = u.double() * self.gain.to(u.device) / self.scale(x)
        return r - r.mean(-1, keepdim=True) if self.centred else r

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gain is None:
            return x.double()
        xc = x.double() - x.double().mean(-1, keepdim=True) if self.centred else x.double()
        y = self.gain.to(x.device) * xc / self.scale(x)
        return y + self.bias.to(x.device) if self.bias is not None else y


def norm_map(norm: nn.Module | None, width: int) -> NormMap:
    """The :class:`NormMap` of a LayerNorm or RMSNorm module (``None``: the identity). The
    effective RMSNorm gain (``w`` or ``1 + w``, Gemma) is read from the module's output on a
    constant vector; a module the map does not reproduce is refused."""
    if norm is None:
        return NormMap(False, None, None, 0.0)
    p = next(norm.parameters(), None)
    dev = p.device if p is not None else torch.device("cpu")
    if isinstance(norm, nn.LayerNorm):
        w, b = norm.weight, norm.bias
        gain = w.detach().double() if w is not None else torch.ones(width, dtype=torch.float64)
        nm = NormMap(True, gain, b.detach().double() if b is not None else None, norm.eps)
    else:
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if not isinstance(eps, (int, float)):
            raise UnsupportedOperationError(f"dla: {type(norm).__name__} is neither a "
                                            "LayerNorm nor an RMSNorm with an eps")
        with torch.no_grad():
            ones = torch.ones(1, width, device=dev, dtype=torch.float32)
            gain = norm(ones)[0].double() * math.sqrt(1.0 + float(eps))
        nm = NormMap(False, gain.cpu(), None, float(eps))
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        got = norm(probe).double().cpu()
    if not torch.allclose(nm(probe.cpu()), got, rtol=1e-4, atol=1e-5):
        raise UnsupportedOperationError(f"dla: cannot linearise {type(norm).__name__} "
                                        "(not a LayerNorm / RMSNorm)")
    nm.gain = nm.gain.cpu()
    return nm


def attention_post_norm(adapter, index: int) -> nn.Module | None:
    """The norm a block applies to its attention output before the residual add (Gemma 2
    / 3 ``post_attention_layernorm``: present exactly when the block post-normalises its
    MLP output too), or ``None``."""
    if not adapter.mlp_post_normed(index):
        return None
    return adapter.norms(index).get("post_attention_layernorm")


def check_dla_family(adapter) -> None:
    """Refuse models without a residual-sum decomposition or a next-token logit."""
    if adapter.is_encoder or adapter.head() is None:
        raise UnsupportedOperationError(f"{adapter.family}: dla needs a causal LM head")
    if getattr(adapter.config, "do_layer_norm_before", True) is False:
        raise UnsupportedOperationError(f"{adapter.family}: dla needs a pre-norm model "
                                        "(do_layer_norm_before=False is post-norm)")


def readout(adapter, final: NormMap, x: torch.Tensor, targets: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u [P, d], const [P])`` for final residuals ``x [P, d]`` and target ids ``[P]``: a
    component ``c`` contributes ``c . u`` to the target logit; ``const`` holds the final
    norm's and the LM head's bias terms."""
    head = adapter.head()
    wu = weight_out_in(head).detach()[targets.to(head.weight.device)].to(x.device).double()
    u = final.read(wu, x)
    const = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    if final.bias is not None:
        const += wu @ final.bias.to(x.device)
    b = getattr(head, "bias", None)
    if b is not None:
        const += b.detach()[targets.to(b.device)].to(x.device).double()
    return u, const


def attention_terms(u: torch.Tensor, o_in: torch.Tensor, o_proj: nn.Module, num_heads: int,
                    post: NormMap | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(heads [P, H], bias [P], attention vector [P, d])`` of one block at ``P``
    positions: each head's logit contribution, the ``o_proj`` bias term (and the post
    norm's bias), and the attention's residual contribution as a vector."""
    w = weight_out_in(o_proj).detach().to(u.device).double()
    b = getattr(o_proj, "bias", None)
    b = b.detach().to(u.device).double() if b is not None else None
    o_in = o_in.double()
    o_out = o_in @ w.t() + (b if b is not None else 0.0)
    read = post.read(u, o_out) if post is not None else u
    heads = (o_in * (read @ w)).view(o_in.shape[0], num_heads, -1).sum(-1)
    bias = (read @ b) if b is not None else torch.zeros_like(heads[:, 0])
    if post is not None and post.bias is not None:
        bias = bias + u @ post.bias.to(u.device)
    vec = post(o_out) if post is not None else o_out
    return heads, bias, vec


@PROBES.register("dla")
@dataclass(frozen=True)
class DLA:
    """Direct logit attribution (Elhage et al. 2021) of every block, sublayer and head.

    The contribution to the correct next token's logit (low = contributes little, or
    against it). No options: scores are means over every predicted position of every
    window."""

    def run(self, ctx) -> ProbeResult:
        ad = ctx.adapter
        check_dla_family(ad)
        n, d = ad.num_blocks, ad.hidden_size()
        final = norm_map(ad.final_norm(), d)
        posts = [attention_post_norm(ad, i) for i in range(n)]
        posts = [norm_map(p, d) if p is not None else None for p in posts]
        sums = _Sums(n, [ad.head_geometry(i).num_heads for i in range(n)])
        windows = [(b, r) for b, ids in enumerate(ctx.runner.batches) for r in range(len(ids))]

        def read(b: int, r: int):
            x = ctx.boundary(n)[b][r, :-1].to(ctx.runner.device)
            return x, *readout(ad, final, x, ctx.runner.batches[b][r, 1:])

        for b, r in windows:
            x, u, const = read(b, r)
            emb = (ctx.boundary(0)[b][r, :-1].to(u.device).double() * u).sum(-1)
            sums.totals[(b, r)] = emb + const
            sums.logits[(b, r)] = _true_logits(ad, x, ctx.runner.batches[b][r, 1:])
            sums.embedding += float(emb.sum())
            sums.constant += float(const.sum())
            sums.logit += float(sums.logits[(b, r)].sum())
            sums.count += u.shape[0]
        for i in progress(range(n), total=n, desc="dla"):
            _block_terms(ctx, i, posts[i], read, windows, sums)
        return _result(self, sums, n)


class _Sums:
    """Running sums of the DLA terms over positions, and every position's total."""

    def __init__(self, n: int, heads: list[int]):
        self.heads = [torch.zeros(h, dtype=torch.float64) for h in heads]
        self.abs_heads = [torch.zeros(h, dtype=torch.float64) for h in heads]
        self.attn_bias = torch.zeros(n, dtype=torch.float64)
        self.mlp = torch.zeros(n, dtype=torch.float64)
        self.embedding = self.constant = self.logit = 0.0
        self.count = 0
        self.totals: dict[tuple[int, int], torch.Tensor] = {}  # sum of terms per position
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # the model's logit


class _Inputs:
    """An accumulator that keeps what it is fed (one ``o_proj`` input per batch)."""

    def __init__(self, device):
        self.device, self.seen = device, []

    def update(self, x: torch.Tensor) -> None:
        self.seen.append(x.detach().to(self.device))


def o_inputs(ctx, index: int) -> list[torch.Tensor]:
    """The ``o_proj`` input of block ``index`` per batch (the block stops right after)."""
    o = ctx.adapter.attn_projections(index)["o"]
    keep = _Inputs(ctx.runner.store_device)
    ctx.runner.collect(index, ctx.boundary(index), {"o": o}, lambda _: keep)
    return keep.seen


def _block_terms(ctx, i: int, post: NormMap | None, read, windows, sums: _Sums) -> None:
    """Add block ``i``'s head, bias and MLP terms of every window to ``sums``."""
    o = ctx.adapter.attn_projections(i)["o"]
    heads_n = ctx.adapter.head_geometry(i).num_heads
    taps = o_inputs(ctx, i)
    for b, r in windows:
        _, u, _ = read(b, r)
        heads, bias, vec = attention_terms(u, taps[b][r, :-1].to(u.device), o, heads_n, post)
        h_in = ctx.boundary(i)[b][r, :-1].to(u.device).double()
        h_out = ctx.boundary(i + 1)[b][r, :-1].to(u.device).double()
        mlp = ((h_out - h_in - vec) * u).sum(-1)
        sums.heads[i] += heads.sum(0).cpu()
        sums.abs_heads[i] += heads.abs().sum(0).cpu()
        sums.attn_bias[i] += float(bias.sum())
        sums.mlp[i] += float(mlp.sum())
        sums.totals[(b, r)] += heads.sum(1) + bias + mlp


def _true_logits(adapter, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's logits of ``targets`` at final residuals ``x`` before soft-capping:
    the model's final norm, then the LM head's rows of the targets only (``[P]``)."""
    norm, head = adapter.final_norm(), adapter.head()
    with torch.no_grad():
        h = (norm(x) if norm is not None else x).double()
    t = targets.to(head.weight.device)
    logits = (weight_out_in(head).detach()[t].to(h.device).double() * h).sum(-1)
    b = getattr(head, "bias", None)
    return logits + b.detach()[t].to(h.device).double() if b is not None else logits


def _result(cfg: DLA, sums: _Sums, n: int) -> ProbeResult:
    c = max(sums.count, 1)
    scores = []
    for i in range(n):
        attn = (float(sums.heads[i].sum()) + float(sums.attn_bias[i])) / c
        scores.append({"layers": [i], "sublayer": "attention", "value": attn,
                       "bias": float(sums.attn_bias[i]) / c})
        scores.append({"layers": [i], "sublayer": "mlp", "value": float(sums.mlp[i]) / c})
        scores += [{"layers": [i], "head": h, "value": float(sums.heads[i][h]) / c,
                    "abs_value": float(sums.abs_heads[i][h]) / c}
                   for h in range(len(sums.heads[i]))]
    total = (sums.embedding + sums.constant + float(sum(s.sum() for s in sums.heads))
             + float(sums.attn_bias.sum()) + float(sums.mlp.sum())) / c
    err = max((float((sums.totals[k] - sums.logits[k]).abs().max()) for k in sums.totals),
              default=0.0)
    meta = {"embedding": sums.embedding / c, "constant": sums.constant / c,
            "logit": sums.logit / c, "sum_of_terms": total, "max_abs_error": err,
            "positions": sums.count,
            "value": "mean contribution to the correct next token's logit (before "
                     "soft-capping), final norm linearised at the observed scale"}
    return ProbeResult("dla", config_dict(cfg), scores, kind="head", num_blocks=n, meta=meta)
