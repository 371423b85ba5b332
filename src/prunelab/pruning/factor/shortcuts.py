"""The residual shortcut of a sliced block, as a custom module a checkpoint rebuilds.

After SliceGPT (Ashkboos et al., "SliceGPT: Compress Large Language Models by Deleting Rows
and Columns", ICLR 2024) with a rotation per boundary, the residual that skips a branch
must be mapped from the coordinates of the boundary before the branch to those of the
boundary after it (``x -> x M``, ``M = Q_prev[:, :d']^T Q_next[:, :d']``). The residual
add lives inside the Hugging Face decoder layer, so instead of rewriting its forward a
:class:`ResidualShortcut` hooks two modules: a forward pre-hook on the norm that reads the
stream captures the residual ``x``, and a forward hook on the branch output (the attention
or MLP module, or Gemma 2/3's post-norm) returns ``y R + x M - x``, so the layer's own
``residual + branch`` becomes ``x M + y R``. ``R`` (``out_map``) maps a branch output that
could not be rotated before the post-norm (Gemma 2/3) into the kept coordinates; that
branch's writer and post-norm keep the full width ``d_branch``, which a model built from a
config with the sliced ``hidden_size`` does not give them: :meth:`prunelab_attach` resizes
them (before the checkpoint's weights load; a no-op when they have that width already).

When the stream changes width across the branch (non-uniform per-layer slicing: the MLP
residual of block ``i`` maps ``v_i -> v_{i+1}``), the layer's own ``residual + branch``
cannot hold the result: with ``layer`` (the decoder layer's path) the branch hook keeps
``x M + y R`` aside and returns zeros, and a forward hook on the layer returns it as the
layer's output.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab.models.custom import PrunelabModule, register_module


@register_module
class ResidualShortcut(PrunelabModule):
    """``residual + branch -> x M + y R`` for one branch of a decoder layer.

    ``reads``: path (from the model root) of the norm whose input is the residual ``x``;
    ``d_in``: width of ``x``; ``d_out``: width of the stream after the branch;
    ``d_branch``: width of the branch output ``y`` when it is mapped by ``out_map``
    (``0`` = not mapped); ``shortcut``: whether ``M`` is stored (``False`` = identity);
    ``writer``: path of the linear writing ``y`` (with ``out_map``: it and the owner, a
    post-norm, keep ``d_branch`` outputs); ``layer``: path of the decoder layer whose
    output becomes ``x M + y R`` (the stream changes width across this branch).
    """

    prunelab_kind = "residual_shortcut"

    def __init__(self, reads: str, d_in: int, d_out: int, d_branch: int = 0,
                 shortcut: bool = True, writer: str = "", layer: str = ""):
        super().__init__()
        self.writer, self.layer = writer, layer
        self.reads, self.d_in, self.d_out = reads, d_in, d_out
        self.d_branch, self.has_shortcut = d_branch, shortcut
        self.shortcut = nn.Parameter(torch.eye(d_in, d_out)) if shortcut else None
        self.out_map = nn.Parameter(torch.eye(d_branch, d_out)) if d_branch else None
        self.__dict__["_x"] = None
        self.__dict__["_z"] = None

    def prunelab_spec(self) -> dict:
        return {"reads": self.reads, "d_in": self.d_in, "d_out": self.d_out,
                "d_branch": self.d_branch, "shortcut": self.has_shortcut,
                "writer": self.writer, **({"layer": self.layer} if self.layer else {})}

    def prunelab_attach(self, owner: nn.Module, root: nn.Module) -> None:
        if self.d_branch and self.writer:
            self._keep_branch_width(owner, root)
        if self.has_shortcut:
            root.get_submodule(self.reads).register_forward_pre_hook(self._capture)
        owner.register_forward_hook(self._on_output)
        if self.layer:
            root.get_submodule(self.layer).register_forward_hook(self._on_layer_output)

    def _keep_branch_width(self, owner: nn.Module, root: nn.Module) -> None:
        """Give the writer ``d_branch`` outputs and the post-norm ``owner`` ``d_branch``
        channels when they have another width (a model built with the sliced config)."""
        old = root.get_submodule(self.writer)
        if old.out_features != self.d_branch:
            head, _, name = self.writer.rpartition(".")
            new = nn.Linear(old.in_features, self.d_branch, bias=old.bias is not None)
            new = new.to(device=old.weight.device, dtype=old.weight.dtype)
            setattr(root.get_submodule(head) if head else root, name, new)
        w = owner.weight
        if w.shape[0] != self.d_branch:
            owner.weight = nn.Parameter(torch.zeros(self.d_branch, device=w.device,
                                                    dtype=w.dtype))

    def set_maps(self, shortcut: torch.Tensor | None = None,
                 out_map: torch.Tensor | None = None) -> None:
        """Replace ``M`` and / or ``R`` (any shapes: the widths follow them)."""
        ref = self.shortcut if self.shortcut is not None else self.out_map
        with torch.no_grad():
            if shortcut is not None:
                self.shortcut = nn.Parameter(shortcut.to(ref.device, ref.dtype))
                self.d_in, self.d_out = self.shortcut.shape
            if out_map is not None:
                self.out_map = nn.Parameter(out_map.to(ref.device, ref.dtype))
                self.d_branch, self.d_out = self.out_map.shape

    def _capture(self, module, args):
        self.__dict__["_x"] = args[0]

    def _on_output(self, module, args, output):
        y = output[0] if isinstance(output, tuple) else output
        if self.out_map is not None:
            y = y @ self.out_map.to(y.dtype)
        if self.shortcut is not None:
            x = self.__dict__["_x"]
            self.__dict__["_x"] = None
            if self.layer:  # the layer returns x M + y R; its own add sees x + 0
                self.__dict__["_z"] = y + x @ self.shortcut.to(x.dtype)
                y = torch.zeros_like(x)
            else:
                y = y + (x @ self.shortcut.to(x.dtype) - x)
        return (y, *output[1:]) if isinstance(output, tuple) else y

    def _on_layer_output(self, module, args, output):
        z = self.__dict__["_z"]
        self.__dict__["_z"] = None
        if z is None:
            return output
        return (z, *output[1:]) if isinstance(output, tuple) else z

    def flops_per_token(self) -> int:
        return 2 * sum(p.numel() for p in self.parameters(recurse=False))

    def extra_repr(self) -> str:
        return (f"reads={self.reads}, d_in={self.d_in}, d_out={self.d_out}, "
                f"d_branch={self.d_branch}, shortcut={self.has_shortcut}")
