"""Head probes that run the model: per-head ablation and an induction-head detector.

* ``head-ablation``: the divergence to dense of the model with one attention head ablated,
  for every query head of every block (Michel et al. 2019, "Are Sixteen Heads Really Better
  than One?", measured as the KL of next-token distributions). ``ablation="zero"`` zeroes
  the head's slice of the ``o_proj`` input (exactly the model without that head: the
  ``o_proj`` bias does not depend on its input); ``"mean"`` replaces the slice by its mean
  over every calibration position (mean ablation). Each run starts from the cached input
  of the head's block (one pass per head over the blocks from it on).
* ``induction``: on ``sequences`` seeded random sequences ``[r, r]`` (``r`` = ``length``
  distinct random token ids, a BOS token first when the config names one), each head's
  mean attention from a token of the second half to the token after that token's earlier
  occurrence (the induction score of Olsson et al. 2022, "In-context Learning and Induction
  Heads"; ``duplicate``: attention to the earlier occurrence itself). The ``top_k`` heads
  are then ablated together (zeroed) on the same sequences, and so are ``top_k`` random
  other heads as a baseline: KL to dense and next-token accuracy on the repeated half.

Attention weights come from the model's own eager attention (``output_attentions``; a model
loaded with SDPA or another kernel is switched to eager for the call and back). Scores are
per query head (GQA: query head ``h`` reads KV head ``h // (heads / kv_heads)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from prunelab.calib.ablation import Ablator, Unit
from prunelab.calib.stats import MeanVar
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.divergence import kl_from_logits_float64
from prunelab.log import progress
from prunelab.models.linear import weight_out_in
from prunelab.probes.base import PROBES, ProbeResult, check_range, config_dict

ABLATIONS = ("zero", "mean")


def head_columns(head: int, head_dim: int) -> torch.Tensor:
    """``o_proj`` input columns of query head ``head``: ``[head hd, (head + 1) hd)``."""
    return torch.arange(head * head_dim, (head + 1) * head_dim)


@contextlib.contextmanager
def ablated_head(o_proj: nn.Module, cols: torch.Tensor, mean: torch.Tensor | None = None):
    """Within the context ``o_proj`` reads its input columns ``cols`` as zero (``mean``
    ``None``) or as the constant ``mean`` (``[len(cols)]``: folded into the bias, a
    temporary bias where the layer has none). Weights and bias are restored on exit."""
    bias = getattr(o_proj, "bias", None)
    old_w = weight_out_in(o_proj)[:, cols].clone()
    old_b = bias.detach().clone() if bias is not None else None
    added = False
    try:
        with torch.no_grad():
            w = weight_out_in(o_proj)
            if mean is not None:
                shift = old_w.double() @ mean.double().to(old_w.device)
                if bias is None:
                    o_proj.bias = nn.Parameter(shift.to(w.dtype), requires_grad=False)
                    added = True
                else:
                    bias.add_(shift.to(bias.dtype))
            w[:, cols] = 0
        yield
    finally:
        with torch.no_grad():
            w = weight_out_in(o_proj)  # fetched anew: offloading replaces the storage
            w[:, cols] = old_w.to(w.device)
            if added:
                o_proj.bias = None
            elif old_b is not None:
                o_proj.bias.copy_(old_b.to(o_proj.bias.device))


def head_input_mean(ctx, index: int) -> torch.Tensor:
    """Mean of block ``index``'s ``o_proj`` input over every calibration position
    (float64 ``[heads x head_dim]``; the block stops right after ``o_proj`` fires)."""
    o = ctx.adapter.attn_projections(index)["o"]
    return ctx.runner.collect(index, ctx.boundary(index), {"o": o},
                              lambda _: MeanVar())["o"][0].mean()


# ---------------------------------------------------------------- head-ablation
@PROBES.register("head-ablation", resumable=True)
@dataclass(frozen=True)
class HeadAblation:
    """Divergence to dense with one attention head zeroed or mean-ablated, per head.

    ``ablation``: ``zero`` (the head removed) or ``mean`` (its output replaced by its mean
    over the calibration positions)."""

    ablation: str = field(default="zero", metadata={"help": (
        "zero (the head removed) or mean (the head's mean output)")})

    def __post_init__(self):
        if self.ablation not in ABLATIONS:
            raise ConfigError(f"ablation must be one of {', '.join(ABLATIONS)}, "
                              f"got {self.ablation!r}")

    def run(self, ctx, resume=None, on_progress=None) -> ProbeResult:
        ad, n = ctx.adapter, ctx.num_blocks
        scores = list((resume or {}).get("scores", []))
        done = {(s["layers"][0], s["head"]) for s in scores}
        todo = [(i, h) for i in range(n) for h in range(ad.head_geometry(i).num_heads)
                if (i, h) not in done]
        means: dict[int, torch.Tensor] = {}
        for i, h in progress(todo, total=len(todo), desc="head-ablation"):
            geo = ad.head_geometry(i)
            cols = head_columns(h, geo.head_dim)
            mean = None
            if self.ablation == "mean":
                if i not in means:
                    means = {i: head_input_mean(ctx, i)}
                mean = means[i][cols]
            with ablated_head(ad.attn_projections(i)["o"], cols, mean):
                hidden = ctx.run_stack(i, [i])
            last, allpos = ctx.divergence(ctx.run_stack(i + 1, range(i + 1, n), hidden=hidden))
            scores.append({"layers": [i], "head": h, "kv_head": h // geo.group_size,
                           "value": allpos, "value_last_position": last})
            if on_progress is not None:
                on_progress(scores)
        scores.sort(key=lambda s: (s["layers"], s["head"]))
        return ProbeResult("head-ablation", config_dict(self), scores, kind="head", num_blocks=n,
                           meta={"value": f"{ctx.divergence_name}, mean over all positions "
                                          f"({self.ablation} ablation); value_last_position: "
                                          "at the last position of each window"})


# ---------------------------------------------------------------- attention weights
@contextlib.contextmanager
def eager_attention(model: nn.Module):
    """Within the context ``model`` computes attention with the eager kernel (which returns
    attention weights); its previous implementation is restored on exit."""
    prev = getattr(model.config, "_attn_implementation", None)
    if prev in (None, "eager"):
        yield
        return
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:  # pragma: no cover - transformers < 5 lacks the setter
        raise UnsupportedOperationError(f"cannot switch {prev} attention to eager")
    setter("eager")
    try:
        yield
    finally:
        setter(prev)


@torch.no_grad()
def attention_weights(lm, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Attention probabilities of every block, ``[batch, heads, T, T]`` float32 on the CPU
    (row = query position, column = key position), from the model's eager attention."""
    model, ad = lm.model, lm.adapter
    device = next(model.parameters()).device
    with eager_attention(model):
        out = ad.base(input_ids=torch.as_tensor(input_ids).to(device), use_cache=False,
                      output_attentions=True)
    att = getattr(out, "attentions", None)
    if att is None or len(att) != ad.num_blocks or any(a is None for a in att):
        raise UnsupportedOperationError(f"{ad.family}: the model returns no attention "
                                        "weights")
    return [a.float().cpu() for a in att]


# ---------------------------------------------------------------- induction
def repeated_sequences(vocab: int, length: int, samples: int, seed: int,
                       bos: int | None = None) -> torch.Tensor:
    """``[samples, 2 length (+1)]`` sequences ``[bos,] r, r``: ``r`` holds ``length``
    distinct random ids of ``[0, vocab)`` (with repeats only when ``length > vocab``)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples):
        r = (torch.randperm(vocab, generator=g)[:length] if length <= vocab
             else torch.randint(0, vocab, (length,), generator=g))
        parts = ([torch.tensor([bos])] if bos is not None else []) + [r, r]
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def induction_scores(attn: torch.Tensor, length: int, offset: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, from attention ``[B, H, T, T]`` on sequences ``[prefix of offset, r, r]``:
    the mean attention of second-half position ``t`` to ``t - length + 1`` (the token after
    the earlier occurrence: induction) and to ``t - length`` (the occurrence: duplicate).
    Returns two ``[H]`` float64 tensors."""
    q = torch.arange(offset + length, offset + 2 * length)
    ind = attn[:, :, q, q - length + 1].double().mean((0, 2))
    dup = attn[:, :, q, q - length].double().mean((0, 2))
    return ind, dup


def repeat_positions(length: int, offset: int = 0) -> torch.Tensor:
    """Positions whose next token repeats the first half: ``[offset + length,
    offset + 2 length - 1)``."""
    return torch.arange(offset + length, offset + 2 * length - 1)


def ablation_effect(lm, ids: torch.Tensor, groups: dict[str, list[tuple[int, int]]],
                    positions: torch.Tensor, batch_size: int) -> dict[str, dict]:
    """For each named list of ``(block, head)``: the mean ``KL(p_dense || p_ablated)`` at
    ``positions`` with those heads zeroed together, and the next-token accuracy there
    (dense and ablated). One dense block-by-block pass, then one per group."""
    ad = lm.adapter
    targets = ids[:, positions + 1]

    def accuracy(logits):
        pred = torch.cat([lg[:, positions].argmax(-1).cpu() for lg in logits])
        return float((pred == targets).double().mean())

    out = {}
    with Ablator(lm, ids, batch_size, desc="induction: dense pass") as ab:
        dense = ab.logits()
        acc_dense = accuracy(dense)
        for name, heads in groups.items():
            units = [Unit(i, ad.attn_projections(i)["o"],
                          head_columns(h, ad.head_geometry(i).head_dim)) for i, h in heads]
            got = ab.masked_logits(units) if units else dense
            kl = torch.cat([kl_from_logits_float64(p[:, positions], q[:, positions]).cpu()
                            .reshape(-1) for p, q in zip(dense, got, strict=True)])
            out[name] = {"heads": [list(x) for x in heads], "kl": float(kl.mean()),
                         "accuracy_dense": acc_dense, "accuracy_ablated": accuracy(got)}
    return out


@PROBES.register("induction", forward=False)
@dataclass(frozen=True)
class Induction:
    """Induction-head detector on repeated random tokens (Olsson et al. 2022).

    Also measures the effect of ablating the top heads. ``length``: random tokens per
    half; ``sequences``: how many; ``top_k``: heads ablated together (and as many random
    other heads as a baseline); ``seed``: the sequences and the baseline heads."""

    length: int = field(default=32, metadata={"flag": "--induction-length", "help": (
        "random tokens per half of a repeated sequence")})
    sequences: int = field(default=8, metadata={"flag": "--induction-sequences", "help": (
        "repeated random sequences")})
    top_k: int = field(default=4, metadata={"help": "top heads ablated"})
    seed: int = field(default=0, metadata={"help": "the sequences and the baseline heads"})

    def __post_init__(self):
        check_range("length", self.length, 2, None, integer=True)
        check_range("sequences", self.sequences, 1, None, integer=True)
        check_range("top_k", self.top_k, 0, None, integer=True)
        check_range("seed", self.seed, 0, None, integer=True)

    def run(self, ctx) -> ProbeResult:
        ad = ctx.adapter
        if ad.is_encoder or ad.head() is None:
            raise UnsupportedOperationError(f"{ad.family}: induction needs a causal LM head")
        vocab = int(ad.config.vocab_size)
        bos = _bos(ad.config, vocab)
        offset = int(bos is not None)
        limit = getattr(ad.config, "max_position_embeddings", None)
        if isinstance(limit, int) and 2 * self.length + offset > limit:
            raise ConfigError(f"induction: 2 x length {self.length} exceeds the model's "
                              f"{limit} positions")
        ids = repeated_sequences(vocab, self.length, self.sequences, self.seed, bos)
        batch = max(ctx.runner.batches[0].shape[0], 1) if ctx.runner.batches else 8
        n = ad.num_blocks
        sums = [torch.zeros(ad.head_geometry(i).num_heads, 2, dtype=torch.float64)
                for i in range(n)]
        for part in progress(ids.split(batch), desc="induction: attention"):
            for i, a in enumerate(attention_weights(ctx.lm, part)):
                ind, dup = induction_scores(a, self.length, offset)
                sums[i] += torch.stack([ind, dup], 1) * part.shape[0]
        scores = [{"layers": [i], "head": h, "value": float(sums[i][h, 0]) / self.sequences,
                   "duplicate": float(sums[i][h, 1]) / self.sequences}
                  for i in range(n) for h in range(sums[i].shape[0])]
        ranked = sorted(scores, key=lambda s: (-s["value"], s["layers"][0], s["head"]))
        top = [(s["layers"][0], s["head"]) for s in ranked[:self.top_k]]
        others = [(s["layers"][0], s["head"]) for s in ranked[self.top_k:]]
        g = torch.Generator().manual_seed(self.seed + 1)
        pick = torch.randperm(len(others), generator=g)[:self.top_k].tolist()
        effect = ablation_effect(ctx.lm, ids,
                                 {"top": top, "random": sorted(others[k] for k in pick)},
                                 repeat_positions(self.length, offset), batch)
        meta = {"top_heads": [dict(s) for s in ranked[:self.top_k]], "ablation": effect,
                "sequences": {"length": self.length, "count": self.sequences, "seed": self.seed,
                              "bos": bos},
                "value": "mean attention from a second-half token to the token after its "
                         "earlier occurrence (induction score)"}
        return ProbeResult("induction", config_dict(self), scores, kind="head", num_blocks=n,
                           meta=meta)


def _bos(cfg, vocab: int) -> int | None:
    bos = getattr(cfg, "bos_token_id", None)
    return bos if isinstance(bos, int) and 0 <= bos < vocab else None
