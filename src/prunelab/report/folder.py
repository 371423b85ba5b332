"""Build ``report.html`` from a folder of prunelab's outputs (``prunelab report DIR``).

What is recognised (any mix; nothing else in the folder is read):

- probe results: ``NAME.json`` of a registered probe, at the top or in ``probes/``, and
  ``summary.md`` beside them (a probe run; a sweep keeps its probes in ``probes/``);
- a depth sweep: ``sweep.json`` (its fingerprint gives the model summary), ``points.json``
  (the leaderboard), ``dense.json``, ``curve.png`` and ``curve.md``;
- a comparison or a run: ``leaderboard.csv`` (the leaderboard), ``manifest.json`` (the
  model summary), the executor's ``points/<key>/result.json`` (a leaderboard when no CSV
  is there), ``recipe.yaml`` / ``recipe.yml``;
- a served front (``prunelab front``): ``front.md`` (the table) and ``front_size.png`` /
  ``front_speed.png`` (perplexity against size and against generation speed);
- ``commands.txt`` (the commands that made the folder; :func:`record_command` appends
  them) and every other top-level ``*.png`` (plots).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from prunelab.errors import ConfigError
from prunelab.io.files import check_output_path
from prunelab.report.html import write_report

SWEEP_COLUMNS = ["probe", "strategy", "recovery", "removed_count", "removed_blocks",
                 "test_perplexity", "test_kl", "test_top1", "params", "error"]
COMMANDS = "commands.txt"


def record_command(out_dir: str | Path, argv: list[str] | None = None) -> None:
    """Append ``prunelab ARGS`` (default: this process's arguments) to
    ``out_dir/commands.txt``, unless it is already its last line."""
    args = list(sys.argv[1:] if argv is None else argv)
    line = "prunelab " + shlex.join(args)
    path = Path(out_dir) / COMMANDS
    old = path.read_text().splitlines() if path.is_file() else []
    if old and old[-1] == line:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(line + "\n")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def load_probes(folder: Path) -> dict:
    """name -> ProbeResult for every registered probe's ``NAME.json`` in ``folder``."""
    from prunelab.probes.base import PROBES, ProbeResult

    out = {}
    for path in sorted(folder.glob("*.json")):
        if path.stem not in PROBES:
            continue
        try:
            out[path.stem] = ProbeResult.load(path)
        except (KeyError, TypeError, ValueError):
            continue
    return out


def fingerprint_summary(fp: Any, options: bool = True) -> dict[str, Any]:
    """Model / dtype / data lines of a fingerprint (:mod:`prunelab.io.fingerprint`), with
    its options unless ``options`` is False."""
    if not isinstance(fp, dict):
        return {}
    model, data = fp.get("model") or {}, fp.get("data") or {}
    out = {"model": model.get("spec") or model.get("source"),
           "model type": model.get("model_type"), "dtype": fp.get("dtype"),
           "calibration data": _data_line(data), "prunelab": fp.get("prunelab")}
    if fp.get("test_data"):
        out["test data"] = _data_line(fp["test_data"])
    if options and fp.get("options"):
        out["options"] = fp["options"]
    return {k: v for k, v in out.items() if v not in (None, "", {})}


def _data_line(d: dict) -> str | None:
    if not isinstance(d, dict) or not d.get("spec"):
        return None
    return (f"{d['spec']} ({d.get('samples')} windows x {d.get('seqlen')} tokens, "
            f"seed {d.get('seed')})")


def _manifest_summary(man: Any) -> dict[str, Any]:
    if not isinstance(man, dict):
        return {}
    keep = {}
    for k, v in man.items():
        if isinstance(v, (str, int, float, bool)) or (
                isinstance(v, dict) and len(json.dumps(v, default=str)) < 300):
            keep[k] = v
    return keep


def _points_rows(folder: Path) -> list[dict]:
    rows = []
    for res in sorted((folder / "points").glob("*/result.json")):
        d = _read_json(res)
        if isinstance(d, dict):
            rows.append({"point": res.parent.name, **{
                k: v for k, v in d.items() if isinstance(v, (str, int, float, bool, list))
                or v is None}})
    return rows


def _sweep_parts(folder: Path, kw: dict, used: set[str]) -> None:
    marker = _read_json(folder / "sweep.json")
    kw["summary"].update(fingerprint_summary((marker or {}).get("fingerprint")))
    dense = _read_json(folder / "dense.json")
    if isinstance(dense, dict) and dense.get("perplexity") is not None:
        kw["summary"]["dense test perplexity"] = dense["perplexity"]
    points = _read_json(folder / "points.json")
    if isinstance(points, list) and points:
        key = ("probe", "recovery", "removed_count")
        kw["leaderboard"] = [{c: p.get(c) for c in SWEEP_COLUMNS}
                             for p in sorted(points, key=lambda p: tuple(str(p.get(k)).zfill(6)
                                                                         for k in key))]
    if (folder / "curve.md").is_file():
        kw["sections"]["Depth pruning curve"] = (folder / "curve.md").read_text()
    if (folder / "curve.png").is_file():
        used.add("curve.png")
        kw["plots"]["depth pruning curve (curve.png)"] = folder / "curve.png"


def report_inputs(folder: str | Path) -> dict[str, Any]:
    """The :func:`~prunelab.report.html.write_report` arguments for ``folder`` (see the
    module docstring); refuses in one line a folder with nothing of prunelab's."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder")
    kw: dict[str, Any] = {"title": f"prunelab report: {folder.resolve().name}",
                          "summary": {}, "plots": {}, "sections": {}}
    used: set[str] = set()
    probes = load_probes(folder) or load_probes(folder / "probes")
    if probes:
        kw["probes"] = probes
        used.update(f"{n}.png" for n in probes)
        used.update({"swap_heatmaps.png", "swap_diagonals.png"})
        first = next(iter(probes.values()))
        kw["summary"].update(fingerprint_summary(first.meta.get("fingerprint"), options=False))
        if (folder / "summary.md").is_file():
            kw["probe_summary"] = (folder / "summary.md").read_text()
    if (folder / "sweep.json").is_file():
        _sweep_parts(folder, kw, used)
    kw["summary"].update(_manifest_summary(_read_json(folder / "manifest.json")))
    if (folder / "leaderboard.csv").is_file():
        kw["leaderboard"] = folder / "leaderboard.csv"
    if (folder / "served.md").is_file():  # a run's export stages (llama.cpp figures)
        text = (folder / "served.md").read_text()
        kw["sections"]["Served in llama.cpp"] = text.split("\n", 1)[-1].lstrip("\n")
    if (folder / "front.md").is_file():  # prunelab front: the served front's table
        text = (folder / "front.md").read_text()
        kw["sections"]["Served front (llama.cpp)"] = text.split("\n", 1)[-1].lstrip("\n")
        for name, what in (("front_size.png", "size"), ("front_speed.png", "speed")):
            if (folder / name).is_file():
                used.add(name)
                kw["plots"][f"served front: perplexity vs {what} ({name})"] = folder / name
    elif "leaderboard" not in kw and (rows := _points_rows(folder)):
        kw["leaderboard"] = rows
    for name in ("recipe.yaml", "recipe.yml"):
        if (folder / name).is_file():
            kw["recipe"] = (folder / name).read_text()
            break
    if (folder / COMMANDS).is_file():
        kw["commands"] = (folder / COMMANDS).read_text()
    for png in sorted(folder.glob("*.png")):
        if png.name not in used:
            kw["plots"][png.name] = png
    if not (probes or kw.get("leaderboard") or kw["summary"] or kw["plots"]):
        raise ConfigError(f"{folder} holds no probe result, sweep, leaderboard, manifest or "
                          "plot of prunelab's to report on")
    return {k: v for k, v in kw.items() if v not in ({}, None)}


def report_sources(folder: str | Path) -> list[Path]:
    """The files :func:`report_inputs` reads in ``folder``: what a report may never be
    written over (``folder`` itself is a folder, which a report never replaces)."""
    folder = Path(folder)
    found: list[Path] = []
    for pattern in ("*.json", "probes/*.json", "probes/summary.md", "*.png", "*.md",
                    "leaderboard.csv", "recipe.yaml", "recipe.yml", COMMANDS,
                    "points/*/result.json"):
        found.extend(p for p in folder.glob(pattern) if p.is_file())
    return found


def build_report(folder: str | Path, out: str | Path | None = None,
                 overwrite: bool = False) -> Path:
    """Write the report of ``folder`` to ``out`` (default ``folder/report.html``). An
    existing file is replaced only with ``overwrite``; the report may never be written
    over a file it reads (nor over ``folder``), with or without ``overwrite``. Everything
    is checked before the page is built."""
    target = Path(out) if out is not None else Path(folder) / "report.html"
    if Path(folder).is_dir():
        check_output_path(target, kind="file", overwrite=overwrite,
                          inputs={"report source": report_sources(folder)})
    kw = report_inputs(folder)
    return write_report(target.parent, filename=target.name, overwrite=overwrite, **kw)
