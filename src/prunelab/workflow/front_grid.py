"""The served front's grid: which pruned models to build, and which types to write.

A grid point is ``KIND:VALUE`` with an optional ``+heal`` (a short distillation from the
dense model after pruning, :func:`prunelab.api.heal`):

=============  ==================================================================
``depth:N``    remove N blocks (span-angular probe, span selection, ``foldable``
               closed-form recovery folded into the weights: a plain checkpoint)
``ffn:F``      remove the fraction F of every block's FFN channels (wanda-sp score,
               least-squares compensation, uniform widths rounded to the quantized
               types' block so no weight falls back)
``heads:F``    remove the fraction F of the KV groups (with their query heads) of every
               block (wanda-sp, compensation)
``sublayers:N`` remove N blocks' worth of attention / MLP sub-blocks (sub-block depth
               search, ``foldable``; per-block shapes: llama.cpp's ``deci``)
``slice:F``    remove the fraction F of the hidden size (SliceGPT, one global rotation,
               the kept size a multiple of the types' block, a tied head kept tied; the
               size may be one the transformers config refuses, since the model only
               goes to GGUF: SmolLM2's 512 with 9 heads)
=============  ==================================================================

:func:`parse_grid` refuses anything else in one line (an unknown kind, a value out of
range, a point twice).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prunelab.checkpoint.gguf_export import OUT_TYPES, QUANT_TYPES, quant_block
from prunelab.errors import ConfigError
from prunelab.pruning import METHODS

#: the dense ladder: llama.cpp's usual types, and with an importance matrix the IQ types
#: down to 1.75 bits per weight (so that the small end of the front has its dense files too)
LADDER = ("f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q3_k_m", "q2_k")
IQ_LADDER = ("iq4_xs", "iq3_m", "iq3_xxs", "iq2_m", "iq2_xxs", "iq1_m")
#: the pruned models' default types (those of the ladder where a smaller model can pay:
#: 4 bits and below, and q8_0 for reference)
GRID_TYPES = ("q8_0", "q4_k_m", "q3_k_m", "q2_k")
IQ_GRID_TYPES = ("iq4_xs", "iq3_xxs", "iq2_m")
DEFAULT_GRID = ("depth:4+heal", "depth:6+heal", "depth:8+heal", "ffn:0.25+heal")
KINDS = {"depth": "blocks removed (integer >= 1)", "ffn": "fraction of FFN channels (0-0.9)",
         "heads": "fraction of KV groups (0-0.9)",
         "sublayers": "blocks' worth of sub-blocks (integer >= 1)",
         "slice": "fraction of the hidden size (0-0.9)"}
_POINT = re.compile(r"^([a-z]+):([0-9.eE+-]+?)(\+heal)?$")


@dataclass(frozen=True)
class GridPoint:
    """One pruned model of the grid: ``kind``, ``value``, whether it is healed."""

    kind: str
    value: float
    heal: bool

    @property
    def name(self) -> str:
        """File-name-safe id: ``depth6-heal``, ``ffn0.25``."""
        v = f"{int(self.value)}" if self.kind in ("depth", "sublayers") else f"{self.value:g}"
        return f"{self.kind}{v}" + ("-heal" if self.heal else "")

    @property
    def spec(self) -> str:
        v = f"{int(self.value)}" if self.kind in ("depth", "sublayers") else f"{self.value:g}"
        return f"{self.kind}:{v}" + ("+heal" if self.heal else "")

    def describe(self) -> str:
        """What the point does, in words (the front's "how it was made")."""
        what = {"depth": f"{int(self.value)} blocks removed (span-angular, foldable recovery)",
                "ffn": f"{self.value:.0%} of the FFN channels removed (wanda-sp, compensated)",
                "heads": f"{self.value:.0%} of the KV groups removed (wanda-sp, compensated)",
                "sublayers": f"{int(self.value)} blocks' worth of sub-blocks removed "
                             "(foldable recovery)",
                "slice": f"{self.value:.0%} of the hidden size sliced (SliceGPT, global, "
                         "tied head kept)"}
        return what[self.kind] + (", healed by distillation" if self.heal else "")

    def config(self, round_to: int):
        """The method config that makes this point (widths multiples of ``round_to``)."""
        if self.kind in ("depth", "sublayers"):
            extra = {"granularity": "sublayer"} if self.kind == "sublayers" else \
                {"probe": "span-angular"}
            return METHODS.from_dict({"name": "depth", "remove": int(self.value),
                                 "recovery": "foldable", **extra})
        if self.kind in ("ffn", "heads"):
            return METHODS.from_dict({"name": "width", "unit": self.kind, "ratio": self.value,
                                 "score": "wanda-sp", "allocation": "uniform",
                                 "compensate": True, "round_to": max(round_to, 1)})
        return METHODS.from_dict({"name": "slicegpt", "rotation": "global", "ratio": self.value,
                                  "multiple": max(round_to, 8), "keep_tied": True,
                                  "gguf_only": True})


#: grid kinds whose result only some GGUF architectures can hold
NEEDS_ARCH = {"sublayers": ("llama",),  # removed sub-blocks: llama.cpp's deci (Llama family)
              "slice": ("llama", "qwen2")}  # Gemma 3 norms its branch outputs: remote code


def check_points(points: tuple[GridPoint, ...], arch: str) -> None:
    """Refuse, before any work, a grid point whose pruned model the dense model's GGUF
    architecture ``arch`` could not be written in."""
    for p in points:
        if p.kind in NEEDS_ARCH and arch not in NEEDS_ARCH[p.kind]:
            raise ConfigError(f"grid point {p.spec}: a {arch} model pruned that way has no "
                              f"GGUF form (only {', '.join(NEEDS_ARCH[p.kind])}): drop it "
                              "from --grid")


def parse_point(text: str) -> GridPoint:
    """``KIND:VALUE[+heal]`` -> :class:`GridPoint`."""
    kinds = ", ".join(f"{k}:X ({v})" for k, v in KINDS.items())
    m = _POINT.match(text.strip()) if isinstance(text, str) else None
    if m is None or m.group(1) not in KINDS:
        raise ConfigError(f"grid point {text!r}: expected KIND:VALUE[+heal] with KIND one "
                          f"of {kinds}")
    kind, raw, heal = m.group(1), m.group(2), bool(m.group(3))
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"grid point {text!r}: {raw!r} is not a number") from None
    if kind in ("depth", "sublayers"):
        if not value.is_integer() or value < 1:
            raise ConfigError(f"grid point {text!r}: {kind} takes a whole number of blocks "
                              ">= 1")
    elif not (math.isfinite(value) and 0 < value <= 0.9):
        raise ConfigError(f"grid point {text!r}: {kind} takes a fraction in (0, 0.9]")
    return GridPoint(kind, value, heal)


def parse_grid(text: str | None) -> tuple[GridPoint, ...]:
    """A comma-separated grid (``None``: :data:`DEFAULT_GRID`; ``""``/``none``: no pruned
    model, the dense ladder only)."""
    if text is None:
        return tuple(parse_point(p) for p in DEFAULT_GRID)
    if text.strip() in ("", "none"):
        return ()
    points = tuple(parse_point(p) for p in text.split(","))
    seen: set[str] = set()
    for p in points:
        if p.name in seen:
            raise ConfigError(f"grid point {p.spec} is given twice")
        seen.add(p.name)
    return points


def parse_types(text: str | None, imatrix: bool, label: str = "--types") -> tuple[str, ...]:
    """A comma-separated list of output types (``None``: :data:`LADDER`, plus
    :data:`IQ_LADDER` with an importance matrix); unknown types and IQ types that need an
    importance matrix without one are refused."""
    if text is None:
        return LADDER + (IQ_LADDER if imatrix else ())
    names = tuple(t.strip().lower() for t in text.split(",") if t.strip())
    if not names:
        raise ConfigError(f"{label} is empty")
    for t in names:
        if t not in OUT_TYPES and t not in QUANT_TYPES:
            raise ConfigError(f"{label}: unknown type {t!r}; one of "
                              f"{', '.join([*OUT_TYPES, *QUANT_TYPES])}")
        if not imatrix and t in QUANT_TYPES and QUANT_TYPES[t].needs_imatrix:
            raise ConfigError(f"{label}: {t} needs an importance matrix (llama.cpp refuses "
                              "it without one): drop --no-imatrix or the type")
    if len(set(names)) != len(names):
        raise ConfigError(f"{label} names a type twice")
    return names


def round_for(types: tuple[str, ...]) -> int:
    """The width every quantized type of ``types`` can store without a fallback: the least
    common multiple of their blocks (256 with any k-quant, 32 with q8_0 alone)."""
    return math.lcm(*(quant_block(t) for t in types)) if types else 1
