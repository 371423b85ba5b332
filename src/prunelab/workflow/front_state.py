"""The served front's settings and its resumable state (``OUT/front.json``): see
:mod:`prunelab.workflow.front`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from prunelab._version import __version__
from prunelab.errors import ConfigError
from prunelab.io.files import write_json
from prunelab.train.config import HealConfig
from prunelab.workflow.front_grid import (
    GRID_TYPES,
    IQ_GRID_TYPES,
    GridPoint,
    parse_grid,
    parse_types,
)

FORMAT = "prunelab-front/1"
STATE = "front.json"
#: what the front writes in its folder (all it may remove with --overwrite)
OWN_FILES = ("front.json", "front.md", "front.csv", "front_size.png", "front_speed.png")
OWN_DIRS = ("gguf", "imatrix")


@dataclass(frozen=True)
class FrontSettings:
    """Everything that decides a front's files and figures (a rerun must match them)."""

    model: str
    grid: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    grid_types: tuple[str, ...] = ()
    imatrix: bool = True
    data: str = "wiki-vital:calib"
    samples: int = 32
    seqlen: int = 256
    test: str = "wiki-vital:test"
    windows: int = 8
    test_seqlen: int = 256
    heal: dict = field(default_factory=dict)
    rounds: int = 3
    threads: int = 0
    prompt: int = 512
    gen: int = 128
    seed: int = 0
    dtype: str = "float32"
    trust_remote_code: bool = False

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @property
    def points(self) -> tuple[GridPoint, ...]:
        return parse_grid(",".join(self.grid)) if self.grid else ()

    @property
    def n_threads(self) -> int:
        return self.threads or os.cpu_count() or 1


def make_settings(model: str, grid: str | None = None, types: str | None = None,
                  grid_types: str | None = None, imatrix: bool = True,
                  heal: dict | None = None, **options) -> FrontSettings:
    """Settings from the command's text options, every one checked (one error line)."""
    points = parse_grid(grid)
    ladder = parse_types(types, imatrix)
    pruned = parse_types(grid_types, imatrix, "--grid-types") if grid_types is not None \
        else GRID_TYPES + (IQ_GRID_TYPES if imatrix else ())
    if points and not pruned:
        raise ConfigError("--grid-types is empty: the pruned models need a type")
    heal = _heal_options(heal or {})
    if options.get("dtype", "float32") not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype must be float32 or bfloat16, got {options['dtype']!r}")
    for name, low in (("samples", 1), ("seqlen", 16), ("windows", 1), ("test_seqlen", 16),
                      ("rounds", 0), ("threads", 0), ("prompt", 8), ("gen", 1)):
        value = options.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < low):
            raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= {low}, "
                              f"got {value!r}")
    return FrontSettings(model=model, grid=tuple(p.spec for p in points), types=ladder,
                         grid_types=pruned if points else (), imatrix=imatrix, heal=heal,
                         **{k: v for k, v in options.items() if v is not None})


#: the heal the grid's ``+heal`` points get unless told otherwise: distillation from the
#: dense model (kd at temperature 1: the cross-entropy to the dense model's own next-token
#: distribution, what perplexity measures; on SmolLM2 with 6 blocks removed, 32 steps gave
#: 19.93 where temperature 2 needed 64 steps for 19.62), LoRA, 32 steps of 4 x 256 tokens at
#: 3e-3 (the short-heal rate of benchmarks/results/healing.md), no held-out early stopping
#: (the test windows stay unseen)
HEAL_DEFAULTS = {"loss": "kd", "temperature": 1.0, "steps": 32, "lr": 3e-3, "eval_every": 0,
                 "patience": 0}


def _heal_options(given: dict) -> dict:
    """The heal's HealConfig fields: the defaults above, updated by ``given`` (checked by
    building the config)."""
    opts = {**HEAL_DEFAULTS, **given}
    if opts.get("loss") not in ("kd", "mix") and "temperature" not in given:
        del opts["temperature"]  # the default's kd temperature: no kd term to apply it to
    HealConfig(**opts)  # one error line for a bad field or value
    return opts


def adapts(heal: dict) -> bool:
    """Whether the heal fits the calibration text itself (a cross-entropy term): it then
    adapts the model to that text's domain, which the dense ladder would not get, so the
    front adds the dense model fine-tuned the same way (``dense-heal``) as the control."""
    cfg = HealConfig(**heal)
    return cfg.weights().get("ce", 0) > 0


class FrontState:
    """``OUT/front.json``: the settings and what is done; written after every step."""

    def __init__(self, out: Path, settings: FrontSettings, overwrite: bool) -> None:
        self.out = out
        self.path = out / STATE
        self.settings = settings
        old = _read_state(self.path)
        if old is None:
            _refuse_foreign(out)
        elif overwrite:  # the folders stay when they hold what the front did not write
            discard_front(out, old)
            old = None
        if old is not None and old.get("settings") != settings.to_dict():
            diff = sorted(k for k, v in settings.to_dict().items()
                          if old.get("settings", {}).get(k) != v)
            raise ConfigError(f"{out} holds a front made with other settings (differs: "
                              f"{', '.join(diff) or 'format'}): rerun with the same options "
                              "to resume, or use another --out or --overwrite")
        self.data: dict = old or {"format": FORMAT, "prunelab": __version__,
                                  "settings": settings.to_dict(), "models": {},
                                  "files": {}, "speed": {"rounds": []}}

    def save(self) -> None:
        write_json(self.path, self.data, overwrite=True)

    def done_file(self, key: str) -> bool:
        """Whether file ``key`` is recorded and still on disk with its recorded size."""
        rec = self.data["files"].get(key)
        if rec is None or rec.get("ppl") is None:
            return False
        path = self.out / rec["path"]
        return path.is_file() and path.stat().st_size == rec["bytes"]

    def done_model(self, name: str) -> bool:
        rec = self.data["models"].get(name)
        if rec is None:
            return False
        src = self.out / rec["f16"]
        return src.is_file() and src.stat().st_size == rec["f16_bytes"] and (
            rec.get("imatrix") is None or (self.out / rec["imatrix"]).is_file())


def _read_state(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable front state ({e}): use another --out "
                          "or --overwrite") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a prunelab front (format {FORMAT}): use another "
                          "--out")
    return data


def _refuse_foreign(out: Path) -> None:
    """Without a front state, none of the names a front writes may exist in ``out`` (they
    are someone else's: never replaced, with or without --overwrite)."""
    taken = [n for n in (*OWN_FILES, *OWN_DIRS) if (out / n).exists() or (out / n).is_symlink()]
    if taken:
        raise ConfigError(f"{out} holds {', '.join(taken)} that no front wrote (no {STATE}): "
                          "use another --out")


def _written(out: Path, data: dict) -> list[Path]:
    """Every file the front recorded in ``data`` (the models' f16 files and matrices, the
    quantized files), inside ``out``."""
    paths = [out / m[k] for m in data.get("models", {}).values() for k in ("f16", "imatrix")
             if m.get(k)]
    paths += [out / f["path"] for f in data.get("files", {}).values() if f.get("path")]
    root = out.resolve()
    return [p for p in paths if p.resolve().is_relative_to(root)]


def discard_front(out: Path, data: dict) -> list[str]:
    """Remove what the front recorded in ``data`` wrote in ``out`` (its own files, the GGUF
    and imatrix files it recorded, its folders when left empty); nothing else is touched.
    Returns the removed paths."""
    removed = []
    for p in [*_written(out, data), *(out / n for n in OWN_FILES)]:
        if p.is_file() and not p.is_symlink():
            p.unlink()
            removed.append(str(p))
    for name in OWN_DIRS:
        d = out / name
        if d.is_dir() and not d.is_symlink() and not any(d.iterdir()):
            d.rmdir()
    return removed


def load_front(out: str | Path) -> dict:
    """A finished (or partial) front's ``front.json``."""
    data = _read_state(Path(out) / STATE)
    if data is None:
        raise ConfigError(f"{out} holds no front ({STATE}): build one with prunelab front "
                          "--model M --out DIR")
    return data
