"""Depth pruning: remove whole blocks chosen by any probe, then recover in closed form.

``Depth(remove=3, select=Beam(width=3, seeds=12), recovery=Ghost(token_aware=True))``:
the selection strategy is a registered config of :mod:`prunelab.pruning.depth.strategies`
(``one-shot``, ``no-adjacent``, ``span``, ``iterative``, ``beam``, ``sleb``, ``blend``,
``last-n``, ``random``; default from the probe's kind), the recovery one of
:mod:`prunelab.pruning.depth.recoveries` (``none``, ``foldable``, ``boundary``: vanilla
checkpoints; ``ghost``, ``lra``: linear bridges, checkpoints load with
``trust_remote_code=True``). Names are accepted wherever a config is
(``Depth(remove=3, strategy="beam", recovery="ghost")``: the registered defaults), and
:func:`depth_from_cli` maps the flat command-line options onto them.

``granularity="sublayer"`` searches attention and MLP sub-blocks at a parameter budget
(:mod:`prunelab.pruning.depth.search_budget`); ``recovery_in_loop`` scores each candidate of
``beam`` / ``sleb`` / ``iterative`` after its recovery (:mod:`prunelab.pruning.depth.removal_plan`).

Recovery is fitted on calibration windows (float64 solves), targets = the dense model's
hidden state after each removed span; cuts are repaired in order, each seeing the repaired
model's actual state at the cut (:mod:`prunelab.pruning.depth.surgery`).
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.log import warn
from prunelab.models.size import model_size
from prunelab.probes import ProbeContext, ProbeResult
from prunelab.probes.base import PROBES, STREAMABLE_PROBES, make_config, options_for
from prunelab.probes.reliability import selection_stability
from prunelab.pruning.base import METHODS
from prunelab.pruning.depth.recoveries import RECOVERIES, Recovery
from prunelab.pruning.depth.search_budget import check_search_options
from prunelab.pruning.depth.selection import parse_sublayers
from prunelab.pruning.depth.strategies import STRATEGIES, SelectJob, Strategy
from prunelab.pruning.options import piece_from_flat
from prunelab.registry import check_range, strict_kwargs


def _help(text: str, default=None, budget: str | None = None, **kw):
    meta = {"help": text, **({"budget": budget} if budget else {})}
    if "default_factory" in kw:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta)


#: strategies that score candidate removals on the calibration windows (``search_windows``)
SEARCH_STRATEGIES = ("sleb", "beam", "iterative")


#: Depth recoveries fitted block by block (or none).
STREAMABLE_RECOVERIES = ("none", "foldable")

@METHODS.register("depth")
@dataclass(frozen=True)
class Depth:
    """Remove ``remove`` blocks (or enough to reach ``target_params``: a fraction of the
    parameters to keep when <= 1, else a parameter count; or exactly ``blocks``), chosen by
    ``select`` over ``probe`` (or a saved probe result ``from_probe``) and repaired by
    ``recovery``. ``select=None`` picks ``no-adjacent`` for pair probes, ``span`` for
    span/interval probes, else ``one-shot``. ``strategy`` is an alias of ``select`` for a
    name. ``window`` and ``seed`` go to the probes (``seed`` also seeds ``random``).
    ``bootstrap`` / ``max_instability``: see :func:`check_selection`."""

    remove: int | None = _help("number of blocks to remove", budget="remove-blocks")
    target_params: float | None = _help("parameters to keep: a fraction (<= 1) or a count",
                                        budget="keep-params")
    probe: str = _help("probe that ranks blocks (run on the calibration data)",
                       "block-influence")
    from_probe: str | None = _help("a saved DIR/NAME.json instead")
    select: Strategy | str | None = _help("selection strategy (default from the probe kind)")
    recovery: Recovery | str = _help("recovery at each cut", "none")
    window: int | None = _help("pair probes: |i - j| <= W", 1)
    seed: int = _help("random strategy and probe seed", 0)
    blocks: tuple = _help("explicit 0-based blocks, e.g. 3,5", default_factory=tuple)
    sublayers: tuple = _help("explicit 0-based sub-blocks, e.g. 5:attention,16:mlp "
                             "(implies granularity sublayer)", default_factory=tuple)
    bootstrap: int = _help("resamples of the windows re-deriving the removal set (0: off)",
                           200)
    max_instability: float = _help("warn when more than this share of the resamples gives "
                                   "another removal set", 0.5)
    granularity: str = _help("block, or sublayer: attention and MLP sub-blocks (budget in "
                             "parameters; see pruning.search_budget)", "block")
    recovery_in_loop: bool = _help("beam / sleb / iterative / validation: score each "
                                   "candidate after its recovery", False)
    recovery_holdout: float | None = _help(
        "recovery in the loop (sleb, beam): share of the calibration batches held out to "
        "score each candidate's fit, fitted on the rest (default 0.25; 0: fit and score on "
        "all)")
    search_windows: int | None = _help(
        "sleb / beam / iterative: score the candidates on the first N calibration windows "
        "only (default: all); the recovery after the search fits on all of them")
    strategy: InitVar[str | None] = None

    _registries = {"select": STRATEGIES, "recovery": RECOVERIES}

    def __post_init__(self, strategy):
        object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
        object.__setattr__(self, "sublayers", parse_sublayers(self.sublayers))
        given = [self.remove is not None, self.target_params is not None, bool(self.blocks),
                 bool(self.sublayers)]
        if sum(given) != 1:
            raise ConfigError("give exactly one of remove (--budget remove-blocks:N), "
                              "target_params (--budget keep-params:F), blocks (--blocks) "
                              "and sublayers (--sublayers)")
        if self.sublayers:
            object.__setattr__(self, "granularity", "sublayer")
        if self.remove is not None:
            check_range("remove", self.remove, 1, None, integer=True)
        if self.target_params is not None:
            check_range("target_params", self.target_params, 1e-9, None)
            if self.target_params == 1:
                raise ConfigError("target_params 1.0 (--budget keep-params:1) keeps every "
                                  "parameter: no block would be removed")
        check_range("bootstrap", self.bootstrap, 0, None, integer=True)
        check_range("max_instability", self.max_instability, 0.0, 1.0)
        choice = self.select
        if strategy is not None:
            if choice is not None:
                raise ConfigError("give strategy or select, not both")
            choice = strategy
        object.__setattr__(self, "select",
                           None if choice is None else STRATEGIES.make(choice))
        object.__setattr__(self, "recovery", RECOVERIES.make(self.recovery))
        explicit = "blocks (--blocks)" if self.blocks else \
            "sublayers (--sublayers)" if self.sublayers else None
        if explicit and (self.select is not None or self.from_probe):
            what = "strategy (--strategy)" if self.select is not None else \
                "from_probe (--from-probe)"
            raise ConfigError(f"{explicit} are chosen explicitly: {what} does not apply")
        if explicit and self.recovery_in_loop:
            raise ConfigError(f"{explicit} are chosen explicitly: --recovery-in-loop "
                              "applies to a search")
        if self.probe not in PROBES:
            raise ConfigError(f"unknown probe {self.probe!r}; available: "
                              f"{', '.join(PROBES.names())}")
        check_search_options(self)
        self._check_search_windows()
        if self.recovery_holdout is not None:
            check_range("recovery_holdout", self.recovery_holdout, 0.0, 0.9)
            name = None if self.select is None else STRATEGIES.name_of(self.select)
            if self.recovery_holdout > 0 and not (self.recovery_in_loop and
                                                  name in ("sleb", "beam")):
                raise ConfigError("--recovery-holdout applies to --recovery-in-loop with "
                                  "--strategy sleb or beam")

    def _check_search_windows(self) -> None:
        if self.search_windows is None:
            return
        check_range("search_windows", self.search_windows, 1, None, integer=True)
        name = None if self.select is None else STRATEGIES.name_of(self.select)
        if name not in SEARCH_STRATEGIES:
            raise ConfigError("--search-windows applies to --strategy "
                              f"{' / '.join(SEARCH_STRATEGIES)}")

    @property
    def holdout(self) -> float:
        """The resolved ``recovery_holdout``: 0.25 by default with recovery in the loop of
        sleb / beam, else 0 (see :func:`prunelab.pruning.depth.holdout.holdout_split`)."""
        if self.recovery_holdout is not None:
            return float(self.recovery_holdout)
        name = None if self.select is None else STRATEGIES.name_of(self.select)
        return 0.25 if self.recovery_in_loop and name in ("sleb", "beam") else 0.0

    @property
    def recovery_name(self) -> str:
        return RECOVERIES.name_of(self.recovery)

    def check_streamable(self) -> None:
        """``--stream``: block granularity, a streamable probe (or given blocks), a
        selection that evaluates no candidate model, a recovery fitted block by block."""
        rec = RECOVERIES.name_of(self.recovery) if self.recovery is not None else "none"
        if rec not in STREAMABLE_RECOVERIES:
            raise UnsupportedOperationError(
                f"--stream: depth recovery {rec} is not streamable; use "
                f"{' or '.join(STREAMABLE_RECOVERIES)}, or run without --stream")
        if not self.from_probe and not self.blocks and self.probe not in STREAMABLE_PROBES:
            raise UnsupportedOperationError(
                f"--stream: probe {self.probe} needs the whole model; streamable probes: "
                + ", ".join(STREAMABLE_PROBES))
        strategy = STRATEGIES.name_of(self.select) if self.select is not None else None
        if strategy not in (None, "one-shot", "no-adjacent", "span", "last-n"):
            raise UnsupportedOperationError(
                f"--stream: depth strategy {strategy} evaluates candidate models; use "
                "one-shot, no-adjacent, span or last-n, or run without --stream")
        if getattr(self, "granularity", "block") != "block":
            raise UnsupportedOperationError("--stream: depth supports --granularity block only")


def depth_from_cli(*, strategy: str | None = None, recovery: str | None = None,
                   **flat) -> Depth:
    """The :class:`Depth` config of the flat ``prunelab prune depth`` options.

    ``strategy`` / ``recovery`` name the pieces; the options of a piece
    (``beam_width``, ``beam_seeds``, ``beam_score``, ``blend_probe``; ``rank``,
    ``token_aware``, ``ridge``: see :func:`prunelab.pruning.options.flat_options`) go to it,
    and one given for a piece not chosen is a :class:`ConfigError`
    (``--rank applies to --recovery lra only``). ``None`` (and ``False`` for a switch)
    means "not given"; the rest are :class:`Depth` fields."""
    select, owned_s = piece_from_flat(STRATEGIES, strategy, flat, "--strategy")
    rec, owned_r = piece_from_flat(RECOVERIES, recovery or "none", flat, "--recovery")
    rest = {k: v for k, v in flat.items() if k not in owned_s | owned_r and v is not None}
    strict_kwargs(Depth, rest, "prune depth")
    return Depth(select=select, recovery=rec, **rest)


def blocks_to_remove(lm, cfg: Depth) -> int:
    """``n`` from ``remove`` or from the parameter target (blocks of equal size assumed:
    the smallest n that reaches the target)."""
    n_blocks = lm.adapter.num_blocks
    if cfg.blocks:
        return len(cfg.blocks)
    if cfg.sublayers:
        return len({b for b, _ in cfg.sublayers})
    if cfg.remove is not None:
        n = cfg.remove
    else:
        total = model_size(lm.model)["params"]
        per_block = sum(p.numel() for p in lm.adapter.block(0).parameters())
        target = cfg.target_params * total if cfg.target_params <= 1 else cfg.target_params
        if target >= total:
            raise ConfigError(f"--budget keep-params:{cfg.target_params:g}: the model already "
                              f"has {total:,} parameters (no block would be removed)")
        n = max(1, math.ceil((total - target) / per_block))
    if n >= n_blocks:
        raise ConfigError(f"cannot remove {n} of {n_blocks} blocks")
    return n


def default_strategy(result: ProbeResult | None) -> str:
    if result is None:
        return "one-shot"
    if result.kind == "pair":
        return "no-adjacent"
    if result.kind in ("span", "interval"):
        return "span"
    return "one-shot"


def run_probe(name: str, ctx, cfg: Depth, n: int) -> ProbeResult:
    """Probe ``name`` on ``ctx``; depth's ``window``, ``span`` (= n), ``max_length`` and
    ``seed`` are routed to the probe only where its config takes them."""
    opts = {"window": cfg.window, "span": n, "max_length": max(n, 1), "seed": cfg.seed}
    return make_config(name, **options_for(name, **opts)).run(ctx)


def _load_probe(path: str, num_blocks: int) -> ProbeResult:
    try:
        res = ProbeResult.load(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read probe result {path}: {exc}") from exc
    if res.num_blocks != num_blocks:
        raise ConfigError(f"{path} scores {res.num_blocks} blocks, the model has {num_blocks}")
    return res


def select(lm, cfg: Depth, ctx: ProbeContext, n: int,
           result: ProbeResult | None = None) -> tuple[list[int], dict]:
    """The blocks to remove (0-based, current numbering) and how they were chosen.
    ``result``: a probe result computed earlier on the same model (reused, not re-run)."""
    nb = lm.adapter.num_blocks
    if cfg.blocks:
        if any(not 0 <= b < nb for b in cfg.blocks) or len(set(cfg.blocks)) != len(cfg.blocks):
            raise ConfigError(f"blocks {list(cfg.blocks)} invalid for {nb} blocks")
        return sorted(cfg.blocks), {"strategy": "explicit"}

    sctx = ctx if cfg.search_windows is None else ctx.subset(cfg.search_windows)
    spent0 = sctx.block_evaluations

    def load() -> ProbeResult:
        return _load_probe(cfg.from_probe, nb) if cfg.from_probe else \
            run_probe(cfg.probe, sctx, cfg, n)

    job = SelectJob(lm, cfg, sctx, n, run_probe=lambda name, c, k: run_probe(name, c, cfg, k),
                    load_result=load, _result=result)
    strategy = cfg.select or STRATEGIES.make(default_strategy(job.result()))
    removed, how = strategy.choose(job)
    check_selection(strategy, job, removed, how)
    if sctx is not ctx:
        how = charge_subset_search(ctx, sctx, how, sctx.block_evaluations - spent0)
    return removed, how


def charge_subset_search(ctx: ProbeContext, sub: ProbeContext, how: dict,
                         spent: float) -> dict:
    """A search that ran on ``sub`` (``Depth.search_windows``): its block evaluations
    (``how``'s total and per step, and what it spent now, ``spent``) in units of ``ctx``'s
    windows, so that costs compare with searches on all of them. Returns a new ``how``
    (a shared greedy run keeps its own figures)."""
    how = dict(how)
    scale = len(sub.input_ids) / max(len(ctx.input_ids), 1)
    ctx.charge(sub, spent)
    how["search_windows"] = len(sub.input_ids)
    for key in ("block_evaluations", "cache_block_evaluations"):
        if key in how:
            how[key] = how[key] * scale
    if "steps" in how:
        how["steps"] = [{**step, "block_evaluations": step["block_evaluations"] * scale}
                        if "block_evaluations" in step else step for step in how["steps"]]
    return how


#: strategies whose choice is a pure function of the probe's scores (re-derived per resample)
RESAMPLED_STRATEGIES = ("one-shot", "no-adjacent", "span")


def check_selection(strategy: Strategy, job: SelectJob, removed: list[int], how: dict) -> None:
    """For a strategy of :data:`RESAMPLED_STRATEGIES` over a probe with per-window values:
    re-derive the removal set on ``cfg.bootstrap`` resamples of the calibration windows
    (:func:`prunelab.probes.reliability.selection_stability`, seeded by ``cfg.seed``),
    record ``how["selection_stability"]`` (``share_same``, per-block ``inclusion``) and log
    one warning line when the share of resamples giving another set exceeds
    ``cfg.max_instability`` (default 0.5: the chosen set is then not even the likelier
    outcome of another calibration sample of the same size; at 200 resamples the share's
    standard error is at most 0.035, well inside that margin)."""
    cfg = job.cfg
    if STRATEGIES.name_of(strategy) not in RESAMPLED_STRATEGIES or cfg.bootstrap < 1:
        return
    stab = selection_stability(job.result(), lambda rep: strategy.pick(
        job, rep, rep.layer_values(), {}), removed, n=cfg.bootstrap, seed=cfg.seed)
    if stab is None:
        return
    how["selection_stability"] = stab
    if 1.0 - stab["share_same"] > cfg.max_instability:
        warn(f"blocks {sorted(removed)} are not stable under the bootstrap of the "
             f"calibration windows: only {stab['share_same']:.0%} of {stab['bootstrap']} "
             "resamples give the same set (more --samples, or another probe)")
