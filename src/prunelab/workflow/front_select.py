"""The served front's pure parts: Pareto marking, targets, and the answer to "which file".

A file is a row ``{"file", "mib", "ppl", "gen", ...}`` (size in MiB, llama.cpp perplexity,
generation tokens per second; ``gen`` may be missing before speed was measured).

*Pareto-optimal for size*: no other file is at most as large **and** at most as perplexed,
one of the two strictly. *Pareto-optimal for speed*: no other file generates at least as
fast **and** is at most as perplexed, one strictly. Ties (the same size and perplexity)
keep both. A target asks for the best file under one constraint: ``size:MIB`` (at most
that many MiB), ``speed:TOK_S`` (at least that many generated tokens per second, the
median over rounds), ``ppl:X`` (perplexity at most X; the best is then the smallest file);
otherwise the best is the lowest perplexity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prunelab.errors import ConfigError

TARGET_KINDS = {"size": "MiB at most", "speed": "generation tokens/s at least",
                "ppl": "perplexity at most"}


def dominated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether point ``a`` is dominated by ``b`` when both coordinates are minimised:
    ``b`` is no worse in both and strictly better in one."""
    return b[0] <= a[0] and b[1] <= a[1] and (b[0] < a[0] or b[1] < a[1])


def pareto_flags(points: Sequence[tuple[float, float] | None]) -> list[bool]:
    """For each point ``(x, y)`` (both minimised; ``None`` or a non-finite value: not
    measured, never on the front), whether no other point dominates it. Quadratic in the
    number of points, which is a few hundred at most."""
    ok = [p is not None and all(math.isfinite(v) for v in p) for p in points]
    flags = []
    for i, p in enumerate(points):
        flags.append(ok[i] and not any(ok[j] and dominated(p, q)
                                       for j, q in enumerate(points) if j != i))
    return flags


def mark_fronts(rows: list[dict]) -> None:
    """Set ``front_size`` and ``front_speed`` on every row (in place)."""
    size = pareto_flags([(r["mib"], r["ppl"]) if r.get("ppl") is not None else None
                         for r in rows])
    speed = pareto_flags([(-r["gen"], r["ppl"]) if r.get("ppl") is not None
                          and r.get("gen") else None for r in rows])
    for r, a, b in zip(rows, size, speed, strict=True):
        r["front_size"], r["front_speed"] = a, b


def parse_target(text: str) -> tuple[str, float]:
    """``KIND:VALUE`` -> ``(kind, value)``; one error line for anything else."""
    kinds = " | ".join(f"{k}:X ({v})" for k, v in TARGET_KINDS.items())
    if not isinstance(text, str) or text.count(":") != 1:
        raise ConfigError(f"--target must be KIND:VALUE, one of {kinds}; got {text!r}")
    kind, _, raw = text.partition(":")
    if kind not in TARGET_KINDS:
        raise ConfigError(f"--target kind {kind!r} is not one of {kinds}")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"--target {text}: {raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"--target {text}: the value must be a positive number")
    return kind, value


def best_for(rows: list[dict], kind: str, value: float) -> dict:
    """The best measured row under the target ``kind:value`` (see the module docstring);
    a target no file meets is one :class:`ConfigError` naming the closest file."""
    measured = [r for r in rows if r.get("ppl") is not None]
    if not measured:
        raise ConfigError("the front has no measured file yet: run it first")
    if kind == "size":
        ok = [r for r in measured if r["mib"] <= value]
        if not ok:
            near = min(measured, key=lambda r: r["mib"])
            raise ConfigError(f"no file of the front is at most {value:g} MiB: the smallest "
                              f"is {near['file']} at {near['mib']:.1f} MiB (perplexity "
                              f"{near['ppl']:.2f})")
        return min(ok, key=lambda r: (r["ppl"], r["mib"]))
    if kind == "speed":
        timed = [r for r in measured if r.get("gen")]
        if not timed:
            raise ConfigError("the front has no speed figures (it ran with --rounds 0)")
        ok = [r for r in timed if r["gen"] >= value]
        if not ok:
            near = max(timed, key=lambda r: r["gen"])
            raise ConfigError(f"no file of the front generates {value:g} tokens/s: the "
                              f"fastest is {near['file']} at {near['gen']:.1f} tokens/s "
                              f"(perplexity {near['ppl']:.2f})")
        return min(ok, key=lambda r: (r["ppl"], -r["gen"]))
    if kind == "ppl":
        ok = [r for r in measured if r["ppl"] <= value]
        if not ok:
            near = min(measured, key=lambda r: r["ppl"])
            raise ConfigError(f"no file of the front reaches perplexity {value:g}: the "
                              f"lowest is {near['file']} at {near['ppl']:.2f} "
                              f"({near['mib']:.1f} MiB)")
        return min(ok, key=lambda r: (r["mib"], r["ppl"]))
    raise ConfigError(f"unknown target kind {kind!r}")
