"""One block changed group by group in about one pass (:meth:`BlockRunner.sequential`).

A block's linears are changed (pruned) in execution order, group by group (``[q, k, v]``
-> ``o`` -> ``[gate, up]`` -> ``down``); each group's input statistics are gathered over
every batch with the earlier groups already changed (the sequential order of SparseGPT,
Frantar & Alistarh 2023). Run naively that is one partial block pass per group plus one
for the outputs. :class:`SequentialBlock` computes nothing twice that cannot have
changed, with four named steps:

* **record**: a module is *final* once every group linear inside it was changed; the next
  time it runs, its output is recorded (cloned) for every batch.
* **replay**: in later stages a recorded module does not compute; its forward returns a
  clone of its record (clones, so in-place operations downstream cannot corrupt it).
* **placeholder**: in its own stage a group's linears only need their inputs; they
  return zeros of the right shape instead of computing, and the stage stops once the
  inputs were seen.
* **substitute**: when a stage's group is one linear whose output a container (attention,
  MLP branch) returns as is (``o_proj``, ``down_proj``), the stage runs the container to
  its end; after the group changed, the container's record is its output with the
  placeholder replaced by the changed linear applied to the saved inputs, so attention
  runs once per batch.

Also here: :class:`SharedInputs`, which finds the linears of a group that read the very
same tensor (q/k/v; gate/up) so their statistics are computed once; the runner's
``collect`` uses it too. Hooks and replaced forwards are always removed (``try/finally``).
Free heap pages go back to the system after every group
(:func:`~prunelab.models.memory.release_free_memory`): the peak stays near the live memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from prunelab.calib.stats import Accumulator
from prunelab.models.linear import weight_out_in
from prunelab.models.memory import release_free_memory

_MISSING = object()
PLACEHOLDER = object()  # where a container returned its linear's placeholder


class StopBlock(Exception):
    """Raised by a hook to skip the rest of a block once all targets were seen."""


def clone(obj):
    """Deep copy of the tensors in ``obj`` (tensors, tuples, lists; others as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple):
        return tuple(clone(o) for o in obj)
    if isinstance(obj, list):
        return [clone(o) for o in obj]
    return obj


def as_list(accs: Accumulator | Sequence[Accumulator]) -> list[Accumulator]:
    """What a ``make(name)`` returned, as a list of accumulators."""
    return list(accs) if isinstance(accs, (list, tuple)) else [accs]


class SharedInputs:
    """Which target linears receive the very same input tensor during one block call.

    ``see(name, x)`` is called from each target's forward pre-hook. The first call for a
    name (normally batch 0) makes it follow the earliest fired name that got the same
    object (q/k/v share the normed hidden state, gate/up the MLP input) or lead itself;
    later calls check that the sharing still holds. ``share=False``: every name leads.
    """

    def __init__(self, share: bool = True):
        self.share = share
        self.leaders: dict[str, str] = {}
        self.fired: dict[str, torch.Tensor] = {}

    def new_call(self) -> None:
        """Forget the tensors of the previous block call (keep the leaders)."""
        self.fired.clear()

    def see(self, name: str, x: torch.Tensor) -> bool:
        """Record that ``name`` received ``x``; True when ``name`` leads (updates stats)."""
        leader = name
        if self.share:
            if name not in self.leaders:
                self.leaders[name] = next((n for n, t in self.fired.items()
                                           if t is x and self.leaders.get(n) == n), name)
            leader = self.leaders[name]
            if leader != name and self.fired.get(leader) is not x:
                raise RuntimeError(f"{name} no longer shares its input with {leader}")
        self.fired[name] = x
        return leader == name

    def leaders_seen(self) -> bool:
        """Every leader fired in this call (the followers add nothing new)."""
        return set(self.leaders.values()).issubset(self.fired)

    def lists(self, accs: dict[str, list[Accumulator]]) -> dict[str, list[Accumulator]]:
        """``{name: its leader's accumulators}``, a fresh list per name."""
        return {n: list(accs[self.leaders.get(n, n)]) for n in accs}


@dataclass
class _Stage:
    """What one stage (statistics of group ``g``, or the final pass) sees and keeps."""

    g: int
    targets: dict[str, nn.Module]
    accs: dict[str, list[Accumulator]] | None
    shared: SharedInputs = field(default_factory=SharedInputs)
    recording: dict[int, list] = field(default_factory=dict)
    sub: tuple[nn.Module, nn.Module] | None = None  # (container, its returned linear)
    outs: list[torch.Tensor] = field(default_factory=list)
    sub_inputs: list[torch.Tensor] = field(default_factory=list)
    sub_outs: list = field(default_factory=list)


class SequentialBlock:
    """Block ``index`` of ``runner`` changed group by group (see the module docstring).

    ``groups``: the block's linears in execution order; ``containers``: modules that hold
    a whole branch (attention, MLP), final-able and substitutable too.
    """

    def __init__(self, runner, index: int, hidden: Sequence[torch.Tensor],
                 groups: Sequence[dict[str, nn.Module]], containers: Sequence[nn.Module] = ()):
        self.runner, self.index, self.hidden, self.groups = runner, index, hidden, groups
        self.block = runner.adapter.block(index)
        self.candidates = self._final_after(groups, containers)
        self.container_ids = {id(c) for c in containers}
        self.records: dict[int, list] = {}
        self.batch = 0
        self.placeholders: dict[int, torch.Tensor] = {}

    @staticmethod
    def _final_after(groups, containers) -> list[tuple[nn.Module, int]]:
        """``(module, g)``: the module is final once group ``g`` was changed."""
        group_of = {id(m): g for g, group in enumerate(groups) for m in group.values()}
        candidates: list[tuple[nn.Module, int]] = []
        for module in [*(m for group in groups for m in group.values()), *containers]:
            inside = [group_of[id(m)] for m in module.modules() if id(m) in group_of]
            if inside and all(m is not module for m, _ in candidates):
                candidates.append((module, max(inside)))
        return candidates

    def run(self, make: Callable[[str], Accumulator | Sequence[Accumulator]] | None,
            on_group: Callable[[int, dict[str, list[Accumulator]]], None]
            ) -> list[torch.Tensor]:
        """Every group's statistics stage and ``on_group``, then the final pass; returns
        the changed block's outputs (one per batch)."""
        with self.runner._on_device(self.block):
            for g, group in enumerate(self.groups):
                accs: dict[str, list[Accumulator]] = {}
                stage = None
                if make is not None:
                    stage = self._stage(g, group, {n: as_list(make(n)) for n in group})
                    accs = stage.shared.lists(stage.accs)
                on_group(g, accs)
                accs = None  # the group's statistics (a Gram, its factor) die here, not
                if stage is not None:  # in the next stage or the final pass
                    stage.accs = None
                    self._substitute(stage)
                    stage = None  # its saved inputs must not outlive the stage
                release_free_memory()
            return self._stage(len(self.groups), {}, None).outs

    # ------------------------------------------------------------------ one stage
    def _stage(self, g: int, targets: dict[str, nn.Module], accs) -> _Stage:
        """One pass over every batch with groups ``< g`` final: record / replay the final
        modules, feed group ``g``'s inputs to ``accs`` (its linears are placeholders)."""
        stage = _Stage(g, targets, accs)
        final = [m for m, after in self.candidates if after < g]
        replayed = [m for m in final if id(m) in self.records]
        stage.recording = {id(m): [] for m in final if id(m) not in self.records}
        stage.sub = self._substitutable(g, targets)
        if stage.sub is not None:  # the container's record comes from _substitute: its
            inside = {id(m) for m in stage.sub[0].modules()}  # parts need none of their own
            stage.recording = {k: v for k, v in stage.recording.items() if k not in inside}
        overrides = [(m, self._replay(m)) for m in replayed]
        overrides += [(m, self._placeholder(m)) for m in targets.values()]
        hooks = [(m, "fwd", self._record(stage)) for m in final if id(m) in stage.recording]
        hooks += [(m, "pre", self._stat_hook(stage, n)) for n, m in targets.items()]
        if stage.sub is not None:
            hooks.append((stage.sub[0], "fwd", self._container_hook(stage)))
        with _forwards_replaced(overrides), _hooked(hooks):
            for b, h in enumerate(self.hidden):
                self.batch = b
                stage.shared.new_call()
                out = self.runner._call(self.block, self.index, b, h)
                if out is not None:
                    stage.outs.append(out)
        stage.shared.new_call()  # the last batch's inputs (saved once in sub_inputs)
        self.placeholders = {}
        for key, values in stage.recording.items():
            if len(values) == len(self.hidden):  # ran to completion on every batch
                self.records[key] = values
        self._drop_moot_records()
        return stage

    def _substitutable(self, g: int, targets) -> tuple[nn.Module, nn.Module] | None:
        """``(container, linear)`` when group ``g`` is one linear inside a container that
        becomes final with it and has no record yet."""
        if len(targets) != 1:
            return None
        (lin,) = targets.values()
        return next(((c, lin) for c, after in self.candidates
                     if after == g and id(c) in self.container_ids and id(c) not in self.records
                     and any(m is lin for m in c.modules())), None)

    # ------------------------------------------------------------------ the steps
    def _record(self, stage: _Stage) -> Callable:
        """Forward hook: a final module's output is kept (cloned) for this batch."""
        def hook(module, _args, output):
            stage.recording[id(module)].append(clone(output))
        return hook

    def _replay(self, module: nn.Module) -> Callable:
        """Forward of a recorded module: a clone of its record for the current batch."""
        values = self.records[id(module)]

        def replay(*_args, **_kwargs):
            return clone(values[self.batch])
        return replay

    def _placeholder(self, module: nn.Module) -> Callable:
        """Forward of a group linear in its own stage: zeros of its output's shape."""
        def placeholder(x, *_args, **_kwargs):
            out = torch.zeros((*x.shape[:-1], weight_out_in(module).shape[0]),
                              dtype=x.dtype, device=x.device)
            self.placeholders[id(module)] = out
            return out
        return placeholder

    def _stat_hook(self, stage: _Stage, name: str) -> Callable:
        """Pre-hook of a group linear: statistics (once per shared input), saved inputs
        for a substitution, and the early stop."""
        def hook(_module, inputs):
            x = inputs[0]  # the very object: q/k/v receive the same one
            if stage.shared.see(name, x):
                for acc in stage.accs[name]:
                    acc.update(x.detach())
            if stage.sub is not None:
                stage.sub_inputs.append(x.detach().clone())
            elif len(stage.shared.fired) == len(stage.targets) or (
                    self.batch > 0 and stage.shared.leaders_seen()):
                raise StopBlock  # later batches need only the leaders' inputs
        return hook

    def _container_hook(self, stage: _Stage) -> Callable:
        """Forward hook of the substituted container: keep its output's structure (the
        placeholder marked, not its zeros) and stop the block."""
        def hook(_module, _args, output):
            ph = self.placeholders.pop(id(stage.sub[1]), None)
            first = output[0] if isinstance(output, tuple) else output
            if ph is None or first is not ph:
                stage.sub_outs.append(None)
            else:
                stage.sub_outs.append((PLACEHOLDER, *output[1:])
                                      if isinstance(output, tuple) else PLACEHOLDER)
            raise StopBlock
        return hook

    def _substitute(self, stage: _Stage) -> None:
        """After the group changed: the container's records, placeholder replaced by the
        changed linear applied to the saved inputs."""
        n = len(self.hidden)
        outs, xs = stage.sub_outs, stage.sub_inputs
        if stage.sub is None or len(outs) != n or len(xs) != n \
                or any(o is None for o in outs):
            return
        container, linear = stage.sub
        values = []
        for b in range(n):
            out, x = outs[b], xs[b]
            xs[b] = outs[b] = None  # each saved input is freed once used
            y = linear(x)
            values.append((y, *clone(out[1:])) if isinstance(out, tuple) else y)
        self.records[id(container)] = values
        self._drop_moot_records()

    def _drop_moot_records(self) -> None:
        """A recorded module makes its children's records moot."""
        for m, _after in self.candidates:
            if id(m) in self.records:
                for child in m.modules():
                    if child is not m:
                        self.records.pop(id(child), None)


@contextlib.contextmanager
def _forwards_replaced(overrides: Sequence[tuple[nn.Module, Callable]]):
    """Within: each module's ``forward`` is the given function (instance attribute);
    after: whatever instance forward it had before, or none."""
    saved = {}
    try:
        for m, fn in overrides:
            saved[id(m)] = m.__dict__.get("forward", _MISSING)
            m.forward = fn
        yield
    finally:
        for m, _fn in overrides:
            if saved.get(id(m), _MISSING) is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.forward = saved[id(m)]


@contextlib.contextmanager
def _hooked(hooks: Sequence[tuple[nn.Module, str, Callable]]):
    """Within: forward hooks (``"fwd"``) and pre-hooks (``"pre"``) registered in order."""
    handles = []
    try:
        for m, kind, fn in hooks:
            handles.append(m.register_forward_hook(fn) if kind == "fwd"
                           else m.register_forward_pre_hook(fn))
        yield
    finally:
        for handle in handles:
            handle.remove()
