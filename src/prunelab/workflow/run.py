"""Run a recipe, resumably (``prunelab run RECIPE.yaml --out DIR``).

Each stage is a point of :mod:`prunelab.workflow.executor` keyed by its id, whose payload
is the stage's content hash (:func:`~prunelab.workflow.recipe.stage_hashes`: its options,
the top-level fields and the hash of the model it starts from). A stage whose
``OUT/points/<id>/result.json`` holds the same hash is not redone; an interrupted stage
is (the result is written last). A model-producing stage (``prune``, ``heal``) also
writes its model to ``OUT/points/<id>/model`` (a checkpoint whose manifest keeps the
recipe reproducing it), so a later stage starting from it -- in this run or a resumed
one -- loads it instead of recomputing. ``OUT/run.json`` is the run's manifest (the
recipe, every stage's hash, whether it ran or was reused, its seconds).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import hashlib
import inspect
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from prunelab import log
from prunelab.errors import ConfigError, OutputExistsError, PrunelabError
from prunelab.io.files import write_json, write_text
from prunelab.io.manifest import read_manifest
from prunelab.workflow import evaluate as evaluation
from prunelab.workflow.check import check_recipe, stage_label, unflag
from prunelab.workflow.executor import Point, finished, point_dir, record
from prunelab.workflow.leaderboard import write_study
from prunelab.workflow.recipe import (
    Recipe,
    chain_recipe,
    load_recipe,
    stage_hashes,
    unhashed_inputs,
)
from prunelab.workflow.run_ray import run_stages_on_ray
from prunelab.workflow.stages import MODEL_STAGES, RUN_OWN, Stage

RUN_FILE = "run.json"


def check_runnable(recipe: Recipe, out: Path | None = None) -> None:
    """Errors that only the installed library can tell, and every check that needs no
    weights (:mod:`prunelab.workflow.check`), before anything runs."""
    from prunelab import api
    for i, st in enumerate(recipe.stages):
        if st.kind == "evaluate" and st.options.tasks and \
                "tasks" not in inspect.signature(api.evaluate).parameters:
            raise ConfigError(f"stage {i} (evaluate): tasks needs downstream-task "
                              "evaluation (api.evaluate(tasks=...)), not in this install")
    check_recipe(recipe, out)


def prepare_out(out: Path, overwrite: bool) -> None:
    """Resume a run (or comparison) folder -- one holding ``run.json`` or ``points/`` --
    and refuse any other non-empty folder; ``overwrite`` discards a previous run's
    results (never a folder that is not a run)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputExistsError(f"{out} is a file; --out names a run folder")
    if not any(out.iterdir()):
        return
    if not ((out / RUN_FILE).is_file() or (out / "points").is_dir()):
        raise OutputExistsError(f"{out} exists and is not a prunelab run or comparison "
                                "folder: choose another --out")
    if overwrite:
        discard_run(out)


def discard_run(out: Path) -> list[str]:
    """Remove what a run or comparison wrote in ``out`` (:data:`RUN_OWN`, ``compare.json``
    and the checkpoints its save stages wrote, as their manifests say) and nothing else: a
    user's file beside them stays. Returns the names removed."""
    own = set(RUN_OWN) | {"compare.json"}
    removed = []
    found = [Path(root) / n for root, dirs, files in os.walk(out) for n in dirs + files]
    for child in sorted(found, key=lambda p: len(p.parts)):
        if not child.exists() and not child.is_symlink():
            continue  # inside something already removed
        rel = child.relative_to(out)
        mine = (len(rel.parts) == 1 and rel.parts[0] in own) or _own_checkpoint(child)
        if not mine:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
        removed.append(rel.as_posix())
    return removed


def run_recipe(recipe: Recipe | str | Path | dict, out: str | Path, *,
               overwrite: bool = False, ray: str | None = None, cpus_per_point: float = 1.0,
               gpus_per_point: float = 0.0, checked: bool = False) -> dict:
    """Run ``recipe`` into ``out`` (resuming a run already there); returns the run's
    manifest: ``{"recipe", "stages": [{id, kind, from, hash, status, seconds}],
    "results": {id: result}}``.

    ``ray`` (``auto`` or a cluster address): every stage still to run is a Ray task
    (``cpus_per_point`` / ``gpus_per_point`` each) that starts when the stages it reads
    are done (:func:`stage_deps`), so independent stages run in parallel; the ``OUT``
    layout, the hashes and the results are those of the serial run (the workers must
    see ``OUT``: one machine or a shared filesystem; :mod:`prunelab.workflow.run_ray`)."""
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    out = Path(out)
    if not checked:  # ``checked``: the caller ran check_runnable(recipe, out) already
        check_runnable(recipe, out)
    prepare_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    runner = _Runner(recipe, out)
    if ray is None:
        return runner.run()
    return run_stages_on_ray(runner, ray, cpus_per_point, gpus_per_point)


class _Runner:
    def __init__(self, recipe: Recipe, out: Path):
        self.recipe, self.out = recipe, out
        self.hashes = stage_hashes(recipe)
        self.inputs = recipe.inputs()
        self.mem: tuple[str, Any] | None = None  # (model id, LoadedModel)
        self.ref = None
        self.ref_cache: dict = {}
        self.results: dict[str, dict] = {}
        self.rows: list[dict] = []
        self.overrides: dict[str, Stage] = {}  # stages as run (resolved paths)

    def run(self) -> dict:
        for i, st in enumerate(self.recipe.stages):
            point = self._point(st)
            done = finished(self.out, point)
            if done is not None and self._outputs_exist(st, done, i):
                self.results[st.id] = done
                self.rows.append(self._row(st, "reused", 0.0))
                log.info(f"stage {i} {st.kind} {st.id}: unchanged, reused")
                skipped = unhashed_inputs(self.recipe)
                if skipped:
                    log.warn(f"stage {i} {st.kind} {st.id} reused: {skipped}")
            else:
                log.info(f"stage {i} {st.kind} {st.id}: running")
                folder = self._attempt(point)
                start = time.perf_counter()
                res = self.run_stage(i, st, folder)
                record(self.out, point, res)
                self.results[st.id] = res
                self.rows.append(self._row(st, "ran", time.perf_counter() - start))
            self._write_run()
            _release()
        return self._manifest()

    def run_stage(self, index: int, st: Stage, folder: Path) -> dict:
        """Run one stage; an error is one line naming the stage, in the recipe's words
        (``seqlen``, not ``--seqlen``)."""
        try:
            res = getattr(self, f"_{st.kind}")(st, folder)
        except PrunelabError as exc:
            label = stage_label(index, st)
            msg = str(exc)
            if msg.startswith(label):
                raise
            try:
                err = type(exc)(f"{label}: {unflag(msg)}")
            except TypeError:
                err = ConfigError(f"{label}: {unflag(msg)}")
            raise err from exc
        return {**res, "stage": st.id, "kind": st.kind, "from": self.inputs[st.id]}

    def _point(self, st: Stage) -> Point:
        return Point(st.id, {"hash": self.hashes[st.id], "kind": st.kind})

    # ------------------------------------------------------------------ plumbing
    def _attempt(self, point: Point) -> Path:
        """The stage folder for a new attempt: kept when an interrupted attempt had the
        same hash (probes and healing resume from their partial state there), else
        emptied; a half-written checkpoint is always removed."""
        folder = point_dir(self.out, point.key)
        marker = folder / "attempt.json"
        same = marker.is_file() and json.loads(marker.read_text()) == point.payload
        if folder.exists() and not same:
            shutil.rmtree(folder)
        if (folder / "model").exists():
            shutil.rmtree(folder / "model")
        folder.mkdir(parents=True, exist_ok=True)
        write_json(marker, point.payload, overwrite=True)
        return folder

    def _row(self, st: Stage, status: str, seconds: float) -> dict:
        return {"id": st.id, "kind": st.kind, "from": self.inputs[st.id],
                "hash": self.hashes[st.id], "status": status, "seconds": round(seconds, 3)}

    def _manifest(self) -> dict:
        return {"format": "prunelab-run/1", "recipe": self.recipe.to_dict(),
                "stages": self.rows, "results": self.results}

    def _write_run(self) -> None:
        m = self._manifest()
        write_json(self.out / RUN_FILE, {k: m[k] for k in ("format", "recipe", "stages")},
                   overwrite=True)

    def _checkpoint(self, st: Stage) -> Path | None:
        """The checkpoint folder a stage writes (None: the stage writes none)."""
        if st.kind in MODEL_STAGES:
            return point_dir(self.out, st.id) / "model"
        if st.kind == "save":
            return self.out / st.options.path
        if st.kind == "export":  # its one file, recorded relative to the run folder
            return self.out
        return None

    def _outputs_exist(self, st: Stage, done: dict, index: int | None = None) -> bool:
        """Whether a finished stage's checkpoint is still the one it wrote: every file
        recorded in its result (``files``: size and sha256) is there, unchanged. When not,
        says why in one line (the stage then runs again)."""
        folder = self._checkpoint(st)
        if folder is None:
            return True
        why = verify_files(folder, done.get("files"))
        if why is not None:
            at = f"stage {index} " if index is not None else "stage "
            log.warn(f"{at}{st.kind} {st.id}: {why}; running it again")
        return why is None

    def _load_kwargs(self) -> dict:
        r = self.recipe
        return {"dtype": r.dtype, "device": r.device, "trust_remote_code": r.trust_remote_code}

    def model(self, model_id: str, mutate: bool = False):
        """The model ``model_id`` (``dense`` or a model stage) leaves; ``mutate``: the
        caller changes it in place (it is then no longer kept as ``model_id``)."""
        from prunelab import api

        if self.mem is not None and self.mem[0] == model_id:
            lm = self.mem[1]
        else:
            self.mem = None  # one working model at a time (plus the dense reference)
            _release()
            if model_id == "dense":
                lm = api.load(self.recipe.model, **self._load_kwargs())
            else:
                lm = load_stage_model(point_dir(self.out, model_id) / "model",
                                      self._load_kwargs())
        self.mem = None if mutate else (model_id, lm)
        return lm

    def reference(self):
        """The dense model, loaded once, never changed (KL reference, heal teacher)."""
        from prunelab import api

        if self.ref is None:
            self.ref = api.load(self.recipe.model, **self._load_kwargs())
        return self.ref

    def calib(self, c) -> dict:
        r = self.recipe
        return {"data": c.data or r.data, "samples": c.samples or r.samples,
                "seqlen": c.seqlen or r.seqlen, "batch_size": c.batch_size or r.batch_size,
                "seed": r.seed}

    def _save_model(self, lm, st: Stage, folder: Path, extra: dict) -> None:
        from prunelab import api
        from prunelab.checkpoint.save import build_manifest

        man = build_manifest(lm, data=extra.pop("data", None), extra={
            **extra, "recipe": chain_recipe(self.recipe, st.id, overrides=self.overrides),
            "recipe_stage": st.id})
        api.save(lm, folder / "model", manifest=man)
        self.mem = (st.id, lm)

    # ------------------------------------------------------------------ stages
    def _probe(self, st: Stage, folder: Path) -> dict:
        from prunelab import api
        from prunelab.probes import PROBES, ProbeResult

        lm = self.model(self.inputs[st.id])
        c = self.calib(st.options.calib)
        pdir = folder / "probes"
        names = [PROBES.name_of(p) for p in st.options.probes]
        todo = [p for p, n in zip(st.options.probes, names, strict=True)
                if not (pdir / f"{n}.json").is_file()]  # finished in an interrupted attempt
        results = {}
        for n in names:  # the CSV / PNG of a probe whose JSON is missing are stale
            for suffix in (".csv", ".png"):
                if not (pdir / f"{n}.json").is_file():
                    (pdir / f"{n}{suffix}").unlink(missing_ok=True)
        if todo:
            results = api.probe(lm, todo, data=c["data"], seqlen=c["seqlen"],
                                samples=c["samples"], seed=c["seed"],
                                batch_size=c["batch_size"], out_dir=pdir)
        results = {n: results.get(n) or ProbeResult.load(pdir / f"{n}.json") for n in names}
        return {"probes": {name: {"json": str(pdir / f"{name}.json"),
                                  "ranking": r.ranking()} for name, r in results.items()}}

    def _prune(self, st: Stage, folder: Path) -> dict:
        from prunelab import api

        lm = self.model(self.inputs[st.id], mutate=True)
        c = self.calib(st.options.calib)
        method = self._resolved(st)
        rep = api.prune(lm, method, data=c["data"], seqlen=c["seqlen"],
                        samples=c["samples"], seed=c["seed"], batch_size=c["batch_size"])
        lm.history[-1]["calib"] = {k: c[k] for k in ("data", "samples", "seqlen",
                                                       "batch_size")}
        self._save_model(lm, st, folder, {"data": rep["data"], "report": rep.to_dict()})
        return {"report": rep.to_dict(), "files": files_record(folder / "model")}

    def _resolved(self, st: Stage):
        """The stage's method with a relative ``from_probe`` read from the run folder
        (``points/<probe stage>/probes/NAME.json``); the checkpoint's recipe keeps the
        absolute path."""
        method = st.options.method
        path = getattr(method, "from_probe", None)
        if path and not Path(path).is_absolute():
            full = (self.out / path).resolve()
            if not full.is_file():
                raise ConfigError(f"from_probe {path} is not in {self.out} "
                                  "(run the probe stage first)")
            method = dataclasses.replace(method, from_probe=str(full))
            self.overrides[st.id] = dataclasses.replace(
                st, options=dataclasses.replace(st.options, method=method))
        return method

    def _heal(self, st: Stage, folder: Path) -> dict:
        from prunelab import api

        lm = self.model(self.inputs[st.id], mutate=True)
        o = st.options
        teacher = self.reference() if o.teacher == "dense" and o.config.needs_teacher \
            else None
        lm, rec = api.heal(lm, teacher=teacher, data=o.data or self.recipe.data,
                           eval_data=heal_eval_data(o, self.recipe.test), config=o.config,
                           out_dir=folder / "heal-state", train_samples=o.train_samples,
                           eval_samples=o.eval_samples)
        self._save_model(lm, st, folder, {"healing": rec})
        return {"healing": rec, "files": files_record(folder / "model")}

    def _evaluate(self, st: Stage, folder: Path) -> dict:
        src = self.inputs[st.id]
        lm = self.model(src)
        o = st.options
        ref = self.reference() if o.reference and (src != "dense" or o.press) else None
        metrics = evaluation.evaluate_model(lm, o, data=o.data or self.recipe.test, reference=ref,
                                            reference_cache=self.ref_cache, seed=self.recipe.seed)
        return {"model": src, "metrics": metrics}

    def _save(self, st: Stage, folder: Path) -> dict:
        from prunelab import api
        from prunelab.checkpoint.save import build_manifest

        src = self.inputs[st.id]
        lm = self.model(src)
        target = self.out / st.options.path
        man = build_manifest(lm, extra={"recipe_stage": src})
        if src == "dense":
            man["recipe"] = chain_recipe(self.recipe, src, st.options.path)
        else:  # the stage's own manifest: its data, report, healing and recipe as it ran
            stored = json.loads((point_dir(self.out, src) / "model" / "manifest.json")
                                .read_text())
            man.update({k: stored[k] for k in ("data", "report", "healing", "recipe")
                        if k in stored})
            man["recipe"]["stages"][-1] = {"save": {"path": st.options.path}}
        if (target.exists() or target.is_symlink()) and not _own_checkpoint(target):
            raise OutputExistsError(f"path {st.options.path}: {target} exists and is not a "
                                    "checkpoint this run saved; remove it or choose "
                                    "another path")
        api.save(lm, target, manifest=man, overwrite=target.exists())
        return {"model": src, "path": str(target), "files": files_record(target)}

    def _export(self, st: Stage, folder: Path) -> dict:
        from prunelab.checkpoint.gguf_export import gguf_string, write_gguf

        src = self.inputs[st.id]
        lm = self.model(src)
        o = st.options
        target = self.out / o.path
        if target.exists() or target.is_symlink():
            if target.is_symlink() or not target.is_file() or gguf_string(
                    target, "prunelab.recipe_stage") is None:
                raise OutputExistsError(f"path {o.path}: {target} exists and is not a GGUF "
                                        "file this run exported; remove it or choose "
                                        "another path")
        ops = [{k: v for k, v in op.items() if k in ("operation", "method", "config")}
               for op in lm.history]
        rep = write_gguf(lm, target, o.outtype, overwrite=target.exists(), operations=ops,
                         extra={"prunelab.recipe_stage": st.id, "prunelab.model": src})
        res = {"model": src, "path": str(target),
               **{k: rep[k] for k in ("arch", "blocks", "out_type", "bytes", "tokenizer",
                                      "notes", "tensor_types") if k in rep},
               "files": {o.path: {"size": target.stat().st_size, "sha256": _sha256(target)}}}
        for note in rep["notes"]:
            log.warn(f"export {st.id}: {note}")
        if o.llamacpp:
            res["llamacpp"] = self._score_in_llamacpp(lm, target, o)
        return res

    def _score_in_llamacpp(self, lm, path: Path, o) -> dict:
        """Perplexity of the recipe's test windows inside llama.cpp beside prunelab's own
        forward, and (``speed``) llama.cpp's prompt / generation tokens per second."""
        from prunelab.data import make_batches
        from prunelab.eval.llamacpp import compare_with_llamacpp, llamacpp_speed

        windows = make_batches(lm.tokenizer, self.recipe.test, seqlen=o.seqlen,
                               samples=o.samples, seed=self.recipe.seed,
                               mode="test").input_ids
        log.info(f"scoring {path.name} inside llama.cpp ({windows.shape[0]} windows of "
                 f"{windows.shape[1]} tokens)")
        got = compare_with_llamacpp(lm, path, windows, threads=o.threads)
        got["data"] = self.recipe.test
        if o.speed:
            flat = windows.flatten().tolist()
            prompt = (flat * (512 // len(flat) + 1))[:512]
            got["speed"] = llamacpp_speed(path, prompt, gen=128, threads=o.threads)
        return got

    def _report(self, st: Stage, folder: Path) -> dict:
        rows, dense = [], None
        for sid, res in self.results.items():
            if res.get("kind") != "evaluate":
                continue
            label = res["model"] if sid.startswith("evaluate-") else sid
            rows.append({"method": label, **res["metrics"]})
            if res["model"] == "dense" and dense is None:
                dense = rows[-1]
        probes = {n: p["json"] for res in self.results.values() if res.get("kind") == "probe"
                  for n, p in res["probes"].items()}
        served = served_table([res for res in self.results.values()
                               if res.get("kind") == "export"], self.out)
        sections = {}
        if served:
            write_text(self.out / "served.md", f"# Served in llama.cpp\n\n{served}",
                       overwrite=True)
            sections[SERVED] = served
        elif (self.out / "served.md").is_file():  # from an earlier version of the recipe
            (self.out / "served.md").unlink()
        return write_study(self.out, rows, dense=dense, title=st.options.title,
                           sections=sections,
                           recipe=self.recipe.to_dict(), probes=probes,
                           commands=[f"prunelab run RECIPE.yaml --out {self.out}"],
                           summary={"model": self.recipe.model, "calibration":
                                    self.recipe.data, "test": self.recipe.test,
                                    "seed": self.recipe.seed})


SERVED = "Served in llama.cpp"


def served_table(exports: list[dict], out: Path) -> str:
    """The Markdown table of a run's export stages: file, type, size, blocks, perplexity
    from llama.cpp's logits beside prunelab's, and llama.cpp's speed (ratios to the export
    of the dense model when the run has one)."""
    if not exports:
        return ""
    dense = next((e for e in exports if e["model"] == "dense" and "llamacpp" in e), None)

    def speed(e: dict, key: str) -> str:
        sp = (e.get("llamacpp") or {}).get("speed")
        if not sp:
            return "-"
        text = f"{sp[key]:.1f}"
        base = ((dense or {}).get("llamacpp") or {}).get("speed")
        if base and e is not dense:
            text += f" ({sp[key] / base[key]:.2f}x)"
        return text

    lines = ["| stage | model | file | type | arch | blocks | MiB | ppl prunelab | "
             "ppl llama.cpp | rel. diff | prompt tok/s | generation tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in exports:
        cpp = e.get("llamacpp") or {}
        ppl = (f"{cpp['perplexity']:.3f} | {cpp['llamacpp_perplexity']:.3f} | "
               f"{100 * cpp['perplexity_rel_diff']:.2f} %") if cpp else "- | - | -"
        lines.append(f"| {e['stage']} | {e['model']} | {Path(e['path']).name} | "
                     f"{e['out_type']} | {e['arch']} | {e['blocks']} | "
                     f"{e['bytes'] / 2**20:.1f} | {ppl} | {speed(e, 'prompt_tokens_per_s')} | "
                     f"{speed(e, 'gen_tokens_per_s')} |")
    first = next((e["llamacpp"] for e in exports if e.get("llamacpp")), None)
    if first:
        sp = first.get("speed") or {}
        lines.append("")
        lines.append(f"Perplexity: {first['windows']} windows of {first['seqlen']} tokens of "
                     f"{first.get('data')}, the same token ids in both (prunelab: float32 "
                     "forward of the model before export; llama.cpp: the file)."
                     + (f" Speed: best of {sp['repeats']} runs, {sp['prompt_tokens']}-token "
                        f"prompt, {sp['gen_tokens']} generated tokens, {sp['threads']} "
                        "threads; ratios to the dense export." if sp else ""))
    return "\n".join(lines) + "\n"


def _own_checkpoint(target: Path) -> bool:
    """Whether ``target`` is a real folder holding a checkpoint a recipe's save stage
    wrote (its manifest names a ``recipe_stage``): only that is replaced by a rerun."""
    man = target / "manifest.json"
    if target.is_symlink() or not target.is_dir() or not man.is_file():
        return False
    try:
        return "recipe_stage" in json.loads(man.read_text())
    except (OSError, ValueError, TypeError):
        return False


def files_record(folder: Path) -> dict:
    """``{relative path: {"size", "sha256"}}`` of every file of a checkpoint folder, as
    written (a later run reuses the stage only if they verify: :func:`verify_files`)."""
    return {str(f.relative_to(folder)): {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(folder.rglob("*")) if f.is_file()}


def verify_files(folder: Path, recorded: Any) -> str | None:
    """None when every file of ``recorded`` (:func:`files_record`) is in ``folder`` with
    its size and sha256; else what differs, in a few words."""
    if not isinstance(recorded, dict) or not recorded:
        return f"{folder} has no recorded file hashes (written by an older prunelab)"
    for rel, want in recorded.items():
        f = folder / rel
        if not f.is_file():
            return f"{f} is missing"
        if not isinstance(want, dict) or f.stat().st_size != want.get("size"):
            return f"{f} changed size since it was written"
        if _sha256(f) != want.get("sha256"):
            return f"{f} changed since it was written (sha256 differs)"
    return None


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def heal_eval_data(o, test: str) -> str | None:
    """The held-out spec of a heal stage ``o``: its ``eval_data`` (``none``: no held-out
    evaluation), else the recipe's ``test``."""
    if o.eval_data is None:
        return test
    return None if o.eval_data.lower() == "none" else o.eval_data


def _release() -> None:
    """Free what the last stage dropped, and give it back to the system (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_stage_model(folder: Path, load_kwargs: dict):
    """A stage's checkpoint, with its history and size-before from the manifest (so a
    later manifest records every operation since the dense model)."""
    from prunelab import api

    kw = dict(load_kwargs, trust_remote_code=True)  # prunelab's own modeling file
    lm = api.load(str(folder), **kw)
    man = read_manifest(folder) or {}
    lm.history = [dict(op) for op in man.get("operations") or []]
    if man.get("size_before"):
        lm.size_before = man["size_before"]
    spec = (man.get("source_model") or {}).get("spec")
    if spec:
        lm.spec = spec
    return lm
