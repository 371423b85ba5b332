"""The recipe of a checkpoint written outside a recipe (``prunelab prune ...``,
``prunelab heal``, the Python API), rebuilt from its ``manifest.json``.

* Every pruning operation whose ``config`` is a registered method
  (:data:`prunelab.pruning.METHODS`) becomes a ``prune`` stage, calibrated as the
  operation records (``calib``) or, for the CLI, as the manifest's ``data`` records
  (spec, samples, seqlen; seed at the top; batch size 8, the CLI's).
* A ``heal`` operation becomes a ``heal`` stage with the same
  :class:`~prunelab.heal.HealConfig`; its training and held-out data (spec, windows) come
  from the manifest's ``healing`` record. The manifest does not record the teacher:
  ``kd`` / ``hidden`` / ``mix`` take the chain's dense model (``teacher: dense``), ``ce``
  none. The prune events of REP-LIE / CascadeFlow healing are part of the heal stage.
* Chains: when the source model is itself a prunelab checkpoint (a folder with a
  manifest), its recipe comes first (recursively), and the operations it already
  records are not repeated; the recipe starts from the first dense model.

Anything else -- an operation without a registered config, a second seed, a heal without
its data record -- is a one-line :class:`~prunelab.errors.ConfigError` naming it.
"""

from __future__ import annotations

from pathlib import Path

from prunelab.errors import ConfigError
from prunelab.io.manifest import read_manifest as read_checked
from prunelab.workflow.recipe import Recipe, parse_recipe

CLI_BATCH_SIZE = 8
HEAL_EVENTS = ("rep-lie", "cascadeflow")  # prune events a heal config re-creates


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise ConfigError(f"{folder} has no manifest.json: not a prunelab checkpoint")
    return read_checked(folder)


def rebuild(man: dict, folder, depth: int = 0) -> dict:
    """The recipe (a dict) reproducing the checkpoint ``folder`` with manifest ``man``."""
    src = (man.get("source_model") or {}).get("spec")
    if not src:
        raise ConfigError(f"{folder}/manifest.json names no source model")
    ops = list(man.get("operations") or [])
    parent = _parent(src, depth)
    if parent is not None:
        pman, prec = parent
        known = list(pman.get("operations") or [])
        if ops[:len(known)] == known:
            ops = ops[len(known):]
        top = {k: v for k, v in prec.items() if k != "stages"}
        stages = [s for s in prec["stages"] if "save" not in s]
    else:
        top, stages = {"model": src}, []
    own = _stages(ops, man, folder)
    if not own and not stages:
        raise ConfigError(f"{folder}/manifest.json records no pruning or healing operation")
    _fill_top(top, own, folder)
    used = {next(iter(s.values())).get("id") for s in stages}
    for i, st in enumerate(own):
        kind, body = next(iter(st.items()))
        sid = f"{kind}-{len(stages) + i}"
        while sid in used:
            sid += "b"
        st[kind] = {"id": sid, **_fit(body, kind, top)}
    return {**top, "stages": [*stages, *own, {"save": {}}]}


def _parent(src: str, depth: int) -> tuple[dict, dict] | None:
    """``(manifest, recipe dict)`` of the source model when it is a prunelab checkpoint."""
    path = Path(src)
    if not (path.is_dir() and (path / "manifest.json").is_file()):
        return None
    if depth > 32:
        raise ConfigError(f"{src}: the chain of source checkpoints is deeper than 32")
    pman = read_manifest(path)
    raw = pman["recipe"] if isinstance(pman.get("recipe"), dict) else \
        rebuild(pman, path, depth + 1)
    return pman, parse_recipe(raw).to_dict()


def _stages(ops: list[dict], man: dict, folder) -> list[dict]:
    heals = [op for op in ops if op.get("operation") == "heal"]
    events = {(op.get("config") or {}).get("prune") for op in heals}
    out: list[dict] = []
    for op in ops:
        name = op.get("operation")
        if name == "heal":
            out.append({"heal": _heal(op, man, folder, len(heals))})
        elif op.get("method") in HEAL_EVENTS and op.get("method") in events:
            continue  # re-created by the heal stage's own prune option
        else:
            out.append({"prune": _prune(op, man, folder)})
    return out


def _prune(op: dict, man: dict, folder) -> dict:
    from prunelab.pruning import METHODS

    what = f"{op.get('operation')!r} ({op.get('method')})"
    cfg = op.get("config")
    if not isinstance(cfg, dict) or "name" not in cfg:
        raise ConfigError(f"{folder}: operation {what} has no registered config; it "
                          "cannot be turned into a recipe")
    try:
        METHODS.from_dict(dict(cfg))
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"{folder}: operation {what} cannot be turned into a recipe "
                          f"stage: {str(exc).splitlines()[0]}") from None
    body = dict(cfg)
    body["method"] = body.pop("name")
    calib = dict(op.get("calib") or {})
    if not calib:
        data = man.get("data") or {}
        if data.get("mode") not in (None, "calib") or not data.get("spec"):
            raise ConfigError(f"{folder}: operation {what} records no calibration data")
        calib = {"data": data["spec"], "samples": data.get("samples"),
                 "seqlen": data.get("seqlen"), "batch_size": CLI_BATCH_SIZE,
                 "_seed": int(data.get("seed") or 0)}
    calib = {k: v for k, v in calib.items() if v is not None}
    return {"method": body.pop("method"), **body, "calib": calib}


def _heal(op: dict, man: dict, folder, n_heals: int) -> dict:
    rec = man.get("healing") if isinstance(man.get("healing"), dict) else None
    data = (rec or {}).get("data") or {}
    if n_heals > 1 or not data.get("train"):
        raise ConfigError(f"{folder}: operation 'heal' records no training data "
                          "(healing.data); it cannot be turned into a recipe stage")
    cfg = dict(op.get("config") or rec.get("config") or {})
    train, held = data["train"], data.get("eval")
    total = train.get("total_windows")
    return {**cfg, "teacher": "none" if cfg.get("loss", "ce") == "ce" else "dense",
            "train_samples": None if train.get("samples") in (None, total)
            else train["samples"],
            "eval_samples": held.get("samples") if held else None,
            "data": train["spec"], "eval_data": held["spec"] if held else "none"}


def _fill_top(top: dict, own: list[dict], folder) -> None:
    """Top-level data / test / seed of a recipe that starts here (kept from a parent)."""
    prunes = [s["prune"] for s in own if "prune" in s]
    heals = [s["heal"] for s in own if "heal" in s]
    seeds = {p["calib"].pop("_seed") for p in prunes if "_seed" in p["calib"]}
    if len(seeds) > 1 or ("seed" in top and seeds and seeds != {top["seed"]}):
        raise ConfigError(f"{folder}: its operations were calibrated with different seeds "
                          f"({sorted(seeds | ({top['seed']} if 'seed' in top else set()))});"
                          " a recipe has one seed")
    if "data" not in top:
        first = prunes[0]["calib"].get("data") if prunes else None
        top["data"] = first or (heals[0]["data"] if heals else "wiki-vital:calib")
        if heals and heals[0]["eval_data"] != "none":
            top["test"] = heals[0]["eval_data"]
    top.setdefault("seed", seeds.pop() if seeds else 0)


def _fit(body: dict, kind: str, top: dict) -> dict:
    """``body`` without what repeats the recipe's top level (batch size, data specs)."""
    out = dict(body)
    if kind == "prune":
        calib = {k: v for k, v in out["calib"].items()
                 if not (k == "batch_size" and v == top.get("batch_size", CLI_BATCH_SIZE))}
        out["calib"] = calib
        return out
    if out.get("data") == top.get("data"):
        out.pop("data")
    if out.get("eval_data") == top.get("test", "wiki-vital:test"):
        out.pop("eval_data")
    return out


def recipe_from_checkpoint(folder: str | Path) -> Recipe:
    """The recipe that produced the checkpoint ``folder`` (from its ``manifest.json``).

    A checkpoint written by a recipe keeps that recipe (``manifest["recipe"]``); one
    written by ``prunelab prune ...`` / ``prunelab heal`` / the API is rebuilt from the
    manifest's operations (:func:`rebuild`: registered prune configs, heal configs with
    their data, chains through source checkpoints)."""
    man = read_manifest(folder)
    if isinstance(man.get("recipe"), dict):
        return parse_recipe(man["recipe"])
    return parse_recipe(rebuild(man, folder))
