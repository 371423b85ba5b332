"""Probe configs, the registry :data:`PROBES`, option routing, and :class:`ProbeResult`.

A probe is one frozen dataclass config (validated at construction) that carries its maths
in ``run(self, context) -> ProbeResult``, registered under the probe's name with
``@PROBES.register(name, forward=..., resumable=...)``: whether the probe needs the dense
forward pass (``forward``, default ``True``) and whether ``run`` resumes from partial
results (``resumable``, default ``False``: it then takes ``resume`` and ``on_progress``
keywords). Every result lists ``scores``: dicts with
``layers`` (0-based: ``[i]`` for a block, ``[i, j]`` for a pair, ``[start, end]`` for a
half-open span/interval) and ``value``; the result says whether a low value means
"removable" and, for pair probes, derives per-layer removability
``r(l) = min(d(l, l-1), d(l, l+1))``. Head probes (kind ``"head"``) list one entry per
attention head, ``{"layers": [i], "head": h, "value": ...}`` (query head ``h`` of block
``i``, 0-based); per block they sum the block's heads.

Options: :func:`make_config` is strict (an option the probe does not take is a
:class:`ConfigError` naming it and the valid ones). Several probes sharing one set of
options go through :func:`route_options`: each option goes to the probes that take it, and
one that no requested probe takes is an error. :func:`options_for` is the routing filter
for internal callers that pass a fixed set of options to any probe (depth pruning).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.registry import Registry, check_range, strict_kwargs, to_dict  # noqa: F401

PROBES = Registry("probe")


@dataclass(frozen=True)
class ProbeSpec:
    """What a registered probe declares besides its config's fields: whether it needs the
    dense pass that caches block boundaries (``forward``), and whether its ``run`` takes
    ``resume`` / ``on_progress`` (``resumable``)."""

    forward: bool = True
    resumable: bool = False


def probe_spec(probe: Any) -> ProbeSpec:
    """The :class:`ProbeSpec` of a probe name or config (its registration meta)."""
    name = probe if isinstance(probe, str) else PROBES.name_of(probe)
    return ProbeSpec(**PROBES.meta(name))


def probe_names() -> list[str]:
    """Registered probe names, sorted."""
    return sorted(PROBES.names())


def _option_names(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(PROBES.get(name))
            if f.init and not f.name.startswith("_")]


def make_config(probe: Any, **options) -> Any:
    """Probe ``probe``'s config (a name, or a config returned unchanged) from ``options``.

    Strict: an option the probe does not take is a :class:`ConfigError` naming it and the
    valid ones. A ``None`` value means "the default"."""
    if not isinstance(probe, str):
        return PROBES.make(probe, **{k: v for k, v in options.items() if v is not None})
    cls = PROBES.get(probe)
    strict_kwargs(cls, options, f"probe {probe!r}")
    return cls(**{k: v for k, v in options.items() if v is not None})


def options_for(name: str, **options) -> dict:
    """Routing, not validation: the subset of ``options`` (``None`` values dropped) that
    probe ``name``'s config takes. For callers that hand one fixed set of options to
    whichever probe they run (depth pruning passes ``window``, ``span``, ``max_length``,
    ``seed``); user options go through :func:`make_config` or :func:`route_options`."""
    valid = set(_option_names(name))
    return {k: v for k, v in options.items() if k in valid and v is not None}


def route_options(probes: Sequence[Any], options: dict) -> list[Any]:
    """One config per entry of ``probes`` (names or ready configs): each probe given by name
    gets the ``options`` its config takes; ready configs are used as they are. ``None``
    values mean "not given". An option that no probe given by name takes is a
    :class:`ConfigError` naming it."""
    given = {k: v for k, v in options.items() if v is not None}
    used: set[str] = set()
    configs = []
    for p in probes:
        if isinstance(p, str):
            own = options_for(p, **given)
            used.update(own)
            configs.append(make_config(p, **own))
        else:
            configs.append(make_config(p))
    for key in given:
        if key not in used:
            raise ConfigError(_unused_message(key, probes))
    return configs


def _unused_message(key: str, probes: Sequence[Any]) -> str:
    ready = [p for p in probes if not isinstance(p, str)]
    for cfg in ready:
        if key in _option_names(PROBES.name_of(cfg)):
            return (f"option {key!r} given with a ready {PROBES.name_of(cfg)} config; "
                    "set it on the config")
    names = [p if isinstance(p, str) else PROBES.name_of(p) for p in probes]
    valid = "; ".join(f"{n}: {', '.join(_option_names(n)) or '(none)'}" for n in names)
    return f"no requested probe takes option {key!r} ({valid})"


def config_dict(config) -> dict:
    """A probe config's fields, JSON-ready (:func:`prunelab.registry.to_dict` without the
    name)."""
    d = to_dict(config)
    d.pop("name", None)
    return d


@dataclass
class ProbeResult:
    """Scores of one probe on one model and data set."""

    probe: str
    config: dict
    scores: list[dict]
    kind: str  # "layer", "sublayer", "pair", "span", "interval" or "head"
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
        if self.kind == "head":  # entries {"layers": [i], "head": h}: a block sums its heads
            heads: list[float | None] = [None] * n
            for s in self.scores:
                if "head" in s:
                    i, v = s["layers"][0], s[key]
                    heads[i] = (heads[i] or 0.0) + (v if self.lower_is_removable else -v)
            return heads
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

    def probe_config(self) -> Any:
        """The typed config that produced this result (rebuilt through :data:`PROBES`)."""
        return PROBES.from_dict({"name": self.probe, **self.config})

    @classmethod
    def load(cls, path: str | Path) -> ProbeResult:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_csv(self) -> str:
        """CSV: one row per score, ``layers`` as ``i`` / ``i-j``; the per-window lists
        (``windows*``) stay in the JSON."""
        keys: list[str] = []
        for s in self.scores:
            keys += [k for k in s if k != "layers" and k not in keys
                     and not k.startswith("windows")]
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["layers", *keys])
        for s in self.scores:
            w.writerow(["-".join(str(x) for x in s["layers"]), *[s.get(k, "") for k in keys]])
        return buf.getvalue()

    def to_frame(self):
        """A pandas DataFrame of the scores (pandas is optional)."""
        try:
            import pandas as pd  # noqa: PLC0415 - optional pandas
        except ImportError as exc:  # pragma: no cover - pandas ships with datasets
            raise ConfigError("to_frame needs pandas: pip install pandas") from exc
        return pd.DataFrame([{**s, "layers": tuple(s["layers"])} for s in self.scores])

    def plot(self, path: str | Path | None = None):
        """A matplotlib figure (bars per layer, or a heatmap for pair probes)."""
        from prunelab.probes.plots import plot_result  # noqa: PLC0415 - matplotlib

        return plot_result(self, path)


#: Probes that need only block-by-block forward passes through the stack.
STREAMABLE_PROBES = ("block-influence", "span-angular", "cka")


def check_streamable_probes(items) -> None:
    """One-line error naming the probes of ``items`` that need the whole model."""
    names = [p if isinstance(p, str) else PROBES.name_of(p) for p in items]
    bad = [n for n in names if n not in STREAMABLE_PROBES]
    if bad:
        raise UnsupportedOperationError(
            f"--stream: probe(s) {', '.join(bad)} need the whole model in memory; "
            f"streamable probes: {', '.join(STREAMABLE_PROBES)}")
