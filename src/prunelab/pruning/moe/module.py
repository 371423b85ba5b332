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

Two routed paths give the same output to float rounding. Many tokens (prefill) are
grouped by expert (:meth:`PrunePathMLP.routed`: each expert runs on its tokens, the results
are scatter-added), which skips FLOPs. At most :attr:`PrunePathMLP.FEW_TOKENS` tokens
(decode, where the FFN is bound by reading its weights) take :meth:`PrunePathMLP.gather`:
the selected experts are merged into runs of contiguous channels, and each run costs three
plain products over contiguous slices (``gate`` and ``up`` over the run's rows, ``down`` over
the same rows of its transpose, accumulated in place), so only the selected experts' weights
are read and no weight is copied. The transpose needs no copy either: ``down_proj.weight``
(``[hidden, ffn]``) is stored column-major, its transpose ``[ffn, hidden]`` contiguous
(:meth:`PrunePathMLP.down_rows` lays it out so in place, once, after the weights were
replaced, as a checkpoint load does). Same values, same parameter and key: checkpoints are
unchanged. One token's selection (:meth:`PrunePathMLP.select_one`) is computed in Python
from one copy of the router probabilities, the same choice as :meth:`PrunePathMLP.select`.

The module keeps the base MLP's parameter names (``gate_proj``, ``up_proj`` or
``gate_up_proj``, ``down_proj``) plus ``router``; ``mass`` is a runtime attribute, read
at construction in a checkpoint from ``config.prunelab_moe_mass`` (so
``from_pretrained(path, trust_remote_code=True, prunelab_moe_mass=0.7)`` sets it).
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.custom import PrunelabModule, register_module
from prunelab.registry import check_range

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
    #: at most this many tokens per call take the few-token (decode) path :meth:`few`
    FEW_TOKENS = 4

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
        self.down_rows()  # store down_proj.weight column-major from the start
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
        if tokens == 1 and per_expert is not None:  # decode: one routed token
            self.stat_tokens += 1
            self.stat_routed += 1
            counts = self.stat_expert_tokens
            for e, used in enumerate(per_expert):
                if used:
                    counts[e] += 1
            return
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

    def down_rows(self) -> torch.Tensor:
        """``down_proj.weight`` transposed, ``[ffn, hidden]`` and contiguous: a view of the
        parameter, whose storage is column-major. When it is not (new weights were put in
        the parameter's place, as a checkpoint load does), the parameter's data is laid out
        column-major in place first: same values, same parameter, no second copy kept."""
        w = self.down_proj.weight
        if w.stride() != (1, w.shape[0]) and not w.t().is_contiguous():
            with torch.inference_mode(False), torch.no_grad():
                w.data = w.detach().t().contiguous().t()
        return w.t()

    def gate_up(self) -> tuple:
        """``(gate, up, gate_bias, up_bias)``: the ``[ffn, hidden]`` weights (views of
        ``gate_up_proj`` when fused) and their biases (or ``None``)."""
        if self.fused:
            w, b = self.gate_up_proj.weight, self.gate_up_proj.bias
            f = self.ffn
            return (w[:f], w[f:], None if b is None else b[:f], None if b is None else b[f:])
        return (self.gate_proj.weight, self.up_proj.weight, self.gate_proj.bias,
                self.up_proj.bias)

    def channels(self, x: torch.Tensor, s: int, t: int, gate_up: tuple | None = None
                 ) -> torch.Tensor:
        """``act(gate(x)) * up(x)`` of the FFN channels ``[s, t)`` for tokens ``x``
        ``[n, hidden]``: one product per projection over those rows only (``gate_up``:
        :meth:`gate_up`, when the caller already has it)."""
        f = nn.functional
        g_w, u_w, g_b, u_b = self.gate_up() if gate_up is None else gate_up
        gate = f.linear(x, g_w[s:t], None if g_b is None else g_b[s:t])
        return self.activation(gate) * f.linear(x, u_w[s:t], None if u_b is None else u_b[s:t])

    def expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """Expert ``e``'s output for tokens ``x`` ``[n, hidden]`` (no down bias)."""
        s, t = self.starts[e], self.starts[e + 1]
        return self.channels(x, s, t) @ self.down_rows()[s:t]

    def runs(self, used: list) -> list:
        """The maximal runs ``(s, t)`` of contiguous channels that cover the experts whose
        entry in ``used`` (one per expert) is true, in channel order."""
        out: list = []
        for e, on in enumerate(used):
            if not on:
                continue
            s, t = self.starts[e], self.starts[e + 1]
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], t)
            else:
                out.append((s, t))
        return out

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """Routing probabilities ``[tokens, experts]`` (float32) for ``x`` ``[tokens, hidden]``."""
        logits = nn.functional.linear(x, self.router.weight, self.router.bias)
        if logits.dtype != torch.float32:
            logits = logits.float()
        return torch.softmax(logits, dim=-1)

    @staticmethod
    def select(probs: torch.Tensor, mass: float) -> torch.Tensor:
        """Boolean ``[tokens, experts]``: for each token the smallest set of experts, in
        decreasing probability, whose cumulative probability reaches ``mass`` (an expert is
        taken while the mass of those before it is below ``mass``; always at least one;
        every expert when ``mass >= 1``). Equal probabilities rank the lower index first;
        the sums are float64 (so :meth:`select_one` reproduces them exactly)."""
        if mass >= 1.0:
            return torch.ones_like(probs, dtype=torch.bool)
        ranked, order = probs.double().sort(dim=-1, descending=True, stable=True)
        before = ranked.cumsum(dim=-1) - ranked
        keep = before < mass
        keep[..., 0] = True
        return torch.zeros_like(keep).scatter(-1, order, keep)

    @staticmethod
    def select_one(probs: torch.Tensor, mass: float) -> list:
        """:meth:`select` of one token (``probs`` ``[1, experts]``) as a list of 0 / 1 per
        expert, computed in Python: the same stable ranking and the same float64 running
        sums, one tensor operation (decode runs this once per block and token)."""
        p = probs.tolist()[0]
        if mass >= 1.0:
            return [1] * len(p)
        flags = [0] * len(p)
        total = 0.0
        for i, e in enumerate(sorted(range(len(p)), key=p.__getitem__, reverse=True)):
            total += p[e]
            if i == 0 or total - p[e] < mass:
                flags[e] = 1
        return flags

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

    def few(self, h: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        """The output of :meth:`routed` (to float rounding) for a few tokens ``h``
        ``[tokens, hidden]`` (decode): :meth:`gather` over the runs of the experts any token
        selects, a token's channels outside its own experts weighing zero."""
        counts = sel.sum(dim=0).tolist()
        n = h.shape[0]
        self._count(n, counts)
        skip = None
        if any(0 < c < n for c in counts):  # an expert some of the tokens do not use
            experts = [e for e, c in enumerate(counts) if c > 0]
            sizes = torch.tensor([self.sizes[e] for e in experts], device=sel.device)
            skip = sel[:, experts].logical_not().repeat_interleave(sizes, dim=1)
        return self.gather(h, self.runs(counts), skip)

    def gather(self, h: torch.Tensor, runs: list, skip: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The FFN output of tokens ``h`` ``[tokens, hidden]`` over the channel ``runs``
        (``(s, t)`` pairs, in order) only: per run, three plain products over contiguous
        slices of the weights, ``gate`` and ``up`` over the run's rows and ``down`` over the
        same rows of its transpose (:meth:`down_rows`), accumulated into the output in place
        (``skip`` ``[tokens, selected channels]``: channels a token does not use, weighted
        zero). Nothing is copied or gathered: the weights read are the runs' only, each once,
        by the BLAS kernels a dense FFN uses."""
        f = nn.functional
        g_w, u_w, g_b, u_b = self.gate_up()
        down = self.down_rows()
        out = None
        offset = 0
        for s, t in runs:
            gate = f.linear(h, g_w[s:t], None if g_b is None else g_b[s:t])
            act = self.activation(gate)
            up = f.linear(h, u_w[s:t], None if u_b is None else u_b[s:t])
            act = act * up if torch.is_grad_enabled() else act.mul_(up)
            if skip is not None:
                act = act.masked_fill(skip[:, offset:offset + t - s], 0)
            offset += t - s
            if act.dtype != down.dtype:
                act = act.to(down.dtype)
            if out is None:
                out = act @ down[s:t]
            elif torch.is_grad_enabled():
                out = out.addmm(act, down[s:t])
            else:
                out.addmm_(act, down[s:t])
        if out is None:
            out = h.new_zeros(h.shape[0], self.hidden, dtype=down.dtype)
        if self.down_proj.bias is not None:
            out = out + self.down_proj.bias
        return out if out.dtype == h.dtype else out.to(h.dtype)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        n = h.shape[0]
        if self._mass >= 1.0 or n == 0:
            self._count(n, None)
            if 0 < n <= self.FEW_TOKENS:  # the dense FFN on the decode path's kernels
                return self.gather(h, [(0, self.ffn)]).reshape(shape)
            return self.dense(x)
        probs = self.route(h)
        if n == 1:
            flags = self.select_one(probs, self._mass)
            self._count(1, flags)
            return self.gather(h, self.runs(flags)).reshape(shape)
        sel = self.select(probs, self._mass)
        path = self.few if n <= self.FEW_TOKENS else self.routed
        return path(h, sel).reshape(shape)

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
