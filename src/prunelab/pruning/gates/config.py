"""Static sublayer gates from interventions (CausalGate, an unpublished proposal, written up
in prunelab's method notes: "an exponential-moving-average smoothing of the measured
importances plus a differentiable pairwise ranking loss", distilling the intervention
hierarchy into one scalar gate per sublayer so that a compute budget maps to a set of
skipped sublayers).

What is implemented (``prunelab.prune(lm, Gates(budget=0.2), data)``):

1. Interventions: for every attention and every MLP branch still present, the branch's
   output is zeroed (as the ``sublayer-ablation`` probe does, from the cached input of its
   block) and the KL to the dense model, ``KL(p_dense || p_zeroed)``, is kept per
   calibration window: the mean over all positions of the window (``positions="all"``; its
   mean over windows is the probe's ``value_all_positions``) or at its last position
   (``"last"``: the probe's ``value``).
2. Rounds and EMA, ranking loss, gate fit: :mod:`prunelab.pruning.gates.fit` (``rounds``
   bootstrap resamples of the windows, EMA with ``ema`` as decay, targets the standardised
   log importances, logistic loss with temperature ``tau`` on every ordered pair, weight
   ``rank_weight``, Adam from equal gates, ``steps`` steps at ``lr``).
3. Budget: the compute of a sublayer is its FLOPs per token
   (:func:`prunelab.models.custom.flops_per_token` of the branch: q/k/v/o projections,
   gate/up/down; norms not counted); ``attention_scores=True`` adds the attention score and
   value FLOPs at the calibration length ``T``, ``2 H d_h (T + 1)`` per token (the mean over
   the causal positions of ``4 H d_h (t + 1)``; sliding windows counted as full). The budget
   is the fraction of the total sublayer compute present before pruning that is skipped
   (embeddings and the head are not sublayer compute). ``select="per-flop"`` (default)
   covers it knapsack-greedily in ascending estimated importance per FLOP,
   ``log(importance) - log(FLOPs)`` with the log importance read back from the gate
   (``mu + sd * g``); ``"order"`` in ascending gate. Both then drop every chosen sublayer
   the budget does not need (:func:`~prunelab.pruning.gates.fit.cover_budget`), so the set
   reaches the budget and no sublayer of it could be kept.
4. The chosen branches are removed for real (:func:`prunelab.models.sublayer.remove_sublayers`:
   zero branch, identity norms; a block losing both is deleted). Partial blocks make a
   remote-code checkpoint; only whole blocks keep it plain.

Departures from the seed: the gates are static (one per sublayer, no input dependence)
and binary at inference (a gate below the cut is a removed branch, never a scaled one);
the EMA runs over bootstrap resamples of one set of interventions (not over training
steps), which re-measures nothing and costs no extra forward pass; the importances are
single-sublayer interventions (no re-measurement after removals), and the gate ordering
is fitted, not learnt jointly with the model.

Baselines at equal skipped compute (the same cover, other keys):
:func:`plan_probe_greedy` (ascending mean KL, plain order) and :func:`plan_blocks` (whole
blocks in ascending score of a depth probe, ``block-influence`` by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import torch

from prunelab.checkpoint.remote import needs_remote_code
from prunelab.errors import ConfigError
from prunelab.eval.divergence import kl_from_logits, kl_from_logits_float64
from prunelab.eval.speed import measure_speed
from prunelab.log import progress
from prunelab.models.custom import flops_per_token
from prunelab.models.size import size_summary
from prunelab.models.sublayer import PARTS, branch_paths, remove_sublayers
from prunelab.probes.base import make_config
from prunelab.probes.context import ProbeContext
from prunelab.pruning.base import METHODS, PRUNERS, DictReport, Pruner
from prunelab.pruning.gates.fit import bootstrap_rounds, cover_budget, ema_smooth, fit_gates
from prunelab.registry import check_range

SELECTS = ("per-flop", "order")
POSITIONS = ("all", "last")


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@METHODS.register("gates")
@dataclass(frozen=True)
class Gates:
    """CausalGate static sublayer gates (module docstring); removes the sublayers whose
    gates fall below the cut that skips ``budget`` of the sublayer compute."""

    budget: float = field(default=0.2, metadata=_help(
        "fraction of the sublayer compute (FLOPs per token) skipped, in [0, 1)",
        budget="remove-compute"))
    ema: float = field(default=0.9, metadata=_help(
        "EMA decay over the measurement rounds, in [0, 1)"))
    rank_weight: float = field(default=1.0, metadata=_help(
        "weight of the pairwise ranking loss"))
    tau: float = field(default=1.0, metadata=_help("ranking loss temperature"))
    steps: int = field(default=300, metadata=_help("Adam steps of the gate fit (at least 1)"))
    lr: float = field(default=0.05, metadata=_help("Adam learning rate of the gate fit"))
    rounds: int = field(default=8, metadata=_help(
        "bootstrap resamples of the calibration windows (1: their plain mean)"))
    seed: int = field(default=0, metadata=_help("bootstrap seed"))
    select: str = field(default="per-flop", metadata=_help(
        "per-flop: cover the budget by importance per FLOP; order: by gate alone"))
    positions: str = field(default="all", metadata=_help(
        "all: KL averaged over every position; last: at the last position of a window"))
    attention_scores: bool = field(default=False, metadata=_help(
        "count attention score FLOPs at the calibration length in the budget"))

    def __post_init__(self) -> None:
        check_range("budget", self.budget, 0.0, 1.0)
        if self.budget >= 1.0 or self.budget == 0:
            raise ConfigError(f"budget must be in (0, 1), got {self.budget!r}"
                              + (" (0 skips no sublayer)" if self.budget == 0 else ""))
        check_range("ema", self.ema, 0.0, 1.0)
        if self.ema >= 1.0:
            raise ConfigError(f"ema must be in [0, 1), got {self.ema!r}")
        check_range("rank_weight", self.rank_weight, 0.0, 1e6)
        check_range("tau", self.tau, 1e-6, 1e6)
        check_range("steps", self.steps, 1, 1_000_000, integer=True)  # 0: no fit
        check_range("lr", self.lr, 1e-9, 10.0)
        check_range("rounds", self.rounds, 1, 100_000, integer=True)
        check_range("seed", self.seed, 0, None, integer=True)
        if self.select not in SELECTS:
            raise ConfigError(f"select must be one of {', '.join(SELECTS)}, got {self.select!r}")
        if self.positions not in POSITIONS:
            raise ConfigError(f"positions must be one of {', '.join(POSITIONS)}, got "
                              f"{self.positions!r}")
        if not isinstance(self.attention_scores, bool):
            raise ConfigError(f"attention_scores must be true or false, got "
                              f"{self.attention_scores!r}")


# ---------------------------------------------------------------------- measurement
def check_family(lm) -> None:
    """Raise the one-line :class:`UnsupportedOperationError` of families without separable
    attention / MLP branches (GPT-2, GPT-NeoX, OPT, encoders)."""
    branch_paths(lm.adapter, 0, "attention")


def present_sublayers(adapter) -> list[tuple[int, str]]:
    """``(block, part)`` of every branch still present, in stack order."""
    return [(i, p) for i in range(adapter.num_blocks) for p in PARTS
            if adapter.has_branch(i, p)]


def sublayer_flops(adapter, sublayers: list[tuple[int, str]], context: int = 0) -> list[int]:
    """FLOPs per token of each branch (module docstring); ``context > 0`` adds the attention
    score and value FLOPs ``2 H d_h (context + 1)`` to attention branches."""
    out = []
    for i, part in sublayers:
        branch = adapter.residual_branches(i)[part]
        f = int(flops_per_token(branch))
        if part == "attention" and context > 0:
            geo = adapter.head_geometry(i)
            f += 2 * geo.num_heads * geo.head_dim * (int(context) + 1)
        out.append(f)
    return out


@dataclass
class Measurement:
    """Per-window intervention KLs ``kl`` ``[S, N]`` of ``sublayers``, their FLOPs."""

    sublayers: list[tuple[int, str]]
    kl: torch.Tensor
    flops: list[int]
    positions: str

    @property
    def mean_kl(self) -> torch.Tensor:
        return self.kl.mean(1)


@torch.no_grad()
def _window_kls(ctx, final_raw: list[torch.Tensor], positions: str) -> torch.Tensor:
    """``[N]`` KL to dense per window of a modified stack's raw last-block output."""
    dev = ctx.runner.device
    vals = []
    for b, h in enumerate(final_raw):
        ref = ctx._ref(b).to(dev)  # the context's cached dense logits of batch b
        logits = ctx.adapter.logits(ctx._final(h.to(dev)))
        for r in range(h.shape[0]):
            if positions == "last":
                vals.append(float(kl_from_logits_float64(ref[r, -1], logits[r, -1])))
            else:
                vals.append(float(kl_from_logits(ref[r], logits[r]).double().mean()))
    return torch.tensor(vals, dtype=torch.float64)


@torch.no_grad()
def measure_sublayers(lm, input_ids, *, batch_size: int = 8, positions: str = "all",
                      attention_scores: bool = False, ctx=None) -> Measurement:
    """Zero each present branch in turn (from its block's cached input) and keep the KL to
    dense of every calibration window; ``ctx``: a :class:`ProbeContext` to reuse."""
    check_family(lm)
    own = ctx is None
    ctx = ctx or ProbeContext(lm, input_ids, batch_size=batch_size)
    try:
        n = ctx.num_blocks
        subs = present_sublayers(lm.adapter)
        rows = []
        for i, part in progress(subs, desc="sublayer interventions"):
            module = ctx.adapter.residual_branches(i)[part]
            with ctx.runner.zeroed([module]):
                h = ctx.run_stack(i, [i])
            rows.append(_window_kls(ctx, ctx.run_stack(i + 1, range(i + 1, n), hidden=h),
                                    positions))
    finally:
        if own:
            ctx.close()
    context = int(torch.as_tensor(input_ids).shape[1]) if attention_scores else 0
    kl = torch.stack(rows) if rows else torch.zeros(0, int(torch.as_tensor(input_ids).shape[0]))
    return Measurement(subs, kl, sublayer_flops(lm.adapter, subs, context), positions)


# ---------------------------------------------------------------------- plans
@dataclass
class Plan:
    """Sublayers to remove (``[(block, part)]``), the compute they skip and how they were
    chosen (``details``: gates, keys...)."""

    method: str
    sublayers: list[tuple[int, str]]
    skipped_flops: int
    total_flops: int
    budget: float
    details: dict = field(default_factory=dict)

    @property
    def achieved(self) -> float:
        """Skipped fraction of the sublayer compute (exact ratio, rounded once)."""
        return float(Fraction(self.skipped_flops, self.total_flops)) if self.total_flops \
            else 0.0


def _cover(keys, costs: list[int], budget: float) -> list[int]:
    """Cover ``budget`` exactly: the budget read as the decimal it prints as (0.1 is 1/10,
    not the binary float just above it), times the total compute."""
    total = sum(costs)
    try:
        return cover_budget(keys, costs, Fraction(repr(float(budget))) * total)
    except ValueError:
        raise ConfigError(f"budget {budget} cannot be reached") from None


def _plan(method: str, meas: Measurement, picks: list[int], budget: float,
          details: dict) -> Plan:
    subs = [meas.sublayers[s] for s in picks]
    return Plan(method, subs, sum(meas.flops[s] for s in picks), sum(meas.flops), budget,
                details)


def plan_gates(meas: Measurement, cfg: Gates) -> Plan:
    """Fit the gates on ``meas`` and cover ``cfg.budget`` (module docstring)."""
    rounds = bootstrap_rounds(meas.kl, cfg.rounds, cfg.seed)
    importance = ema_smooth(rounds, cfg.ema)
    fit = fit_gates(importance, rank_weight=cfg.rank_weight, tau=cfg.tau, steps=cfg.steps,
                    lr=cfg.lr)
    if cfg.select == "per-flop":
        logf = torch.log(torch.tensor(meas.flops, dtype=torch.float64).clamp_min(1))
        keys = (fit.scale.to_log_importance(fit.gates) - logf).tolist()
    else:
        keys = fit.gates.tolist()
    picks = _cover(keys, meas.flops, cfg.budget)
    table = [{"layers": [i], "sublayer": p, "kl": float(meas.mean_kl[s]),
              "importance": float(importance[s]), "gate": float(fit.gates[s]),
              "flops": meas.flops[s], "removed": s in picks}
             for s, (i, p) in enumerate(meas.sublayers)]
    return _plan("gates", meas, picks, cfg.budget, {"gates": table,
                                                    "objective": fit.objective})


def plan_probe_greedy(meas: Measurement, budget: float) -> Plan:
    """Baseline: ascending mean intervention KL alone (plain order, no gates, no FLOP
    weighting), the same cover."""
    picks = _cover(meas.mean_kl.tolist(), meas.flops, budget)
    return _plan("probe-greedy", meas, picks, budget, {})


def block_scores(ctx, probe: str = "block-influence") -> list[float]:
    """Per-block score of a layer-kind depth probe on ``ctx`` (ascending = removable)."""
    res = make_config(probe).run(ctx)
    if res.kind != "layer":
        raise ConfigError(f"block baseline needs a per-block probe, {probe} is {res.kind}")
    return [float(v) for v in res.layer_values()]


def plan_blocks(meas: Measurement, scores: list[float], budget: float,
                probe: str = "block-influence") -> Plan:
    """Baseline: whole blocks in ascending probe ``scores`` until their sublayer compute
    covers ``budget`` (both branches of each chosen block)."""
    blocks = sorted({i for i, _ in meas.sublayers})
    cost = {b: 0 for b in blocks}
    for (i, _), f in zip(meas.sublayers, meas.flops, strict=True):
        cost[i] += f
    picks = _cover([scores[b] for b in blocks], [cost[b] for b in blocks], budget)
    chosen = [blocks[k] for k in picks]
    idx = [s for s, (i, _) in enumerate(meas.sublayers) if i in chosen]
    return _plan("blocks", meas, idx, budget, {"blocks": chosen, "probe": probe})


def apply_plan(lm, plan: Plan) -> dict:
    """Remove ``plan``'s sublayers from ``lm`` for real; the removal record plus the
    achieved budget."""
    ad, chosen = lm.adapter, set(plan.sublayers)
    if all(not ad.has_branch(i, p) or (i, p) in chosen
           for i in range(ad.num_blocks) for p in PARTS):
        raise ConfigError(f"budget {plan.budget} would remove every block")
    rec = remove_sublayers(lm, plan.sublayers)
    return {**rec, "budget": plan.budget, "achieved": plan.achieved,
            "skipped_flops": plan.skipped_flops, "sublayer_flops": plan.total_flops}


# ---------------------------------------------------------------------- the method
@PRUNERS.register(Gates)
class GatesPruner(Pruner):
    """CausalGate: measure, fit, cover the budget, remove; reports sizes before/after."""

    operation = "prune-gates"

    def precheck(self, lm, config: Gates) -> None:
        check_family(lm)

    def run(self, lm, config: Gates, input_ids, *, batch_size: int) -> DictReport:
        before = size_summary(lm.model)
        meas = measure_sublayers(lm, input_ids, batch_size=batch_size,
                                 positions=config.positions,
                                 attention_scores=config.attention_scores)
        plan = plan_gates(meas, config)
        rec = apply_plan(lm, plan)
        after = size_summary(lm.model)
        values = {
            "removed_sublayers": [[i, p] for i, p in plan.sublayers],
            "deleted_blocks": rec["deleted_blocks"],
            "budget": config.budget, "achieved": plan.achieved,
            "skipped_flops": plan.skipped_flops, "sublayer_flops": plan.total_flops,
            "params_before": before["params"], "params_after": after["params"],
            "flops_per_token_before": before["flops_per_token"],
            "flops_per_token_after": after["flops_per_token"],
            "needs_remote_code": needs_remote_code(lm.model),
            **plan.details,
        }
        keys = ("removed_sublayers", "deleted_blocks", "budget", "achieved", "skipped_flops",
                "sublayer_flops", "params_before", "params_after", "flops_per_token_before",
                "flops_per_token_after", "needs_remote_code")
        return DictReport(values, history_keys=keys)


def latency_vs_dense(dense_lm, lm, *, prompt_len: int = 256, rounds: int = 2,
                     repeats: int = 3) -> dict:
    """Measured prefill of ``lm`` and ``dense_lm`` back to back (alternating, best of
    ``rounds``; :func:`prunelab.eval.speed.measure_speed`, median of ``repeats``):
    tokens/s, seconds per prompt and the speed-up."""
    d, g = [], []
    for _ in range(rounds):
        for runs, model in ((d, dense_lm), (g, lm)):
            runs.append(measure_speed(model, prompt_len=prompt_len, decode_tokens=1,
                                      repeats=repeats)["prefill_tokens_per_s"])
    dense, gated = max(d), max(g)
    return {"prefill_tokens_per_s": gated, "dense_prefill_tokens_per_s": dense,
            "prefill_seconds": prompt_len / gated, "dense_prefill_seconds": prompt_len / dense,
            "prefill_speedup": gated / dense, "prompt_len": prompt_len}
