"""Swap-KL probes ("No Free Swap"): replacement and interchange of block pairs.

* Replacement ``M_{i<-j}``: block ``i`` is replaced by a copy of block ``j`` (so ``j``'s
  map runs twice); ``d_repl(i, j) = max(KL(p_M || p_{M_{i<-j}}), KL(p_M || p_{M_{j<-i}}))``.
* Interchange ``M_{i<->j}``: blocks ``i`` and ``j`` exchange positions, each running once
  at the other's depth; ``d_int(i, j) = KL(p_M || p_{M_{i<->j}})``.

``value`` is the mean KL at the last position of each window (the paper's protocol, float64,
q clamped >= 1e-40), ``value_all_positions`` the mean over all positions. Pairs: all
(``window=None``), ``|i - j| <= window``, or an explicit list. Every modified stack starts
from the cached input of block ``min(i, j)``; a block moved to another depth keeps its own
attention arguments (its own sliding-window type). Pair classes by mean KL: < 0.05
strongly swap-similar, < 0.10 conditional, >= 0.10 not swap-similar.

Every score also stores its per-window values (``windows``, ``windows_all_positions``;
replacement: ``windows_i_from_j``, ``windows_j_from_i`` and their ``_all_positions``, the
value being the larger of the two means) so that :mod:`prunelab.probes.reliability` can
bootstrap a saved result without rerunning it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.errors import ConfigError
from prunelab.log import progress
from prunelab.probes.base import PROBES, ProbeResult, check_range, config_dict


def pair_class(kl: float) -> str:
    """The paper's classes by mean KL."""
    if kl < 0.05:
        return "strongly swap-similar"
    if kl < 0.10:
        return "conditional"
    return "not swap-similar"


def select_pairs(n: int, window: int | None, pairs) -> list[tuple[int, int]]:
    """Pairs ``i < j`` of ``n`` blocks: explicit ``pairs``, else ``|i-j| <= window``, else
    all."""
    if pairs:
        out = []
        for i, j in pairs:
            i, j = int(i), int(j)
            if not (0 <= i < n and 0 <= j < n) or i == j:
                raise ConfigError(f"pair {i}-{j} invalid for {n} blocks (0-based, i != j)")
            out.append((min(i, j), max(i, j)))
        return sorted(set(out))
    w = n if window is None else window
    return [(i, j) for i in range(n) for j in range(i + 1, min(n, i + w + 1))]


def interchange_order(n: int, i: int, j: int) -> list[int]:
    """Block order from position ``min(i, j)`` with blocks ``i`` and ``j`` exchanged
    (``i == j``: the unchanged suffix)."""
    i, j = min(i, j), max(i, j)
    if i == j:
        return list(range(i, n))
    return [j, *range(i + 1, j), i, *range(j + 1, n)]


def replacement_order(n: int, i: int, j: int) -> list[int]:
    """Block order from position ``i`` with block ``i`` replaced by block ``j``."""
    return [j, *range(i + 1, n)]


@dataclass(frozen=True)
class SwapConfig:
    """Pairs to probe: ``window`` (``|i - j| <= window``, default all pairs) or ``pairs``
    (explicit 0-based ``(i, j)``); the options shared by :class:`Interchange` and
    :class:`Replacement`."""

    window: int | None = field(default=None, metadata={"help": (
        "pairs with |i-j| <= W (default: all pairs)")})
    pairs: tuple = field(default_factory=tuple, metadata={"help": (
        "explicit 0-based pairs (i, j); on the command line i-j,...")})

    def __post_init__(self):
        if self.window is not None:
            check_range("window", self.window, 1, None, integer=True)
        object.__setattr__(self, "pairs", tuple(tuple(p) for p in self.pairs))


def _run_pairs(name: str, cfg: SwapConfig, ctx, measure, resume: dict | None,
               on_progress=None) -> ProbeResult:
    n = ctx.num_blocks
    pairs = select_pairs(n, cfg.window, cfg.pairs)
    done = {tuple(s["layers"]): s for s in (resume or {}).get("scores", [])}
    scores = []
    todo = [p for p in pairs if p not in done]
    for p in pairs:
        if p in done:
            scores.append(done[p])
    for i, j in progress(todo, total=len(todo), desc=name):
        entry = {"layers": [i, j], **measure(i, j)}
        entry["class"] = pair_class(entry["value"])
        scores.append(entry)
        if on_progress is not None:
            on_progress(sorted(scores, key=lambda s: s["layers"]))
    scores.sort(key=lambda s: s["layers"])
    return ProbeResult(name, config_dict(cfg), scores, kind="pair", num_blocks=n)


@PROBES.register("interchange", resumable=True)
@dataclass(frozen=True)
class Interchange(SwapConfig):
    """Divergence to dense with blocks i and j exchanged ("No Free Swap" interchange)."""

    def run(self, ctx, resume=None, on_progress=None) -> ProbeResult:
        n = ctx.num_blocks

        def measure(i, j):
            return ctx.divergence_windows(ctx.run_stack(i, interchange_order(n, i, j))).entry()

        return _run_pairs("interchange", self, ctx, measure, resume, on_progress)


@PROBES.register("replacement", resumable=True)
@dataclass(frozen=True)
class Replacement(SwapConfig):
    """Divergence to dense with block i replaced by a copy of j, and j by i (the larger)."""

    def run(self, ctx, resume=None, on_progress=None) -> ProbeResult:
        n = ctx.num_blocks

        def measure(i, j):
            a = ctx.divergence_windows(ctx.run_stack(i, replacement_order(n, i, j)))
            b = ctx.divergence_windows(ctx.run_stack(j, replacement_order(n, j, i)))
            return {"value": max(a.value, b.value),
                    "value_all_positions": max(a.value_all_positions, b.value_all_positions),
                    "i_from_j": a.value, "j_from_i": b.value,
                    "i_from_j_all_positions": a.value_all_positions,
                    "j_from_i_all_positions": b.value_all_positions,
                    "windows_i_from_j": a.last, "windows_j_from_i": b.last,
                    "windows_i_from_j_all_positions": a.all_positions,
                    "windows_j_from_i_all_positions": b.all_positions}

        return _run_pairs("replacement", self, ctx, measure, resume, on_progress)
