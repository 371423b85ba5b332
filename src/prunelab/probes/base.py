"""Probe configs, the registry, and :class:`ProbeResult`.

A probe is a frozen dataclass config (validated at construction) plus a handler
``handler(config, context) -> ProbeResult`` registered under the probe's name. Every
result lists ``scores``: dicts with ``layers`` (0-based: ``[i]`` for a block, ``[i, j]`` for
a pair, ``[start, end]`` for a half-open span/interval) and ``value``; the result says
whether a low value means "removable" and, for pair probes, derives per-layer
removability ``r(l) = min(d(l, l-1), d(l, l+1))``.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError
from prunelab.registry import check_range  # noqa: F401  (re-exported)

REGISTRY: dict[str, tuple[type, Callable]] = {}


def register(name: str, config_cls: type):
    """Decorator registering ``handler(config, context)`` as probe ``name``."""
    def wrap(handler):
        REGISTRY[name] = (config_cls, handler)
        return handler
    return wrap


def probe_names() -> list[str]:
    return sorted(REGISTRY)


def make_config(name: str, **options) -> Any:
    """Build probe ``name``'s config from ``options``, ignoring options it does not take."""
    if name not in REGISTRY:
        raise ConfigError(f"unknown probe {name!r}; available: {', '.join(probe_names())}")
    cls = REGISTRY[name][0]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in options.items() if k in fields and v is not None})


def config_dict(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config), default=list))


@dataclass
class ProbeResult:
    """Scores of one probe on one model and data set."""

    probe: str
    config: dict
    scores: list[dict]
    kind: str  # "layer", "sublayer", "pair", "span" or "interval"
    lower_is_removable: bool = True
    num_blocks: int = 0
    meta: dict = field(default_factory=dict)

    # ---------------------------------------------------------------- derived views
    def pair_matrix(self, key: str = "value") -> list[list[float | None]]:
        """``L x L`` matrix of a pair probe (symmetric; ``None`` where not measured)."""
        n = self.num_blocks
        mat: list[list[float | None]] = [[None] * n for _ in range(n)]
        for s in self.scores:
            if len(s["layers"]) == 2 and s.get("kind", "pair") == "pair":
                i, j = s["layers"]
                mat[i][j] = mat[j][i] = s[key]
        return mat

    def layer_values(self, key: str = "value") -> list[float | None]:
        """One removability value per block (lower = more removable).

        Layer probes: their value (negated where high means removable). Pair probes:
        ``r(l) = min(d(l, l-1), d(l, l+1))`` over the measured neighbours.
        """
        n = self.num_blocks
        if self.kind == "layer":
            vals: list[float | None] = [None] * n
            for s in self.scores:
                if len(s["layers"]) == 1:
                    v = s[key]
                    vals[s["layers"][0]] = v if self.lower_is_removable else -v
            return vals
        if self.kind == "sublayer":  # a block's removal ~ both branches: sum of the two
            sums: list[float | None] = [None] * n
            for s in self.scores:
                i = s["layers"][0]
                sums[i] = (sums[i] or 0.0) + s[key]
            return sums
        if self.kind == "pair":
            mat = self.pair_matrix(key)
            out = []
            for i in range(n):
                nb = [mat[i][j] for j in (i - 1, i + 1) if 0 <= j < n and mat[i][j] is not None]
                best = min(nb) if nb else None
                out.append(best if (best is None or self.lower_is_removable) else -best)
            return out
        return [None] * n

    def ranking(self, key: str = "value") -> list[int]:
        """Blocks from most to least removable (blocks without a value are left out)."""
        vals = self.layer_values(key)
        return sorted((i for i, v in enumerate(vals) if v is not None), key=lambda i: vals[i])

    def to_dict(self) -> dict:
        return {"probe": self.probe, "config": self.config, "kind": self.kind,
                "lower_is_removable": self.lower_is_removable, "num_blocks": self.num_blocks,
                **self.meta, "scores": self.scores}

    @classmethod
    def from_dict(cls, d: dict) -> ProbeResult:
        known = {"probe", "config", "kind", "lower_is_removable", "num_blocks", "scores"}
        return cls(probe=d["probe"], config=d["config"], scores=d["scores"], kind=d["kind"],
                   lower_is_removable=d["lower_is_removable"], num_blocks=d["num_blocks"],
                   meta={k: v for k, v in d.items() if k not in known})

    @classmethod
    def load(cls, path: str | Path) -> ProbeResult:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_csv(self) -> str:
        """CSV: one row per score, ``layers`` as ``i`` / ``i-j``."""
        keys: list[str] = []
        for s in self.scores:
            keys += [k for k in s if k != "layers" and k not in keys]
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["layers", *keys])
        for s in self.scores:
            w.writerow(["-".join(str(x) for x in s["layers"]), *[s.get(k, "") for k in keys]])
        return buf.getvalue()

    def to_frame(self):
        """A pandas DataFrame of the scores (pandas is optional)."""
        try:
            import pandas as pd
        except ImportError as exc:  # pragma: no cover - pandas ships with datasets
            raise ConfigError("to_frame needs pandas: pip install pandas") from exc
        return pd.DataFrame([{**s, "layers": tuple(s["layers"])} for s in self.scores])

    def plot(self, path: str | Path | None = None):
        """A matplotlib figure (bars per layer, or a heatmap for pair probes)."""
        from prunelab.report.plots import plot_result

        return plot_result(self, path)
