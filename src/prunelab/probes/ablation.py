"""Ablation probes: leave one block out, or zero one sublayer's residual contribution.

* ``leave-one-out`` (CausalGate; the Whisper-encoder layer study; derived): the model with
  block ``i`` removed, ``E_x KL(p_M || p_{M without i})``; ascending = removable. The run
  starts from the cached input of block ``i`` and continues with blocks ``i+1..L-1``.
* ``sublayer-ablation``: block ``i`` with its attention (or MLP) residual branch zeroed;
  attention and MLP are reported as separate scores (``sublayer`` field).

``value`` is the last-position KL, ``value_all_positions`` the mean over all positions (see
:mod:`prunelab.probes.context`); ``windows`` and ``windows_all_positions`` hold the same per
calibration window (for :mod:`prunelab.probes.reliability`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.log import progress
from prunelab.probes.base import PROBES, ProbeResult, config_dict
from prunelab.probes.task_ablation import leave_one_out_by_metric


@PROBES.register("leave-one-out", resumable=True)
@dataclass(frozen=True)
class LeaveOneOut:
    """Divergence to dense with one block removed (KL; 1 - cos for encoders); with
    ``metric`` (a registered task metric, e.g. ``wer``) the change of that metric instead
    (:mod:`prunelab.probes.task_ablation`; ``metric_data``: its data)."""

    metric: str | None = field(default=None, metadata={"help": (
        "rank blocks by the change of this task metric (e.g. wer) instead of the "
        "divergence to the dense model")})
    metric_data: str | None = field(default=None, metadata={"help": (
        "--metric: its data (wer: speech spec or folder; default speech:synth-calib)")})

    def run(self, ctx, resume=None, on_progress=None) -> ProbeResult:
        n = ctx.num_blocks
        if self.metric:
            scores = leave_one_out_by_metric(self, ctx, resume, on_progress)
            return ProbeResult("leave-one-out", config_dict(self), scores, kind="layer",
                               num_blocks=n)
        done = {s["layers"][0]: s for s in (resume or {}).get("scores", [])}
        scores = [done[i] for i in sorted(done)]
        for i in progress([i for i in range(n) if i not in done], desc="leave-one-out"):
            per = ctx.divergence_windows(ctx.run_stack(i, range(i + 1, n)))
            scores.append({"layers": [i], **per.entry()})
            if on_progress is not None:
                on_progress(sorted(scores, key=lambda s: s["layers"]))
        scores.sort(key=lambda s: s["layers"])
        return ProbeResult("leave-one-out", config_dict(self), scores, kind="layer", num_blocks=n)


@PROBES.register("sublayer-ablation", resumable=True)
@dataclass(frozen=True)
class SublayerAblation:
    """Divergence to dense with one block's attention or MLP residual branch zeroed."""

    def run(self, ctx, resume=None,
                              on_progress=None) -> ProbeResult:
        n = ctx.num_blocks
        scores = list((resume or {}).get("scores", []))
        done = {(s["layers"][0], s["sublayer"]) for s in scores}
        todo = [(i, part) for i in range(n) for part in ("attention", "mlp")
                if (i, part) not in done]
        for i, part in progress(todo, desc="sublayer-ablation"):
            module = ctx.adapter.residual_branches(i)[part]
            with ctx.runner.zeroed([module]):
                h = ctx.run_stack(i, [i])
            per = ctx.divergence_windows(ctx.run_stack(i + 1, range(i + 1, n), hidden=h))
            scores.append({"layers": [i], "sublayer": part, **per.entry()})
            if on_progress is not None:
                on_progress(scores)
        scores.sort(key=lambda s: (s["layers"], s["sublayer"]))
        return ProbeResult("sublayer-ablation", config_dict(self), scores, kind="sublayer",
                           num_blocks=n)
