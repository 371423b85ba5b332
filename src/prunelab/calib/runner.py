"""Block-by-block calibration runner: the one mechanism every probe and pruner uses.

1. ``capture``: one cheap pass of the base model with every block replaced by a recorder
   that stores what the model passes to that block (hidden states, masks, rotary
   embeddings, position ids; per block, so sliding-window blocks keep their own mask) and
   returns its input unchanged. The recorded block-0 inputs start the run.
2. The blocks then run one at a time over all calibration batches, without a KV cache.
   Hooks are registered only here and always removed (``try/finally``).
3. A run can propagate the original outputs (``propagate="dense"``) or those of the block
   after a method changed it (``"modified"``), feed per-linear input statistics to pure
   accumulators (:mod:`prunelab.calib.stats`), and keep the hidden state at every block
   boundary (in memory or on disk) for probes.

With ``offload=True`` the weights stay on the CPU and each block visits the device only
for its turn, so a model larger than the accelerator can be calibrated.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from prunelab.calib.sequential import SequentialBlock, SharedInputs, StopBlock, as_list
from prunelab.calib.stats import Accumulator
from prunelab.log import progress
from prunelab.models.adapters import Adapter, get_adapter


def _linear_in(module: nn.Linear, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` computed in ``dtype`` (inputs and weights rounded to it, products
    accumulated by the matmul kernel), returned in ``x``'s dtype."""
    bias = module.bias.to(dtype) if module.bias is not None else None
    return nn.functional.linear(x.to(dtype), module.weight.to(dtype), bias).to(x.dtype)


@contextlib.contextmanager
def low_precision_linears(block: nn.Module, dtype: torch.dtype | None):
    """Inside: every ``nn.Linear`` of ``block`` whose weight is not ``dtype`` computes in
    ``dtype`` (bfloat16 calibration). Only the matmuls change: the weights keep their
    dtype (a method's masks and updates stay in float32), the linears' inputs -- what the
    statistics hooks see -- and outputs stay in the model's dtype, and so does everything
    between them (norms, attention, residuals)."""
    patched = []
    if dtype is not None:
        for m in block.modules():
            # a module whose forward is already replaced (the sequential runner's replayed
            # or placeholder linears) does not compute: left as it is
            if type(m) is nn.Linear and m.weight.dtype != dtype and \
                    "forward" not in m.__dict__:
                m.forward = functools.partial(_linear_in, m, dtype)
                patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward  # back to the class's forward


class _Recorder(nn.Module):
    """Stands in for a block during capture: records its call, returns its input."""

    def __init__(self, block: nn.Module, sink: list):
        super().__init__()
        self.__dict__["_block"] = block  # not a submodule: .to() must not move it
        self.__dict__["_sink"] = sink

    def forward(self, hidden_states, *args, **kwargs):
        self._sink.append((args, kwargs))
        return hidden_states

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_block"], name)


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


class StateStore:
    """Hidden states at block boundaries: ``put(boundary, list_of_batches)``, ``get``.

    ``mode="memory"`` keeps CPU tensors; ``"disk"`` writes one file per boundary in a
    temporary directory removed by :meth:`close`.
    """

    def __init__(self, mode: str = "memory", directory: str | Path | None = None):
        if mode not in ("memory", "disk"):
            raise ValueError(f"state store mode must be memory or disk, got {mode!r}")
        self.mode = mode
        self._mem: dict[int, list[torch.Tensor]] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="prunelab-states-", dir=directory)) \
            if mode == "disk" else None

    def put(self, boundary: int, states: Sequence[torch.Tensor]) -> None:
        cpu = [s.detach().to("cpu") for s in states]
        if self.mode == "memory":
            self._mem[boundary] = cpu
        else:
            torch.save(cpu, self._dir / f"h{boundary}.pt")

    def get(self, boundary: int) -> list[torch.Tensor]:
        if self.mode == "memory":
            return self._mem[boundary]
        return torch.load(self._dir / f"h{boundary}.pt")

    def boundaries(self) -> list[int]:
        if self.mode == "memory":
            return sorted(self._mem)
        return sorted(int(p.stem[1:]) for p in self._dir.glob("h*.pt"))

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __del__(self) -> None:
        if getattr(self, "_dir", None) is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class BlockRunner:
    """Runs a model's blocks one at a time over calibration batches.

    ``input_ids``: ``[N, T]`` token windows, split into batches of ``batch_size``.
    Block ``i``'s input at batch ``b`` is ``inputs[b]``; the output of the last block is
    the raw residual stream before the final norm.
    """

    def __init__(self, model, input_ids: torch.Tensor, batch_size: int = 8,
                 device: str | torch.device | None = None, offload: bool = False):
        self.model = model.model if hasattr(model, "adapter") else model
        self.adapter: Adapter = model.adapter if hasattr(model, "adapter") \
            else get_adapter(self.model)
        target = getattr(model, "offload_to", None)  # a LoadedModel loaded with offload
        if target is not None and device is None:
            device, offload = target, True
        param = next(self.model.parameters())
        here = torch.device("cpu") if param.is_meta else param.device  # meta: streamed
        self.device = torch.device(device) if device is not None else here
        # a streamed model (prunelab.models.streaming): blocks are read from disk in turn
        self.streamer = getattr(model, "streamer", None)
        self.offload = offload
        self._held: set[int] = set()  # blocks moved to the device by an outer _on_device
        self.store_device = torch.device("cpu") if offload else self.device
        self.batches = list(torch.as_tensor(input_ids).split(batch_size))
        # bfloat16 calibration (a LoadedModel's ``calib_dtype``): the blocks' matmuls in it
        self.compute_dtype = getattr(model, "calib_dtype", None)
        self.block_evals = 0  # block x batch evaluations spent
        self.calls: list[list[tuple[tuple, dict]]] = []
        self.inputs: list[torch.Tensor] = []
        self._captured = False

    # ------------------------------------------------------------------ capture
    @torch.no_grad()
    def capture(self) -> list[torch.Tensor]:
        """Record block-0 inputs and each block's call arguments for every batch."""
        blocks = self.adapter.blocks()
        original = list(blocks)
        sinks: list[list] = [[] for _ in original]
        first: list[torch.Tensor] = []
        base = self.adapter.base
        try:
            for i, blk in enumerate(original):
                blocks[i] = _Recorder(blk, sinks[i])
            if self.offload:
                base.to(self.device)  # blocks are recorders now: only embeddings etc. move
            hook = blocks[0].register_forward_pre_hook(
                lambda m, args, kw: first.append(
                    (args[0] if args else kw["hidden_states"]).to(self.store_device)),
                with_kwargs=True)
            try:
                for ids in self.batches:
                    base(**self.adapter.model_inputs(ids.to(self.device)))
            finally:
                hook.remove()
        finally:
            for i, blk in enumerate(original):
                blocks[i] = blk
            if self.offload:
                base.to("cpu")
            if self.streamer is not None:
                self.streamer.release_side()  # streamed embeddings: back to disk
        self.calls = [[self._clean(c) for c in sink] for sink in sinks]
        self.inputs = first
        self._captured = True
        return first

    def _clean(self, call):
        """A recorded call made replayable: no cache use or attention outputs, and the
        family's KV-cache keywords (``FamilySpec.cache_kwargs``) set to ``None``."""
        args, kwargs = call
        kwargs = dict(kwargs)
        for key in ("use_cache", "output_attentions"):
            kwargs.pop(key, None)
        for key in self.adapter.spec.cache_kwargs:
            if key in kwargs:
                kwargs[key] = None
        if self.offload:
            args, kwargs = _to(args, "cpu"), _to(kwargs, "cpu")
        return args, kwargs

    def ensure_captured(self) -> None:
        if not self._captured:
            self.capture()

    # ------------------------------------------------------------------ running
    def call_args(self, index: int, batch: int) -> tuple[tuple, dict]:
        """Positional and keyword arguments the model passes to block ``index`` (its own
        mask and rotary embedding) for batch ``batch``."""
        args, kwargs = self.calls[index][batch]
        if self.offload:
            return _to(args, self.device), _to(kwargs, self.device)
        return args, kwargs

    def _call(self, blk: nn.Module, index: int, batch: int,
              hidden: torch.Tensor) -> torch.Tensor | None:
        """One block call on one batch with the arguments recorded for ``index``: the
        output on ``store_device``, or ``None`` when a hook stopped the block early."""
        args, kwargs = self.call_args(index, batch)
        self.block_evals += 1
        try:
            with low_precision_linears(blk, self.compute_dtype):
                out = blk(hidden.to(self.device), *args, **kwargs)
        except StopBlock:
            return None
        out = out[0] if isinstance(out, tuple) else out
        return out.to(self.store_device)

    @torch.no_grad()
    def run_block(self, index: int, hidden: Sequence[torch.Tensor],
                  block: nn.Module | None = None, args_from: int | None = None,
                  desc: str | None = None) -> list[torch.Tensor]:
        """Outputs of ``block`` (default: the block at ``index``) over every batch.

        ``args_from`` picks whose recorded arguments to pass (default ``index``); a block
        moved to another depth keeps its own attention type by passing its origin.
        """
        self.ensure_captured()
        blk = block if block is not None else self.adapter.block(index)
        src = index if args_from is None else args_from
        outs = []
        with self._on_device(blk):
            for b, h in enumerate(hidden):
                outs.append(self._call(blk, src, b, h))
        return outs

    def _on_device(self, blk: nn.Module):
        """With ``offload``: ``blk`` on the device inside, back on the CPU after. Nested
        uses (``run`` holds the block for ``on_block``, which calls ``collect``) bring it
        back to the CPU only at the outermost exit; every entry moves the block (a no-op
        for what is there already, so parts attached meanwhile follow)."""
        runner = self

        class _Ctx:
            moved = False

            def __enter__(self):
                if runner.streamer is not None:
                    runner.streamer.acquire(blk)
                if runner.offload:
                    blk.to(runner.device)
                    if id(blk) not in runner._held:
                        runner._held.add(id(blk))
                        self.moved = True

            def __exit__(self, *exc):
                if self.moved:
                    runner._held.discard(id(blk))
                    blk.to("cpu")
                return False

        return _Ctx()

    @torch.no_grad()
    def collect(self, index: int, hidden: Sequence[torch.Tensor],
                targets: dict[str, nn.Module],
                make: Callable[[str], Accumulator | Sequence[Accumulator]],
                stop_early: bool = True, outputs: list | None = None,
                share: bool = False) -> dict[str, list[Accumulator]]:
        """Feed the inputs of each target linear of block ``index`` to new accumulators.

        ``targets`` maps names to modules inside the block (e.g. from
        ``adapter.linears(index)``); ``make(name)`` builds the accumulators. With
        ``stop_early`` the block stops as soon as every target has fired, so gathering
        the inputs of ``q/k/v`` costs far less than a full block pass. Without it, the
        block's outputs are appended to ``outputs`` when a list is given.

        ``share=True`` (for a ``make`` that builds the same kind of accumulators for every
        name): targets that receive the very same input tensor (q/k/v, gate/up) share the
        first one's accumulators, updated once; each name still gets its own list.
        """
        self.ensure_captured()
        accs = {name: as_list(make(name)) for name in targets}
        seen = SharedInputs(share)

        def hook_for(name):
            def hook(_module, inputs):
                x = inputs[0]
                if seen.see(name, x):
                    for acc in accs[name]:
                        acc.update(x.detach())
                if stop_early and len(seen.fired) == len(targets):
                    raise StopBlock
            return hook

        handles = [m.register_forward_pre_hook(hook_for(n)) for n, m in targets.items()]
        blk = self.adapter.block(index)
        try:
            with self._on_device(blk):
                for b, h in enumerate(hidden):
                    seen.new_call()
                    out = self._call(blk, index, b, h)
                    if outputs is not None and out is not None:
                        outputs.append(out)
        finally:
            for handle in handles:
                handle.remove()
            seen.new_call()
        return seen.lists(accs)

    @torch.no_grad()
    def sequential(self, index: int, hidden: Sequence[torch.Tensor],
                   groups: Sequence[dict[str, nn.Module]],
                   make: Callable[[str], Accumulator | Sequence[Accumulator]] | None,
                   on_group: Callable[[int, dict[str, list[Accumulator]]], None],
                   containers: Sequence[nn.Module] = ()) -> list[torch.Tensor]:
        """Change block ``index`` group by group in about one pass; return its new outputs.

        ``groups`` lists the block's linears in execution order (e.g. ``[q, k, v]``,
        ``[o]``, ``[gate, up]``, ``[down]``). For group ``g``: the inputs of its linears
        are fed over every batch to accumulators from ``make(name)`` (linears that receive
        the same tensor, like q/k/v, share one set: it is computed once), with groups
        ``< g`` already changed; then ``on_group(g, accs)`` changes the group in place.
        After the last group the changed block runs once more and its outputs are
        returned.

        Nothing is computed twice that cannot have changed. A module becomes *final* once
        every group linear inside it was changed; a final module's output is recorded the
        next time it runs and replayed (its forward is not called) in later stages. Every
        stage stops as soon as its group's inputs were seen, and the group's linears
        return a zero placeholder in their own stage instead of computing. ``containers``
        (the attention / MLP branch) are final-able too; when a stage's group is a single
        linear whose output a container returns as is (``o_proj`` for attention,
        ``down_proj`` for the MLP), the stage stops when the container returns, and after
        ``on_group`` the container's record is its output with the placeholder replaced by
        the changed linear applied to the saved inputs: attention runs once per batch.
        Replayed values are clones, so in-place operations downstream cannot corrupt
        them. ``make=None`` skips the statistics stages (``on_group`` gets ``{}``).
        """
        self.ensure_captured()
        return SequentialBlock(self, index, hidden, groups, containers).run(make, on_group)

    def run(self, on_block: Callable[[int, list[torch.Tensor]], None] | None = None,
            propagate: str = "modified", states: StateStore | None = None,
            desc: str = "blocks", until: int | None = None) -> list[torch.Tensor]:
        """Run every block in order and return the last block's outputs.

        ``on_block(index, inputs)`` is called before block ``index`` runs and may change
        it (prune, collect statistics); if it returns a list of tensors, those are taken
        as the changed block's outputs (it ran the block itself, see :meth:`sequential`).
        ``propagate="dense"`` passes on the outputs the block had before ``on_block``;
        ``"modified"`` those after. ``states`` receives the hidden state at every boundary
        ``0..L`` (boundary ``i`` = input of block ``i``).
        ``until``: stop after block ``until`` and return its outputs.
        """
        if propagate not in ("dense", "modified"):
            raise ValueError(f"propagate must be 'dense' or 'modified', got {propagate!r}")
        self.ensure_captured()
        hidden = list(self.inputs)
        n = self.adapter.num_blocks if until is None else min(until + 1,
                                                                 self.adapter.num_blocks)
        if states is not None:
            states.put(0, hidden)
        for i in progress(range(n), total=n, desc=desc):
            dense = self.run_block(i, hidden) if propagate == "dense" else None
            result = None
            if on_block is not None:
                with self._on_device(self.adapter.block(i)):  # the method's maths too
                    result = on_block(i, hidden)
            if dense is not None:
                hidden = dense
            elif isinstance(result, list):  # on_block already ran the changed block
                hidden = result
            else:
                hidden = self.run_block(i, hidden)
            if states is not None:
                states.put(i + 1, hidden)
        return hidden

    @torch.no_grad()
    def tap(self, index: int, hidden: Sequence[torch.Tensor], taps: dict[str, nn.Module],
            what: str = "output") -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Run block ``index`` and also return the outputs (or first inputs) of the
        modules in ``taps``, one tensor per batch. Hooks are removed on exit."""
        self.ensure_captured()
        seen: dict[str, list[torch.Tensor]] = {name: [] for name in taps}

        def hook_for(name):
            def hook(_module, inputs, output=None):
                value = inputs[0] if what == "input" else output
                value = value[0] if isinstance(value, tuple) else value
                seen[name].append(value.detach().to(self.store_device))
            return hook

        if what not in ("input", "output"):
            raise ValueError(f"what must be input or output, got {what!r}")
        handles = [m.register_forward_pre_hook(hook_for(n)) if what == "input"
                   else m.register_forward_hook(hook_for(n)) for n, m in taps.items()]
        try:
            outs = self.run_block(index, hidden)
        finally:
            for handle in handles:
                handle.remove()
        return outs, seen

    @contextlib.contextmanager
    def zeroed(self, modules: Sequence[nn.Module]):
        """Within the block, the outputs of ``modules`` are replaced by zeros (sublayer
        ablation). The hooks are always removed on exit."""
        def zero(_module, _inputs, output):
            if isinstance(output, tuple):
                return (torch.zeros_like(output[0]), *output[1:])
            return torch.zeros_like(output)

        handles = [m.register_forward_hook(zero) for m in modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @property
    def passes(self) -> float:
        """Block evaluations expressed in full passes over all batches and blocks."""
        return self.block_evals / max(len(self.batches) * self.adapter.num_blocks, 1)
