"""REP-LIE: importance of structural units from the LoRA matrices while fine-tuning.

Derivation (first-order Taylor, LeCun et al. 1990 / Molchanov et al. 2019, applied to the
merged LoRA weight of Hu et al. 2022). A LoRA linear acts with ``W' = W + s B A``
(``W [d_out, d_in]``, ``A [r, d_in]``, ``B [d_out, r]``, ``s = alpha / r``). With
``G = dL/dW'`` (never formed: ``W`` is frozen), the chain rule gives the LoRA gradients

    dL/dA = s B^T G,        dL/dB = s G A^T.

They determine exactly the projection of ``G`` onto the tangent space
``T = {B X + Y A}`` of the rank-``r`` factorisation at ``(B, A)``:

    P_T(G) = P_B G + G P_A - P_B G P_A,
    P_B = B (B^T B)^+ B^T,   P_A = A^T (A A^T)^+ A,

where ``P_B G = B (B^T B)^+ (dL/dA) / s``, ``G P_A = (dL/dB) (A A^T)^+ A / s`` and
``P_B G P_A = B (B^T B)^+ (dL/dA) A^T (A A^T)^+ A / s``. The estimator is

    G_hat = P_T(G)          (the approximation: G ~ P_T(G); the component of G
                             orthogonal to T, which LoRA cannot see, is dropped)

It is exact when ``G`` lies in ``T`` (e.g. ``rank A = d_in``, so ``P_A = I``); at the
usual initialisation ``B = 0`` it is ``G P_A``. The first-order change of the loss when a
unit ``u`` (a set of weights) is removed is ``-sum_{(i,j) in u} G_ij W'_ij``; REP-LIE's
importance of ``u`` at one step is

    I_u = | sum_{(i,j) in u} G_hat_ij W'_ij |,

summed over every linear the unit owns (an FFN channel: its rows of gate and up and its
column of down; a KV group: its rows of q, k, v and columns of o; a query head: its rows
of q and columns of o); per weight, ``|G_hat_ij W'_ij|``.

Stability: importance is noisy across steps. :class:`RepLieTracker` keeps the running
mean of ``I_u`` and, since the last prune event, every step's vector; a unit is *stably
unimportant* for an event removing ``k`` units of its block when it was among the ``k``
lowest of its block in at least ``stability`` of those steps. An event removes, per block,
stable units first (lowest running mean first), then others by running mean (counted as
``unstable_taken``). ``rank_stability`` is the mean Spearman correlation of consecutive
steps' importance vectors.
"""

from __future__ import annotations

import torch

from prunelab.linalg import spearman
from prunelab.models.linear import weight_out_in
from prunelab.pruning.width import scores as S
from prunelab.train.config import HealConfig
from prunelab.train.loop import heal
from prunelab.train.lora import lora_factors


def lora_gradient_estimate(a: torch.Tensor, b: torch.Tensor, grad_a: torch.Tensor,
                           grad_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``G_hat = P_T(G)`` (``[d_out, d_in]``, float64) from the LoRA factors ``a [r, d_in]``,
    ``b [d_out, r]``, their gradients and the scale ``s`` (see module docstring)."""
    a, b = a.detach().double(), b.detach().double()
    ga, gb = grad_a.detach().double(), grad_b.detach().double()
    pb = torch.linalg.pinv(b.t() @ b, hermitian=True)
    pa = torch.linalg.pinv(a @ a.t(), hermitian=True)
    left = b @ (pb @ ga)
    right = (gb @ pa) @ a
    both = b @ (pb @ (ga @ a.t()) @ pa) @ a
    return (left + right - both) / scale


def merged_weight(layer) -> torch.Tensor:
    """``W' = W + s B A`` of a peft LoRA layer as ``[d_out, d_in]`` float64."""
    a, b, s = lora_factors(layer)
    w = weight_out_in(layer.get_base_layer()).detach().double()
    return w + s * (b.detach().double() @ a.detach().double())


def taylor_products(layer) -> torch.Tensor | None:
    """``G_hat * W'`` (elementwise, ``[d_out, d_in]``) of a LoRA layer after a backward;
    ``None`` before any gradient."""
    a, b, s = lora_factors(layer)
    if a.grad is None or b.grad is None:
        return None
    return lora_gradient_estimate(a, b, a.grad, b.grad, s) * merged_weight(layer)


def weight_importance(layer) -> torch.Tensor | None:
    """Per-weight REP-LIE importance ``|G_hat_ij W'_ij|`` (``[d_out, d_in]``)."""
    p = taylor_products(layer)
    return None if p is None else p.abs()


# ---------------------------------------------------------------- units
def _rows(index: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.as_tensor(i, dtype=torch.long) for i in index])


_INDEX_CACHE: dict = {}


def unit_index(adapter, i: int, kind: str, mode: str = "groups") -> dict[str, tuple]:
    """``{role: ("rows" | "cols", index [units, k])}``: which rows / columns of each
    projection of block ``i`` a unit owns (``kind`` ffn or heads; ``mode`` groups or
    query). Cached per family and shape."""
    shape = adapter.ffn_width(i) if kind == "ffn" else adapter.head_geometry(i)
    key = (adapter.family, tuple(adapter.spec.attn_proj), tuple(adapter.spec.mlp_proj),
           kind, mode, shape)
    if key not in _INDEX_CACHE:
        _INDEX_CACHE[key] = _unit_index(adapter, i, kind, mode)
    return _INDEX_CACHE[key]


def _unit_index(adapter, i: int, kind: str, mode: str) -> dict[str, tuple]:
    spec = adapter.spec
    if kind == "ffn":
        width = adapter.ffn_width(i)
        roles = adapter.mlp_projections(i)
        out = {"down": ("cols", torch.arange(width)[:, None])}
        for role in ("gate", "up"):
            if role in roles:
                out[role] = ("rows", torch.arange(width)[:, None])
        if "gate_up" in roles:
            out["gate_up"] = ("rows", _rows([spec.gate_up_rows(torch.tensor([c]), width)
                                             for c in range(width)]))
        return out
    geo = adapter.head_geometry(i)
    hd = geo.head_dim
    roles = adapter.attn_projections(i)
    if mode == "query":
        heads = _rows([torch.arange(h * hd, (h + 1) * hd) for h in range(geo.num_heads)])
        return {"q": ("rows", heads), "o": ("cols", heads)}
    groups = _rows(S.head_units(geo.num_heads, geo.num_kv_heads, hd, "groups"))
    out = {"o": ("cols", groups)}
    if "qkv" in roles:
        out["qkv"] = ("rows", _rows([spec.fused_qkv_rows([g], geo)
                                     for g in range(geo.num_kv_heads)]))
        return out
    kv = _rows([torch.arange(g * hd, (g + 1) * hd) for g in range(geo.num_kv_heads)])
    out.update({"q": ("rows", groups), "k": ("rows", kv), "v": ("rows", kv)})
    return out


def unit_importance(adapter, i: int, kind: str, mode: str = "groups"
                    ) -> torch.Tensor | None:
    """``I_u`` of every unit of block ``i`` at the current gradients (float64); roles
    without a LoRA contribute nothing; ``None`` before any gradient."""
    projs = adapter.mlp_projections(i) if kind == "ffn" else adapter.attn_projections(i)
    total = None
    for role, (axis, index) in unit_index(adapter, i, kind, mode).items():
        layer = projs.get(role)
        if layer is None or not hasattr(layer, "lora_A"):
            continue
        prod = taylor_products(layer)
        if prod is None:
            continue
        sums = prod.sum(1) if axis == "rows" else prod.sum(0)
        part = sums[index].sum(1)
        total = part if total is None else total + part
    return None if total is None else total.abs()


class RepLieTracker:
    """Running REP-LIE importance per unit of every block (see module docstring); an
    observer of :func:`prunelab.heal.heal`."""

    def __init__(self, kind: str = "ffn", mode: str = "groups"):
        self.kind, self.mode = kind, mode
        self.sums: list[torch.Tensor] = []
        self.counts: list[int] = []
        self.window: list[list[torch.Tensor]] = []
        self.rank_corr: list[float] = []

    def after_backward(self, run) -> None:
        ad = run.lm.adapter
        if not self.sums:
            self.sums = [None] * ad.num_blocks
            self.counts = [0] * ad.num_blocks
            self.window = [[] for _ in range(ad.num_blocks)]
        corr = []
        for i in range(ad.num_blocks):
            imp = unit_importance(ad, i, self.kind, self.mode)
            if imp is None:
                continue
            self.sums[i] = imp if self.sums[i] is None else self.sums[i] + imp
            self.counts[i] += 1
            if self.window[i]:
                corr.append(spearman(self.window[i][-1], imp))
            self.window[i].append(imp)
        if corr:
            self.rank_corr.append(sum(corr) / len(corr))

    def means(self) -> list[torch.Tensor | None]:
        return [None if s is None else s / max(c, 1) for s, c in zip(self.sums, self.counts,
                                                                     strict=True)]

    def choose(self, i: int, k: int, stability: float) -> tuple[list[int], int]:
        """The ``k`` units of block ``i`` to remove and how many were not stable."""
        mean = self.means()[i]
        if k <= 0 or mean is None:
            return [], 0
        low = torch.zeros_like(mean)
        for imp in self.window[i]:
            low[torch.argsort(imp, stable=True)[:k]] += 1
        frac = low / max(len(self.window[i]), 1)
        stable = frac >= stability
        order = sorted(range(len(mean)), key=lambda u: (not bool(stable[u]), float(mean[u]), u))
        chosen = order[:k]
        return chosen, sum(1 for u in chosen if not bool(stable[u]))

    def on_slice(self, i: int, keep: list[int]) -> None:
        """Block ``i`` kept units ``keep``: keep their running sums; a new window starts."""
        if self.sums and self.sums[i] is not None:
            self.sums[i] = self.sums[i][torch.as_tensor(keep)]
        if self.window:
            self.window[i] = []

    def state_dict(self) -> dict:
        return {"sums": self.sums, "counts": self.counts, "window": self.window,
                "rank_corr": self.rank_corr}

    def load_state_dict(self, d: dict) -> None:
        self.sums, self.counts = d["sums"], d["counts"]
        self.window, self.rank_corr = d["window"], d["rank_corr"]

    def rank_stability(self) -> float | None:
        return sum(self.rank_corr) / len(self.rank_corr) if self.rank_corr else None


def rep_lie_importances(lm, input_ids: torch.Tensor, kind: str = "ffn",
                        mode: str = "groups", steps: int = 20, lr: float = 2e-4,
                        rank: int = 8, seed: int = 0, batch_size: int = 4
                        ) -> tuple[list[torch.Tensor], dict]:
    """A short LoRA fine-tune (cross-entropy on ``input_ids``) that only reads REP-LIE
    importances: the LoRA is dropped at the end, so ``lm``'s weights are unchanged.
    Returns the running mean importance per block (low = removable) and run facts."""
    cfg = HealConfig(loss="ce", steps=steps, lr=lr, lora_rank=rank, lora_alpha=2.0 * rank,
                     seed=seed, batch_size=min(batch_size, int(input_ids.shape[0])),
                     eval_every=0, patience=0, warmup=0.0, quiet=True)
    tracker = RepLieTracker(kind, mode)
    _, rec = heal(lm, None, input_ids, None, cfg, observers=[tracker], merge=False)
    means = [m if m is not None else torch.zeros(0, dtype=torch.float64)
             for m in tracker.means()]
    return means, {"steps": rec["steps"], "tokens": rec["tokens"],
                   "rank_stability": tracker.rank_stability()}
