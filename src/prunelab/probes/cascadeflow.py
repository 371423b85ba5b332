"""CascadeFlow: block removal from gradients accumulated while fine-tuning.

For every block ``i`` and training step ``t`` one gradient norm ``n_{i,t}`` is measured
after the backward pass:

* ``params`` (default): ``||dL/dtheta_i||_2`` over the block's *trainable* parameters
  (its LoRA matrices under LoRA, all its weights under full fine-tuning, its bridge when
  bridges train): how much the fine-tune wants to change the block;
* ``residual``: ``||dL/dh_{i+1}||_F``, the gradient of the loss with respect to the
  residual stream at the block's output (the whole batch): how much the loss still
  depends on the stream the block writes.

The accumulated value is ``a_i = sum_t n_{i,t}``; the score is its mean ``a_i / T``; a low
value marks a block the training signal barely reaches, the first to remove. The *gradient
fan-in profile* is ``a`` against depth; :func:`fan_in_profile` reports it with its
Spearman correlation with depth (the fan-in asymmetry: the sign says whether early or
late blocks collect more gradient) and with post-hoc probes (block influence,
leave-one-out). CascadeFlow is this repository's seed method (no reference code); the
Taylor / gradient-flow view of layer importance follows Molchanov et al. 2019.
"""

from __future__ import annotations

import torch

from prunelab.linalg import spearman
from prunelab.train.config import HealConfig
from prunelab.train.loop import heal


class FlowAccumulator:
    """Per-block accumulated gradient norms; an observer of :func:`prunelab.heal.heal`."""

    def __init__(self, measure: str = "params"):
        if measure not in ("params", "residual"):
            raise ValueError(f"measure must be params or residual, got {measure!r}")
        self.measure = measure
        self.sums: list[float] = []
        self.steps = 0
        self._handles: list = []
        self._grads: dict[int, float] = {}

    # ---------------------------------------------------------------- hooks (residual)
    def attach(self, run) -> None:
        if self.measure != "residual":
            return
        self.detach(run)
        for i, block in enumerate(run.lm.adapter.blocks()):
            self._handles.append(block.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def on_output(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            if torch.is_tensor(h) and h.requires_grad:
                def grab(grad, _i=i):
                    self._grads[_i] = float(grad.detach().double().norm())
                h.register_hook(grab)
        return on_output

    def detach(self, run=None) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---------------------------------------------------------------- accumulation
    def norms(self, run) -> list[float]:
        """This step's ``n_{i,t}`` for every block."""
        ad = run.lm.adapter
        if self.measure == "residual":
            out = [self._grads.get(i, 0.0) for i in range(ad.num_blocks)]
            self._grads = {}
            return out
        out = []
        for i in range(ad.num_blocks):
            sq = 0.0
            for p in ad.block(i).parameters():
                if p.requires_grad and p.grad is not None:
                    sq += float(p.grad.detach().double().pow(2).sum())
            out.append(sq ** 0.5)
        return out

    def after_backward(self, run) -> None:
        n = self.norms(run)
        if not self.sums:
            self.sums = [0.0] * len(n)
        self.sums = [a + b for a, b in zip(self.sums, n, strict=True)]
        self.steps += 1

    def values(self) -> list[float]:
        """Mean accumulated norm per block (low = removable)."""
        return [a / max(self.steps, 1) for a in self.sums]

    def on_delete(self, run, index: int) -> None:
        if self.sums:
            del self.sums[index]
        self.attach(run)

    def state_dict(self) -> dict:
        return {"sums": list(self.sums), "steps": self.steps}

    def load_state_dict(self, d: dict) -> None:
        self.sums, self.steps = list(d["sums"]), int(d["steps"])


def fan_in_profile(values: list[float], others: dict | None = None) -> dict:
    """The gradient fan-in profile: ``values`` per depth (0-based blocks), their Spearman
    correlation with depth, and with each of ``others`` (``{name: ProbeResult or list of
    per-block values}``, compared on the blocks where both have a value; probe results
    through their ``layer_values``, low = removable)."""
    v = torch.tensor(values, dtype=torch.float64)
    out = {"profile": list(values), "spearman_depth": spearman(
        v, torch.arange(len(values), dtype=torch.float64)), "spearman": {}}
    for name, other in (others or {}).items():
        ov = other.layer_values() if hasattr(other, "layer_values") else list(other)
        pairs = [(a, b) for a, b in zip(values, ov, strict=False) if b is not None]
        if len(pairs) < 2:
            continue
        a = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
        b = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
        out["spearman"][name] = spearman(a, b)
    return out


POST_HOC = ("block-influence", "leave-one-out")


def fan_in_from_results(results: dict) -> dict | None:
    """:func:`fan_in_profile` of a ``gradient-flow`` probe result against the post-hoc
    probes present in ``results`` (``{name: ProbeResult}``, e.g. a probe session's or the
    summary's); ``None`` without a ``gradient-flow`` result."""
    flow = results.get("gradient-flow")
    if flow is None:
        return None
    values = [v if v is not None else float("nan") for v in flow.layer_values()]
    return fan_in_profile(values, {n: results[n] for n in POST_HOC if n in results})


def fan_in_markdown(results: dict) -> str:
    """A short markdown section on the gradient fan-in profile (empty without a
    ``gradient-flow`` result), for the probe summary."""
    prof = fan_in_from_results(results)
    if prof is None:
        return ""
    lines = ["## Gradient fan-in (CascadeFlow)", "",
             "Mean accumulated gradient norm per block (0-based, low = removable): "
             + ", ".join(f"{i}: {v:.3g}" for i, v in enumerate(prof["profile"])), "",
             f"- Spearman with depth: {prof['spearman_depth']:+.2f} "
             "(negative: early blocks collect more gradient)"]
    for name, rho in prof["spearman"].items():
        lines.append(f"- Spearman with {name}: {rho:+.2f}")
    return "\n".join(lines) + "\n"


def gradient_flow(lm, input_ids: torch.Tensor, steps: int = 20, lr: float = 2e-4,
                  rank: int = 8, seed: int = 0, measure: str = "params",
                  batch_size: int = 4) -> tuple[list[float], dict]:
    """A short LoRA fine-tune (cross-entropy on ``input_ids``) that only accumulates the
    block gradient norms: the LoRA is dropped at the end, ``lm``'s weights are unchanged.
    Returns the mean accumulated norm per block and run facts."""
    cfg = HealConfig(loss="ce", steps=steps, lr=lr, lora_rank=rank, lora_alpha=2.0 * rank,
                     seed=seed, batch_size=min(batch_size, int(input_ids.shape[0])),
                     eval_every=0, patience=0, warmup=0.0, quiet=True)
    acc = FlowAccumulator(measure)
    _, rec = heal(lm, None, input_ids, None, cfg, observers=[acc], merge=False)
    return acc.values(), {"steps": rec["steps"], "tokens": rec["tokens"], "measure": measure}
