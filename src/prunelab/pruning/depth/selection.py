"""Which blocks to remove: selection strategies over probe scores (pure functions).

All indices are 0-based in the model's current numbering; every strategy returns a sorted
list of ``n`` distinct blocks (or raises when that is impossible).

* ``one-shot``: the ``n`` lowest removability values.
* ``no-adjacent``: greedy lowest first, never two adjacent blocks (for pair probes with
  ``r(l) = min(d(l, l-1), d(l, l+1))``; "No Free Swap").
* ``span``: the best contiguous span of ``n`` blocks (lowest summed value, or a span
  probe's own distance).
* ``blend``: rank average of two probes (e.g. rho and block influence), then lowest ``n``.
* ``last-n``: the deepest ``n`` blocks excluding the final one (a baseline).
* ``random``: seeded uniform choice (a baseline).
* ``iterative`` and ``beam`` need the model and live in :mod:`prunelab.pruning.depth.config`.
"""

from __future__ import annotations

import random as _random

from prunelab.errors import ConfigError
from prunelab.probes.comparison import greedy_no_adjacent, lowest_n


def _check(n: int, total: int) -> None:
    if not 1 <= n < total:
        raise ConfigError(f"cannot remove {n} of {total} blocks (need 1 <= n < {total})")


def one_shot(values: list[float | None], n: int) -> list[int]:
    _check(n, len(values))
    chosen = lowest_n(values, n)
    if len(chosen) < n:
        raise ConfigError(f"the probe scored only {len(chosen)} blocks, {n} requested")
    return sorted(chosen)


def no_adjacent(values: list[float | None], n: int) -> list[int]:
    _check(n, len(values))
    chosen = greedy_no_adjacent(values, n)
    if len(chosen) < n:
        raise ConfigError(f"no {n} pairwise non-adjacent blocks among the scored ones "
                          f"(greedy found {len(chosen)})")
    return sorted(chosen)


def best_span(values: list[float | None], n: int, first: int = 0) -> list[int]:
    """Contiguous ``[l, l+n)`` with the lowest summed value (spans with gaps skipped;
    ``l >= first``)."""
    _check(n, len(values))
    best, best_cost = None, float("inf")
    for start in range(first, len(values) - n + 1):
        window = values[start:start + n]
        if any(v is None for v in window):
            continue
        cost = sum(window)
        if cost < best_cost:
            best, best_cost = start, cost
    if best is None:
        raise ConfigError(f"no contiguous span of {n} scored blocks")
    return list(range(best, best + n))


def span_from_scores(scores: list[dict], n: int, first: int = 0) -> list[int]:
    """The ``[start, end)`` entry of length ``n`` with the lowest value (span/interval
    probes; ``start >= first``)."""
    cands = [s for s in scores if len(s["layers"]) == 2
             and s["layers"][1] - s["layers"][0] == n and s["layers"][0] >= first]
    if not cands:
        raise ConfigError(f"the probe has no span of length {n}; run it with --span {n} "
                          f"(span-angular) or a larger --max-length (interval)")
    start, end = min(cands, key=lambda s: s["value"])["layers"]
    return list(range(start, end))


def _ranks(values: list[float | None]) -> list[float | None]:
    order = sorted((i for i, v in enumerate(values) if v is not None), key=lambda i: values[i])
    ranks: list[float | None] = [None] * len(values)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def blend(values_a: list[float | None], values_b: list[float | None], n: int) -> list[int]:
    """Rank average of two removability lists, then the ``n`` lowest."""
    if len(values_a) != len(values_b):
        raise ConfigError("blended probes must cover the same blocks")
    ra, rb = _ranks(values_a), _ranks(values_b)
    avg = [None if a is None or b is None else (a + b) / 2 for a, b in zip(ra, rb, strict=True)]
    return one_shot(avg, n)


def last_n(num_blocks: int, n: int) -> list[int]:
    """Blocks ``L-1-n .. L-2``: the deepest ``n`` before the final block."""
    _check(n, num_blocks)
    if n > num_blocks - 1:
        raise ConfigError(f"last-n keeps the final block: at most {num_blocks - 1} removable")
    return list(range(num_blocks - 1 - n, num_blocks - 1))


def random_blocks(num_blocks: int, n: int, seed: int) -> list[int]:
    _check(n, num_blocks)
    return sorted(_random.Random(seed).sample(range(num_blocks), n))


def contiguous_spans(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted blocks as half-open contiguous spans: ``[3, 4, 7] -> [(3, 5), (7, 8)]``."""
    spans: list[list[int]] = []
    for b in sorted(blocks):
        if spans and b == spans[-1][1]:
            spans[-1][1] = b + 1
        else:
            spans.append([b, b + 1])
    return [(s, e) for s, e in spans]


PART_NAMES = {"attention": "attention", "attn": "attention", "mlp": "mlp", "ffn": "mlp"}


def parse_sublayers(value) -> tuple:
    """``((block, "attention" | "mlp"), ...)``, sorted, from pairs (``[5, "attention"]``, as
    a depth report's ``removed_sublayers`` lists them) or from text ``"5:attention,16:mlp"``
    (``attn`` / ``ffn`` accepted); a malformed or repeated entry is a ConfigError."""
    if isinstance(value, str):
        value = [p.strip() for p in value.split(",") if p.strip()]
    out = []
    for item in value:
        pair = item.split(":") if isinstance(item, str) else list(item)
        try:
            block, part = int(str(pair[0]).strip()), PART_NAMES[str(pair[1]).strip().lower()]
            if len(pair) != 2 or block < 0:
                raise ValueError
        except (ValueError, KeyError, IndexError, TypeError):
            raise ConfigError("--sublayers takes 0-based BLOCK:PART entries, PART attention "
                              f"or mlp, e.g. 5:attention,16:mlp; got {item!r}") from None
        out.append((block, part))
    if len(set(out)) != len(out):
        raise ConfigError(f"--sublayers repeats an entry: {sorted(out)}")
    return tuple(sorted(out))
