"""What a heal run trains, and how its structure survives: LoRA through ``peft`` on the
adapter's prunable linears (never the tied head), or every block parameter (``full``);
linear bridges optionally; exact zeros of sparse linears kept.

LoRA (Hu et al. 2022): a linear's weight ``W`` (``[d_out, d_in]``) acts as
``W + s B A`` with ``A [r, d_in]``, ``B [d_out, r]``, ``s = alpha / r``; ``B`` starts at
zero. Sparse linears keep their zero pattern ``M`` (``M = W != 0`` at the start): the
delta is masked, ``W + M * (s B A)``, in every forward (a forward hook on the ``peft``
layer subtracts ``x ((1 - M) * s B A)^T``) and when merged, so what was trained is what is
saved. With ``full`` the gradient is masked before each step and the mask re-applied after.
Linears ``peft`` cannot wrap (prunelab's custom factorized modules) stay frozen under LoRA.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from prunelab.models.bridges import BRIDGE_ATTR
from prunelab.models.linear import is_conv1d

ADAPTER = "default"


def linear_paths(model: nn.Module, adapter) -> dict[str, nn.Module]:
    """``{full module path: module}`` of every prunable linear of every block (the
    adapter's :meth:`~prunelab.models.adapters.Adapter.linears`)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for i in range(adapter.num_blocks):
        for module in adapter.linears(i).values():
            base = getattr(module, "base_layer", module)
            out[names[id(module)]] = base
    return out


def zero_masks(model: nn.Module, adapter) -> dict[str, torch.Tensor]:
    """``{path: bool kept mask in the weight's own layout}`` of every prunable linear
    holding exact zeros (dense linears are left out)."""
    masks = {}
    for path, module in linear_paths(model, adapter).items():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and bool((w == 0).any()):
            masks[path] = w.detach() != 0
    return masks


def zero_count(model: nn.Module, adapter) -> int:
    """Exact zeros in the prunable linears."""
    return sum(int((m.weight == 0).sum()) for m in linear_paths(model, adapter).values()
               if isinstance(getattr(m, "weight", None), torch.Tensor))


def bridge_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters of the linear bridges of a depth-pruned model, by name."""
    return {n: p for n, p in model.named_parameters() if f"{BRIDGE_ATTR}." in n}


def _wrappable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


class Trainables:
    """The trainable state of one run: injects LoRA (or unfreezes the blocks), keeps the
    zero masks, and merges back. ``params()`` lists what the optimizer updates, in a fixed
    order (names sorted)."""

    def __init__(self, lm, rank: int, alpha: float, full: bool, train_bridges: bool,
                 seed: int):
        self.lm, self.model, self.adapter = lm, lm.model, lm.adapter
        self.rank, self.alpha, self.full = rank, alpha, full
        self.train_bridges = train_bridges
        self.flags = {n: p.requires_grad for n, p in self.model.named_parameters()}
        self.masks = zero_masks(self.model, self.adapter)
        self.skipped: list[str] = []
        self._lora = None
        self._hooks: list = []
        self.build(seed)

    # ---------------------------------------------------------------- set-up
    def build(self, seed: int) -> None:
        """Inject LoRA (seeded init) or unfreeze the block parameters."""
        for p in self.model.parameters():
            p.requires_grad_(False)
        if self.full:
            for p in self.adapter.blocks().parameters():
                p.requires_grad_(True)
        else:
            self._inject(seed)
        if self.train_bridges:
            for p in bridge_parameters(self.model).values():
                p.requires_grad_(True)

    def _inject(self, seed: int) -> None:
        from peft import LoraConfig
        from peft.tuners.lora import LoraModel

        paths = linear_paths(self.model, self.adapter)
        targets = [p for p, m in paths.items() if _wrappable(m)]
        self.skipped = [p for p in paths if p not in targets]
        conv = any(is_conv1d(paths[p]) for p in targets)
        cfg = LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=0.0, bias="none",
                         target_modules=targets, fan_in_fan_out=conv)
        state = torch.get_rng_state()
        torch.manual_seed(seed)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._lora = LoraModel(self.model, cfg, ADAPTER)
        finally:
            torch.set_rng_state(state)
        for path, mask in self.masks.items():
            layer = self.model.get_submodule(path)
            self._hooks.append(layer.register_forward_hook(_masked_delta_hook(mask)))

    # ---------------------------------------------------------------- views
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        return sorted(((n, p) for n, p in self.model.named_parameters() if p.requires_grad),
                      key=lambda x: x[0])

    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_params()]

    def state(self) -> dict[str, torch.Tensor]:
        """Copies of the trainable tensors (LoRA / blocks / bridges), by name."""
        return {n: p.detach().clone() for n, p in self.named_params()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        own = dict(self.named_params())
        with torch.no_grad():
            for n, v in state.items():
                own[n].copy_(v)

    def lora_layers(self) -> dict[str, nn.Module]:
        """``{path of the wrapped linear: peft LoRA layer}`` (empty with ``full``)."""
        from peft.tuners.lora import LoraLayer

        return {n: m for n, m in self.model.named_modules() if isinstance(m, LoraLayer)}

    # ---------------------------------------------------------------- full mode
    def mask_grads(self) -> None:
        if not self.full:
            return
        for path, mask in self.masks.items():
            w = self.model.get_submodule(path).weight
            if w.grad is not None:
                w.grad.mul_(mask)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> None:
        """One update after ``backward``: masked gradients, clipping (``max_grad_norm`` > 0),
        the optimizer step, and in full mode the sparsity masks re-applied to the weights."""
        self.mask_grads()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params(), max_grad_norm)
        optimizer.step()
        if self.full:
            self.reapply_masks()

    def reapply_masks(self) -> None:
        with torch.no_grad():
            for path, mask in self.masks.items():
                layer = self.model.get_submodule(path)
                getattr(layer, "base_layer", layer).weight.mul_(mask)

    # ---------------------------------------------------------------- merge
    def merge(self, keep: bool = True) -> None:
        """Fold the LoRA deltas (masked) into the weights (``keep=False``: drop them),
        remove every ``peft`` module and hook, restore the original ``requires_grad``."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._lora is not None:
            if keep:
                self._lora.merge_and_unload()
            else:
                self._lora.unload()
            self._lora = None
        self.reapply_masks()
        for n, p in self.model.named_parameters():
            p.requires_grad_(self.flags.get(n, False))

    def refresh_masks(self) -> None:
        """Re-read the zero masks (after slicing or deleting blocks: shapes and paths
        change; exact zeros stay where the kept mask had them)."""
        if self.masks:
            self.masks = zero_masks(self.model, self.adapter)

    def rebuild(self, seed: int) -> None:
        """Merge, then inject a fresh LoRA on the current shapes (after slicing)."""
        self.refresh_masks()
        self.merge(keep=True)
        self.flags = {n: p.requires_grad for n, p in self.model.named_parameters()}
        self.build(seed)


def _masked_delta_hook(mask: torch.Tensor):
    """Forward hook on a peft LoRA linear: remove the delta outside the kept mask."""
    def hook(module, args, output):
        delta = module.get_delta_weight(ADAPTER)  # weight layout, includes the scale
        off = delta * (~mask).to(delta.dtype)
        x = args[0]
        if is_conv1d(module.get_base_layer()):
            return output - x.to(off.dtype) @ off
        return output - F.linear(x.to(off.dtype), off)
    return hook


def lora_factors(layer) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(A [r, d_in], B [d_out, r], s)`` of a peft LoRA layer (weight layout
    ``[d_out, d_in]`` whatever the base layer stores)."""
    a = layer.lora_A[ADAPTER].weight
    b = layer.lora_B[ADAPTER].weight
    return a, b, float(layer.scaling[ADAPTER])
