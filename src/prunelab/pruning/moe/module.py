"""The PrunePath MLP: a gated FFN cut into contiguous experts, a linear softmax router and
a cumulative-mass selection, computing only the selected experts for each token.

The FFN ``y = W_d (act(W_g x) * (W_u x))`` with channels permuted so that expert ``e``
owns the contiguous channels ``[s_e, s_{e+1})`` is the sum of its experts
``y = sum_e W_d[:, s_e:s_{e+1}] (act(W_g[s_e:s_{e+1}] x) * (W_u[s_e:s_{e+1}] x))``
(MoEfication, Zhang et al. 2022, "MoEfication: Transformer Feed-forward Layers are
Mixtures of Experts", arXiv:2110.01786). The router gives ``r(x) = softmax(R x + b)``; a
token uses the smallest set of experts, taken in decreasing ``r``, whose mass reaches
``p`` (the cumulative-mass threshold of PrunePath, a seed method; the same top-p rule as
Huang et al. 2024, "Harder Tasks Need More Experts: Dynamic Routing in MoE Models",
arXiv:2403.07652), so the number of experts varies per token. ``p = 1`` computes the
dense FFN.

The module keeps the base MLP's parameter names (``gate_proj``, ``up_proj`` or
``gate_up_proj``, ``down_proj``) plus ``router``; ``mass`` is a runtime attribute, read
at construction in a checkpoint from ``config.prunelab_moe_mass`` (so
``from_pretrained(path, trust_remote_code=True, prunelab_moe_mass=0.7)`` sets it).
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab.models.custom import PrunelabModule, register_module

#: the model config attribute that holds the routing mass of a PrunePath checkpoint
MASS_ATTR = "prunelab_moe_mass"
KIND = "prunepath_mlp"


@register_module
class PrunePathMLP(PrunelabModule):
    """A gated FFN as ``len(sizes)`` contiguous experts with a cumulative-mass router.

    ``hidden``: model width; ``sizes``: channels per expert (in order); ``act``: ``silu``,
    ``gelu``, ``gelu_tanh`` or ``relu``; ``fused``: one ``gate_up_proj`` (rows
    ``[gate; up]``, Phi-3) instead of ``gate_proj`` and ``up_proj``; ``bias``: the
    projections carry biases. Running counters (``stat_tokens``, ``stat_routed``,
    ``stat_expert_tokens``) record the selections made since :meth:`reset_stats`.
    """

    prunelab_kind = "prunepath_mlp"
    MASS_ATTR = "prunelab_moe_mass"
    ACTS = ("silu", "gelu", "gelu_tanh", "relu")

    def __init__(self, hidden: int, sizes: list, act: str = "silu", fused: bool = False,
                 bias: bool = False):
        super().__init__()
        if act not in self.ACTS:
            raise ValueError(f"activation must be one of {', '.join(self.ACTS)}, got {act!r}")
        self.hidden, self.act, self.fused = int(hidden), act, bool(fused)
        self.sizes = [int(s) for s in sizes]
        self.ffn = sum(self.sizes)
        self.num_experts = len(self.sizes)
        self.starts = [sum(self.sizes[:e]) for e in range(self.num_experts + 1)]
        if self.fused:
            self.gate_up_proj = nn.Linear(self.hidden, 2 * self.ffn, bias=bias)
        else:
            self.gate_proj = nn.Linear(self.hidden, self.ffn, bias=bias)
            self.up_proj = nn.Linear(self.hidden, self.ffn, bias=bias)
        self.down_proj = nn.Linear(self.ffn, self.hidden, bias=bias)
        self.router = nn.Linear(self.hidden, self.num_experts, bias=True)
        self._mass = 1.0
        self.reset_stats()

    # ------------------------------------------------------------------ knobs and counters
    @property
    def mass(self) -> float:
        """Routing mass ``p`` in ``(0, 1]``; ``1`` computes the dense FFN."""
        return self._mass

    @mass.setter
    def mass(self, value: float) -> None:
        p = float(value)
        if not 0.0 < p <= 1.0:  # also rejects nan
            raise ValueError(f"mass must be in (0, 1], got {value!r}")
        self._mass = p

    def reset_stats(self) -> None:
        """Zero the running counters."""
        self.stat_tokens = 0
        self.stat_routed = 0
        self.stat_expert_tokens = [0] * self.num_experts

    def _count(self, tokens: int, per_expert: list | None) -> None:
        self.stat_tokens += tokens
        if per_expert is None:  # dense: every expert for every token, no router
            per_expert = [tokens] * self.num_experts
        else:
            self.stat_routed += tokens
        self.stat_expert_tokens = [a + b for a, b in
                                   zip(self.stat_expert_tokens, per_expert, strict=True)]

    def expert_flops(self) -> list:
        """Multiply-adds x 2 per token of each expert (three projections, biases as adds)."""
        b = 1 if self.down_proj.bias is not None else 0
        return [2 * (3 * self.hidden * s + 2 * s * b) for s in self.sizes]

    def dense_flops(self) -> int:
        """FLOPs per token of the dense FFN (every expert, the down bias, no router)."""
        return sum(self.expert_flops()) + (2 * self.hidden if self.down_proj.bias is not None
                                           else 0)

    def router_flops(self) -> int:
        return 2 * (self.hidden * self.num_experts + self.num_experts)

    def flops_per_token(self) -> int:
        """Mean FLOPs per token of the selections counted since :meth:`reset_stats` (router
        included when it ran); before any token, the dense FFN plus the router (an upper
        bound)."""
        ef = self.expert_flops()
        bias = 2 * self.hidden if self.down_proj.bias is not None else 0
        if self.stat_tokens == 0:
            return self.dense_flops() + self.router_flops()
        total = sum(n * f for n, f in zip(self.stat_expert_tokens, ef, strict=True))
        total += self.stat_routed * self.router_flops() + self.stat_tokens * bias
        return int(round(total / self.stat_tokens))

    # ------------------------------------------------------------------ maths
    def activation(self, x: torch.Tensor) -> torch.Tensor:
        f = nn.functional
        if self.act == "silu":
            return f.silu(x)
        if self.act == "gelu_tanh":
            return f.gelu(x, approximate="tanh")
        if self.act == "gelu":
            return f.gelu(x)
        return f.relu(x)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert: the base MLP's computation on the permuted channels."""
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(up * self.activation(gate))
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e``'s output for tokens ``x`` ``[n, hidden]`` (no down bias)."""
        f = nn.functional
        s, t = self.starts[e], self.starts[e + 1]
        if self.fused:
            w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
            g_w, u_w = w[s:t], w[self.ffn + s:self.ffn + t]
            g_b = None if b is None else b[s:t]
            u_b = None if b is None else b[self.ffn + s:self.ffn + t]
        else:
            g_w, u_w = self.gate_proj.weight[s:t], self.up_proj.weight[s:t]
            g_b = None if self.gate_proj.bias is None else self.gate_proj.bias[s:t]
            u_b = None if self.up_proj.bias is None else self.up_proj.bias[s:t]
        act = self.activation(f.linear(x, g_w, g_b)) * f.linear(x, u_w, u_b)
        return f.linear(act, self.down_proj.weight[:, s:t])

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Routing probabilities ``[tokens, experts]`` (float32) for ``x`` ``[tokens, hidden]``."""
        return torch.softmax(self.router(x).float(), dim=-1)

    @staticmethod
    def select(probs: torch.Tensor, mass: float) -> torch.Tensor:
        """Boolean ``[tokens, experts]``: for each token the smallest set of experts, in
        decreasing probability, whose cumulative probability reaches ``mass`` (an expert is
        taken while the mass of those before it is below ``mass``; always at least one;
        every expert when ``mass >= 1``)."""
        if mass >= 1.0:
            return torch.ones_like(probs, dtype=torch.bool)
        ranked, order = probs.sort(dim=-1, descending=True)
        before = ranked.cumsum(dim=-1) - ranked
        keep = before < mass
        keep[..., 0] = True
        return torch.zeros_like(keep).scatter(-1, order, keep)

    def routed(self, h: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """The FFN output of tokens ``h`` ``[tokens, hidden]`` using only the experts
        ``sel`` ``[tokens, experts]`` selects: tokens are grouped by expert, each group runs
        its expert's rows and columns, and the results are scatter-added."""
        counts = sel.sum(dim=0).tolist()
        self._count(h.shape[0], counts)
        out = torch.zeros_like(h)
        tokens = sel.t().nonzero()[:, 1]  # expert-major: the tokens of expert 0, 1, ...
        offset = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = tokens[offset:offset + n]
            offset += n
            out.index_add_(0, idx, self.expert(h.index_select(0, idx), e))
        if self.down_proj.bias is not None:
            out = out + self.down_proj.bias
        return out

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        if self._mass >= 1.0 or h.shape[0] == 0:
            self._count(h.shape[0], None)
            return self.dense(x)
        sel = self.select(self.route(h), self._mass)
        return self.routed(h, sel).reshape(shape)

    # ------------------------------------------------------------------ checkpoint
    def prunelab_spec(self) -> dict:
        return {"hidden": self.hidden, "sizes": list(self.sizes), "act": self.act,
                "fused": self.fused, "bias": self.down_proj.bias is not None}

    def prunelab_attach(self, owner: nn.Module, root: nn.Module) -> None:
        """Take the routing mass from the model config (``prunelab_moe_mass``) when set."""
        value = getattr(getattr(root, "config", None), self.MASS_ATTR, None)
        if value is not None:
            self.mass = value

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn={self.ffn}, experts={self.num_experts}, "
                f"act={self.act}, fused={self.fused}, mass={self._mass}")


def prunepath_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every PrunePath MLP in ``model`` (a :class:`LoadedModel` or an
    ``nn.Module``; modules rebuilt from a checkpoint's modeling file included)."""
    root = getattr(model, "model", model) if not isinstance(model, nn.Module) else model
    return [(n, m) for n, m in root.named_modules()
            if getattr(type(m), "prunelab_kind", None) == KIND]


def set_mass(model, mass: float) -> None:
    """Set the routing mass ``p`` in ``(0, 1]`` of every PrunePath MLP in ``model`` and in
    its config (so a saved checkpoint keeps it)."""
    from prunelab.errors import ConfigError, UnsupportedOperationError
    from prunelab.registry import check_range

    check_range("mass", mass, 0.0, 1.0)
    if mass <= 0:
        raise ConfigError(f"mass must be in (0, 1], got {mass!r}")
    found = prunepath_modules(model)
    if not found:
        raise UnsupportedOperationError("the model has no PrunePath experts (prune it with "
                                        "prunepath first)")
    for _, module in found:
        module.mass = float(mass)
    root = model if isinstance(model, nn.Module) else model.model
    setattr(root.config, MASS_ATTR, float(mass))


def reset_stats(model) -> None:
    """Zero the running selection counters of every PrunePath MLP in ``model``."""
    for _, module in prunepath_modules(model):
        module.reset_stats()


def routing_stats(model) -> dict:
    """What the PrunePath MLPs selected since the last :func:`reset_stats`:
    ``experts_per_token`` (mean over blocks of the mean experts a token used),
    ``ffn_flops_per_token`` (summed over blocks, router included),
    ``dense_ffn_flops_per_token`` (every expert, no router), ``ffn_flops_ratio`` (the two
    divided), ``tokens`` (tokens seen per block) and ``per_block`` rows."""
    rows = []
    for path, m in prunepath_modules(model):
        used = sum(m.stat_expert_tokens) / m.stat_tokens if m.stat_tokens else float("nan")
        dense = m.dense_flops()
        rows.append({"module": path, "experts": m.num_experts, "tokens": m.stat_tokens,
                     "experts_per_token": used, "ffn_flops_per_token": m.flops_per_token(),
                     "dense_ffn_flops_per_token": dense})
    if not rows:
        return {"experts_per_token": float("nan"), "ffn_flops_per_token": 0,
                "dense_ffn_flops_per_token": 0, "ffn_flops_ratio": float("nan"),
                "tokens": 0, "per_block": []}
    flops = sum(r["ffn_flops_per_token"] for r in rows)
    dense = sum(r["dense_ffn_flops_per_token"] for r in rows)
    return {"experts_per_token": sum(r["experts_per_token"] for r in rows) / len(rows),
            "ffn_flops_per_token": flops, "dense_ffn_flops_per_token": dense,
            "ffn_flops_ratio": flops / dense, "tokens": rows[0]["tokens"], "per_block": rows}
