"""Pruning while healing: the prune events of ``HealConfig(prune="rep-lie" |
"cascadeflow")``.

Event ``e`` (1-based) happens after step ``e * prune_every``. Before it the LoRA delta is
merged into the weights (masked) and afterwards a fresh LoRA is built on the new shapes
(:meth:`prunelab.train.loop.HealRun.after_event`).

* ``rep-lie`` (:mod:`prunelab.pruning.width.rep_lie`): every block keeps, after event ``e``,
  ``round(W0 * (1 - min(e * prune_fraction, ratio)))`` FFN channels (a multiple of
  ``round_to``) or KV groups, the same count in every block (a plain config holds the
  result); the units removed are chosen by :meth:`RepLieTracker.choose` and sliced
  physically through the adapter (``slice_ffn`` / ``slice_kv_groups``), as ``prune width``
  does.
* ``cascadeflow`` (:mod:`prunelab.probes.cascadeflow`): each event deletes the block with
  the lowest mean accumulated gradient norm (``adapter.delete_blocks``), ``remove`` events.

Each event is logged (block numbers 0-based: current numbering and original position) so a
resumed run replays it on the freshly loaded student.
"""

from __future__ import annotations

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.log import info
from prunelab.probes.cascadeflow import FlowAccumulator
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.rep_lie import RepLieTracker
from prunelab.train.config import PRUNE_MODES
from prunelab.train.loop import PRUNE_EVENTS


def make_pruner(run):
    """The event controller of ``run.cfg.prune`` (``None`` without pruning)."""
    cfg = run.cfg
    if cfg.prune is None:
        return None
    need = cfg.prune_events() * cfg.prune_every
    if need >= run.total:
        raise ConfigError(f"--prune {cfg.prune}: {cfg.prune_events()} events every "
                          f"{cfg.prune_every} steps need more than {need} steps; the run "
                          f"has {run.total}")
    return RepLieEvents(run) if cfg.prune == "rep-lie" else FlowEvents(run)


class _Events:
    def __init__(self, run):
        self.planned = run.cfg.prune_events()

    def due(self, run) -> bool:
        done = len(run.events)
        return done < self.planned and run.step == (done + 1) * run.cfg.prune_every

    def done(self, run) -> bool:
        return len(run.events) >= self.planned


class RepLieEvents(_Events):
    """REP-LIE prune-while-tuning (see module docstring)."""

    def __init__(self, run):
        super().__init__(run)
        cfg, ad = run.cfg, run.lm.adapter
        if cfg.unit == "heads" and ad.head_geometry(0).num_kv_heads == 1:
            raise UnsupportedOperationError(f"{run.lm.spec} is multi-query: REP-LIE prunes "
                                            "whole KV groups")
        self.tracker = RepLieTracker(cfg.unit, "groups")
        self.start = [self._width(ad, i) for i in range(ad.num_blocks)]
        self.unstable = 0

    def _width(self, ad, i: int) -> int:
        return ad.ffn_width(i) if self.tracker.kind == "ffn" else \
            ad.head_geometry(i).num_kv_heads

    def _target(self, cfg, w0: int, e: int) -> int:
        frac = min(e * cfg.prune_fraction, cfg.ratio)
        if self.tracker.kind == "ffn":
            return S.round_width(w0, w0 * (1 - frac), cfg.round_to)
        return max(1, round(w0 * (1 - frac)))

    def after_backward(self, run) -> None:
        self.tracker.after_backward(run)

    def apply(self, run) -> dict:
        cfg, ad = run.cfg, run.lm.adapter
        e = len(run.events) + 1
        run.trainables.merge(keep=True)  # the learned delta stays; LoRA rebuilt after
        keep_all, unstable = {}, 0
        for i in range(ad.num_blocks):
            width = self._width(ad, i)
            k = width - self._target(cfg, self.start[i], e)
            drop, n_unstable = self.tracker.choose(i, k, cfg.stability)
            unstable += n_unstable
            keep = [u for u in range(width) if u not in set(drop)]
            self._slice(ad, i, keep)
            self.tracker.on_slice(i, keep)
            keep_all[i] = keep
        self.unstable += unstable
        info(f"prunelab: rep-lie event {e} at step {run.step}: {self.tracker.kind} width "
             f"{self._width(ad, 0)} per block ({unstable} units taken without stability)")
        return {"step": run.step, "kind": self.tracker.kind, "keep": keep_all,
                "unstable_taken": unstable}

    def _slice(self, ad, i: int, keep: list[int]) -> None:
        if len(keep) == self._width(ad, i):
            return
        if self.tracker.kind == "ffn":
            ad.slice_ffn(i, keep)
        else:
            ad.slice_kv_groups(i, keep)

    def replay(self, run, event: dict) -> None:
        for i, keep in event["keep"].items():
            self._slice(run.lm.adapter, int(i), list(keep))

    def report(self, run) -> dict:
        ad = run.lm.adapter
        return {"method": "rep-lie", "unit": self.tracker.kind, "ratio": run.cfg.ratio,
                "events": [{k: v for k, v in e.items() if k != "keep"} for e in run.events],
                "width_before": self.start, "width_after": [self._width(ad, i) for i in
                                                            range(ad.num_blocks)],
                "unstable_taken": self.unstable,
                "rank_stability": self.tracker.rank_stability()}

    def history(self, run) -> list[dict]:
        if not run.events:
            return []
        return [{"operation": "prune-width", "method": "rep-lie",
                 "config": {"unit": self.tracker.kind, "ratio": run.cfg.ratio,
                            "prune_every": run.cfg.prune_every,
                            "prune_fraction": run.cfg.prune_fraction}}]

    def state_dict(self) -> dict:
        return {"tracker": self.tracker.state_dict(), "unstable": self.unstable}

    def load_state_dict(self, d: dict) -> None:
        self.tracker.load_state_dict(d["tracker"])
        self.unstable = d["unstable"]


class FlowEvents(_Events):
    """CascadeFlow block removal during healing (see module docstring)."""

    def __init__(self, run):
        super().__init__(run)
        n = run.lm.adapter.num_blocks
        if self.planned >= n:
            raise ConfigError(f"--budget remove-blocks:{self.planned}: the model has {n} blocks")
        self.acc = FlowAccumulator(run.cfg.flow_measure)
        self.start_positions = list(run.positions)

    def attach(self, run) -> None:
        self.acc.attach(run)

    def detach(self, run) -> None:
        self.acc.detach(run)

    def after_backward(self, run) -> None:
        self.acc.after_backward(run)

    def apply(self, run) -> dict:
        values = self.acc.values()
        index = min(range(len(values)), key=lambda i: (values[i], i))
        run.trainables.merge(keep=True)
        original = run.positions[index]
        self._delete(run, index)
        info(f"prunelab: cascadeflow event {len(run.events) + 1} at step {run.step}: "
             f"removed block {index} (original {original}; mean gradient "
             f"{values[index]:.3g})")
        return {"step": run.step, "kind": "blocks", "removed": index, "original": original,
                "value": values[index]}

    def _delete(self, run, index: int) -> None:
        run.lm.adapter.delete_blocks([index])
        del run.positions[index]
        self.acc.on_delete(run, index)

    def replay(self, run, event: dict) -> None:
        run.lm.adapter.delete_blocks([int(event["removed"])])
        if self.acc.sums:
            del self.acc.sums[int(event["removed"])]

    def report(self, run) -> dict:
        return {"method": "cascadeflow", "measure": self.acc.measure,
                "events": run.events, "removed_original": [e["original"] for e in run.events],
                "profile": self.acc.values()}

    def history(self, run) -> list[dict]:
        if not run.events:
            return []
        # removed blocks in the numbering of the model the heal started from
        removed = sorted(self.start_positions.index(e["original"]) for e in run.events)
        return [{"operation": "prune-depth", "method": "cascadeflow",
                 "config": {"remove": run.cfg.remove, "every": run.cfg.prune_every,
                            "measure": self.acc.measure},
                 "removed_blocks": removed, "recovery": "none"}]

    def state_dict(self) -> dict:
        return self.acc.state_dict()

    def load_state_dict(self, d: dict) -> None:
        self.acc.load_state_dict(d)


for _mode in PRUNE_MODES:  # the training loop builds its controller from this table
    PRUNE_EVENTS[_mode] = make_pruner
