"""Depth pruning: remove whole blocks chosen by any probe, then recover in closed form.

Selection strategies are in :mod:`prunelab.pruning.selection` (plus ``iterative``: re-probe
after each removal, and ``beam``: width ``beam_width``, seeded with the ``beam_seeds`` most
removable blocks, candidate sets scored by calibration KL or perplexity of the model
without them; "No Free Swap" uses width 3 and 12 seeds).

Recovery (fitted on calibration windows, float64 solves, targets = the dense model's hidden
state after each removed span; cuts are repaired in order, each seeing the repaired model's
actual state at the cut): ``none``; ``foldable`` and ``boundary``
(:mod:`prunelab.pruning.recovery`: vanilla checkpoints, no extra parameters); ``ghost`` and
``lra`` (:mod:`prunelab.pruning.bridges`: one small linear module per contiguous removed span;
checkpoints carry a modeling file and load with ``trust_remote_code=True``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.log import progress
from prunelab.models.size import model_size
from prunelab.probes import ProbeContext, ProbeResult
from prunelab.probes.base import REGISTRY, make_config, options_for, probe_spec
from prunelab.registry import check_range
from prunelab.pruning import selection as sel

STRATEGIES = ("one-shot", "no-adjacent", "span", "iterative", "beam", "blend", "last-n",
              "random")
RECOVERIES = ("none", "foldable", "boundary", "ghost", "lra")


@dataclass(frozen=True)
class Depth:
    """Remove ``remove`` blocks (or enough to reach ``target_params``: a fraction of the
    parameters to keep when <= 1, else a parameter count). ``strategy`` defaults to
    ``no-adjacent`` for pair probes, ``span`` for span/interval probes, else ``one-shot``."""

    remove: int | None = None
    target_params: float | None = None
    probe: str = "block-influence"
    from_probe: str | None = None
    strategy: str | None = None
    recovery: str = "none"
    rank: int | None = None
    token_aware: bool = False
    ridge: float = 1e-6
    blend_probe: str = "contraction"
    beam_width: int = 3
    beam_seeds: int = 12
    beam_score: str = "kl"
    window: int | None = 1
    seed: int = 0
    blocks: tuple = field(default_factory=tuple)

    def __post_init__(self):
        if (self.remove is None) == (self.target_params is None) and not self.blocks:
            raise ConfigError("give exactly one of remove (--remove) and target_params "
                              "(--target-params)")
        if self.remove is not None:
            check_range("remove", self.remove, 1, None, integer=True)
        if self.target_params is not None:
            check_range("target_params", self.target_params, 1e-9, None)
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, "
                              f"got {self.strategy!r}")
        if self.recovery not in RECOVERIES:
            raise ConfigError(f"recovery must be one of {', '.join(RECOVERIES)}, "
                              f"got {self.recovery!r}")
        for name in (self.probe, self.blend_probe):
            if name not in REGISTRY:
                raise ConfigError(f"unknown probe {name!r}; available: {', '.join(REGISTRY)}")
        if self.rank is not None:
            check_range("rank", self.rank, 1, None, integer=True)
            if self.recovery != "lra":
                raise ConfigError("rank applies to --recovery lra only")
        if self.token_aware and self.recovery not in ("ghost", "lra"):
            raise ConfigError("token_aware applies to --recovery ghost or lra only")
        check_range("ridge", self.ridge, 0.0, 1.0)
        check_range("beam_width", self.beam_width, 1, None, integer=True)
        check_range("beam_seeds", self.beam_seeds, 1, None, integer=True)
        if self.beam_score not in ("kl", "perplexity"):
            raise ConfigError(f"beam_score must be kl or perplexity, got {self.beam_score!r}")
        object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))


def blocks_to_remove(lm, cfg: Depth) -> int:
    """``n`` from ``remove`` or from the parameter target (blocks of equal size assumed:
    the smallest n that reaches the target)."""
    n_blocks = lm.adapter.num_blocks
    if cfg.blocks:
        return len(cfg.blocks)
    if cfg.remove is not None:
        n = cfg.remove
    else:
        total = model_size(lm.model)["params"]
        per_block = sum(p.numel() for p in lm.adapter.block(0).parameters())
        target = cfg.target_params * total if cfg.target_params <= 1 else cfg.target_params
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
    return probe_spec(name).handler(make_config(name, **options_for(name, **opts)), ctx)


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
    strategy = cfg.strategy
    if strategy == "last-n":
        return sel.last_n(nb, n), {"strategy": strategy}
    if strategy == "random":
        return sel.random_blocks(nb, n, cfg.seed), {"strategy": strategy, "seed": cfg.seed}
    if strategy == "iterative":
        return iterative(lm, cfg, ctx, n), {"strategy": strategy, "probe": cfg.probe}
    if result is None:
        result = _load_probe(cfg.from_probe, nb) if cfg.from_probe else \
            run_probe(cfg.probe, ctx, cfg, n)
    strategy = strategy or default_strategy(result)
    how = {"strategy": strategy, "probe": result.probe,
           "from_probe": cfg.from_probe, "layer_values": result.layer_values()}
    values = result.layer_values()
    if strategy == "one-shot":
        return sel.one_shot(values, n), how
    if strategy == "no-adjacent":
        return sel.no_adjacent(values, n), how
    if strategy == "span":
        if result.kind in ("span", "interval"):
            return sel.span_from_scores(result.scores, n), how
        return sel.best_span(values, n), how
    if strategy == "blend":
        other = run_probe(cfg.blend_probe, ctx, cfg, n)
        how["blend_probe"] = other.probe
        return sel.blend(values, other.layer_values(), n), how
    if strategy == "beam":
        chosen, how["beam"] = beam(ctx, cfg, values, n)
        return chosen, how
    raise ConfigError(f"unknown strategy {strategy!r}")


def _removal_cost(ctx: ProbeContext, removed: tuple[int, ...], score: str) -> float:
    start = min(removed)
    order = [b for b in range(start, ctx.num_blocks) if b not in removed]
    final = ctx.run_stack(start, order)
    return ctx.nll(final) if score == "perplexity" else ctx.divergence(final)[1]


def beam(ctx: ProbeContext, cfg: Depth, values, n: int) -> tuple[list[int], dict]:
    """Beam search over removal sets (candidates: the ``beam_seeds`` best blocks)."""
    pool = [i for i in sorted(range(len(values)), key=lambda i: (values[i] is None, values[i]))
            if values[i] is not None][: max(cfg.beam_seeds, n)]
    beams: list[tuple[float, tuple[int, ...]]] = [(0.0, ())]
    scored: dict[tuple[int, ...], float] = {}
    for _ in progress(range(n), total=n, desc="beam search"):
        cands = {tuple(sorted((*b, c))) for _, b in beams for c in pool if c not in b}
        for cand in cands:
            if cand not in scored:
                scored[cand] = _removal_cost(ctx, cand, cfg.beam_score)
        beams = sorted((scored[c], c) for c in cands)[: cfg.beam_width]
    best_cost, best = beams[0]
    return list(best), {"width": cfg.beam_width, "seeds": len(pool), "score": cfg.beam_score,
                        "best_cost": best_cost, "sets_scored": len(scored)}


def iterative(lm, cfg: Depth, ctx: ProbeContext, n: int) -> list[int]:
    """Remove one block at a time, re-probing the shrunken model after each removal."""
    from prunelab.models.loading import wrap

    work = wrap(copy.deepcopy(lm.model), lm.tokenizer, spec=lm.spec)
    work.offload_to = getattr(lm, "offload_to", None)  # the copy calibrates alike
    alive = list(range(lm.adapter.num_blocks))
    removed = []
    for step in range(n):
        sub = ctx if step == 0 else ProbeContext(work, ctx.input_ids,
                                                 batch_size=ctx.runner.batches[0].shape[0])
        res = run_probe(cfg.probe, sub, cfg, 1)
        values = res.layer_values()
        pick = min((i for i, v in enumerate(values) if v is not None), key=lambda i: values[i])
        removed.append(alive.pop(pick))
        work.adapter.delete_blocks([pick])
        if sub is not ctx:
            sub.close()
    return sorted(removed)
