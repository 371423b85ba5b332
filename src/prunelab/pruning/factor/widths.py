"""Non-uniform residual-stream widths for per-layer slicing: allocation, parameter count,
and the module that gives a reloaded checkpoint its per-block shapes.

With one rotation per boundary (SliceGPT, Ashkboos et al., ICLR 2024) nothing forces every
boundary to keep the same number of directions. A Hugging Face decoder layer adds both of
its residual branches to the stream it was given, so the width may change only between
blocks: block ``i`` runs at width ``v_i`` (its attention and MLP inputs), the final norm and
the head read ``v_L``. The MLP residual of block ``i`` maps ``v_i -> v_{i+1}``
(:class:`~.shortcuts.ResidualShortcut` with a ``layer`` path returns the mapped stream as
the layer's output).

Widths come from the spectra of the dense (norm-folded) stream: for each block the
eigenvalues of its two boundary covariances, each divided by its trace (so every direction
is worth its share of that boundary's energy) and averaged. ``widths="spectrum"``: start
every block at ``multiple`` directions and repeatedly give ``multiple`` more to the block
whose next directions hold the largest energy share per parameter they cost (exact
parameter counts, shortcut maps included), while the total stays within the budget (the
uniform slice's parameters at ``ratio``, or ``target_params``). ``widths="energy"``: per
block the fewest directions holding ``energy`` of its spectrum, rounded up to ``multiple``.
"""

from __future__ import annotations

import torch
from torch import nn

from prunelab import linalg
from prunelab.errors import ConfigError
from prunelab.models.custom import PrunelabModule, register_module
from prunelab.models.size import model_size
from prunelab.pruning.factor.folding import stream_boundaries, stream_branches
from prunelab.pruning.factor.subspace import widths_for_energy


def block_of(k: int, num_branches: int) -> tuple[int, int]:
    """``(input group, output group)`` of branch ``k`` (attention ``2i``: ``i, i``; MLP
    ``2i + 1``: ``i, i + 1``); group ``L`` is the final norm / head."""
    del num_branches
    return k // 2, (k + 1) // 2


def boundary_width(widths: list[int], k: int) -> int:
    """The width of stream boundary ``k`` (``2i``, ``2i + 1``: block ``i``; ``2L``: final)."""
    return widths[k // 2] if k < 2 * (len(widths) - 1) else widths[-1]


def params_for_widths(lm, widths: list[int], rotation: str = "per-layer",
                      keep_tied: bool = False) -> int:
    """Parameters the sliced model stores with block widths ``widths`` (``L + 1`` entries:
    the blocks, then the final norm / head), counted from the current shapes: untied head
    (unless ``keep_tied`` and it is tied now), shortcut maps (per-layer) and Gemma 2/3's
    post-norm maps included."""
    return width_counter(lm, rotation, keep_tied)(widths)


def width_counter(lm, rotation: str = "per-layer", keep_tied: bool = False):
    """A function ``widths -> parameters`` (as :func:`params_for_widths`) that reads the
    model's shapes once, for allocations that count many candidate widths."""
    ad = lm.adapter
    d = ad.hidden_size()
    emb, head = ad.embeddings(), ad.head()
    tied = head.weight.data_ptr() == emb.weight.data_ptr()
    shared = tied and keep_tied  # the head stays one tensor with the embeddings
    n_groups = ad.num_blocks + 1
    shapes = []
    for k, br in enumerate(stream_branches(lm)):
        gin, gout = block_of(k, 0)
        shapes.append((gin, gout, sum(r.weight.shape[0] for r in br.readers),
                       None if br.post_norm is not None else
                       br.writer.weight.shape[1] + (br.writer.bias is not None)))
    vocab_in, vocab_out = emb.weight.shape[0], head.weight.shape[0]

    def stream(ws: list[int], maps: bool) -> int:
        total = vocab_in * ws[0] + (0 if shared else vocab_out * ws[-1]) + ws[-1]
        for gin, gout, readers, writer in shapes:
            win, wout = ws[gin], ws[gout]
            total += win + readers * win
            if writer is not None:
                total += writer * wout
            elif maps:
                total += d * wout
            if maps and rotation == "per-layer":
                total += win * wout
        return total

    now = model_size(lm.model)["params"]
    fixed = now - stream([d] * n_groups, maps=False) + \
        (head.weight.numel() if tied and not shared else 0)

    def count(widths: list[int]) -> int:
        if len(widths) != n_groups:
            raise ValueError(f"{len(widths)} widths for {n_groups - 1} blocks (+1 final)")
        return fixed + stream(list(widths), maps=True)
    return count


def block_spectra(grams: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per block (and the final boundary) the descending eigenvalues of its boundary
    covariances, each divided by its trace, averaged over the block's two boundaries."""
    def share(g: torch.Tensor) -> torch.Tensor:
        g = g.double()
        ev = linalg.eigvalsh(g).flip(0).clamp_min(0)
        return ev / ev.sum().clamp_min(1e-300)

    blocks = (len(grams) - 1) // 2
    out = [(share(grams[2 * i]) + share(grams[2 * i + 1])) / 2 for i in range(blocks)]
    out.append(share(grams[-1]))
    return out


def allocate_for_energy(spectra: list[torch.Tensor], energy: float, multiple: int
                        ) -> list[int]:
    """Per group the fewest directions holding ``energy`` of its spectrum, rounded up to
    ``multiple`` (at least ``multiple``, at most the full size)."""
    raw = widths_for_energy(spectra, energy)
    return [min(len(s), max(multiple, -(-w // multiple) * multiple))
            for w, s in zip(raw, spectra, strict=True)]


def allocate_for_budget(lm, spectra: list[torch.Tensor], budget: int, multiple: int,
                        rotation: str = "per-layer") -> list[int]:
    """Greedy widths under ``budget`` parameters (see the module docstring)."""
    sizes = [len(s) for s in spectra]
    widths = [min(multiple, n) for n in sizes]
    spent = params_for_widths(lm, widths, rotation)
    if spent > budget:
        raise ConfigError(f"the parameter budget {budget} is below the minimum {spent} "
                          f"(every block at least {multiple} wide)")
    cum = [torch.cat([s.new_zeros(1), s.cumsum(0)]) for s in spectra]
    while True:
        best, best_value, best_cost = None, None, None
        for g, (w, n) in enumerate(zip(widths, sizes, strict=True)):
            step = min(multiple, n - w)
            if step == 0:
                continue
            trial = list(widths)
            trial[g] = w + step
            cost = params_for_widths(lm, trial, rotation)
            if cost > budget:
                continue
            value = float(cum[g][w + step] - cum[g][w]) / max(cost - spent, 1)
            if best is None or value > best_value:
                best, best_value, best_cost = g, value, cost
        if best is None:
            return widths
        widths[best] += min(multiple, sizes[best] - widths[best])
        spent = best_cost


@register_module
class StreamShapes(PrunelabModule):
    """Gives a model built from the sliced config (every stream tensor ``hidden_size``
    wide) the per-block widths of a non-uniform slice: at attach, before the checkpoint's
    weights load, each listed linear gets its ``[in, out]`` shape and each listed norm its
    width (no-ops where the shapes already agree)."""

    prunelab_kind = "stream_shapes"

    def __init__(self, linears: dict | None = None, norms: dict | None = None):
        super().__init__()
        self.linears = dict(linears or {})
        self.norms = dict(norms or {})

    def prunelab_spec(self) -> dict:
        return {"linears": self.linears, "norms": self.norms}

    def prunelab_attach(self, owner: nn.Module, root: nn.Module) -> None:
        for path, (d_in, d_out, bias) in self.linears.items():
            old = root.get_submodule(path)
            if (old.in_features, old.out_features) == (d_in, d_out):
                continue
            head, _, name = path.rpartition(".")
            new = nn.Linear(d_in, d_out, bias=bool(bias))
            new = new.to(device=old.weight.device, dtype=old.weight.dtype)
            setattr(root.get_submodule(head) if head else root, name, new)
        for path, width in self.norms.items():
            norm = root.get_submodule(path)
            w = norm.weight
            if w.shape[0] != width:
                norm.weight = nn.Parameter(torch.zeros(width, device=w.device, dtype=w.dtype))

    def flops_per_token(self) -> int:
        return 0


def record_shapes(lm) -> StreamShapes:
    """A :class:`StreamShapes` listing every stream reader / writer / norm and the head of
    ``lm`` with their current shapes."""
    names = {id(m): n for n, m in lm.model.named_modules()}
    linears: dict[str, list] = {}

    def add(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            linears[names[id(module)]] = [module.in_features, module.out_features,
                                          module.bias is not None]
    for br in stream_branches(lm):
        for r in br.readers:
            add(r)
        add(br.writer)
    add(lm.adapter.head())
    norms = {names[id(n)]: int(n.weight.shape[0]) for n in stream_boundaries(lm)}
    return StreamShapes(linears, norms)
