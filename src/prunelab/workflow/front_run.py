"""Building a served front step by step (see :mod:`prunelab.workflow.front`).

Steps, each recorded in ``front.json`` when it ends: the dense model written as f16 with
its importance matrix; each grid point pruned (and healed), written as f16 with its own
importance matrix; every file quantized by llama.cpp and its perplexity measured inside
llama.cpp; then the speed rounds (every file once per round, the dense file of each type
first). Before the first step the time the whole front will take is estimated from a
measured forward of the dense model and said, in hours when it is that long.
"""

from __future__ import annotations

import math
import time

import torch

from prunelab import api, log
from prunelab.calib.imatrix import collect_imatrix
from prunelab.checkpoint.gguf_export import (
    fallback_note,
    fallbacks,
    plan_gguf,
    quantize_gguf,
    write_gguf,
)
from prunelab.checkpoint.imatrix import read_imatrix, write_imatrix
from prunelab.errors import PrunelabError
from prunelab.eval.llamacpp import llamacpp_perplexity, llamacpp_speed
from prunelab.io.files import write_text
from prunelab.models.gguf_llama import require_llama_cpp
from prunelab.models.size import model_size
from prunelab.report.front_plot import plot_front
from prunelab.train.config import HealConfig
from prunelab.workflow.front_grid import GridPoint, check_points, round_for
from prunelab.workflow.front_state import FrontState, adapts
from prunelab.workflow.front_table import front_rows, markdown, to_csv

#: costs in units of one float32 forward token of the dense model, fitted on SmolLM2-135M's
#: default front (2 cores): per calibration token of each method, per training token of a
#: heal (teacher forward + student forward and backward), per test token of a file in
#: llama.cpp (quantizing it included), per prompt and generated token of a speed run
PRUNE_PASSES = {"depth": 4.0, "sublayers": 8.0, "ffn": 3.5, "heads": 3.5, "slice": 5.0}
HEAL_COST, LLAMA_PPL_COST, LLAMA_PROMPT_COST, LLAMA_GEN_COST = 5.0, 4.5, 0.6, 10.0


class FrontRun:
    """One build of a front: the state, the dense model, the test windows."""

    def __init__(self, state: FrontState) -> None:
        self.state, self.s, self.out = state, state.settings, state.out
        self.dense = None
        self.windows: torch.Tensor | None = None
        self.tps = 0.0  # dense float32 forward tokens per second, measured
        self.round_to = round_for(tuple(t for t in self.s.grid_types if t != "f16"))

    # ------------------------------------------------------------------ driving
    def run(self) -> dict:
        require_llama_cpp()  # before any work
        self.dense = self._load()
        # a model llama.cpp cannot run, or a grid point it could not hold: one line, now
        check_points(self.s.points, plan_gguf(self.dense.model).arch)
        self.windows = api.tokens_for(self.dense, self.s.test, seqlen=self.s.test_seqlen,
                                      samples=self.s.windows, mode="test").input_ids
        if self.windows.shape[0] < self.s.windows:
            log.warn(f"{self.s.test} gives {self.windows.shape[0]} windows of "
                     f"{self.s.test_seqlen} tokens, not {self.s.windows}")
        steps = self._plan()
        self._announce(steps)
        with log.Steps(sum(w for _, w, _ in steps), "front", count=len(steps)) as bar:
            for label, weight, fn in steps:
                with bar.step(label, weight):
                    fn()
        return self.finish()

    def _plan(self) -> list[tuple[str, float, callable]]:
        """Every step not yet done: ``(label, estimated seconds, function)``."""
        self.tps = self._measure_tps()
        st, s = self.state, self.s
        steps = []
        for name, point in self.models():
            if not st.done_model(name):
                steps.append((f"build {name}", self._model_cost(point, name),
                              lambda n=name, p=point: self._build_named(n, p)))
            for kind in (s.types if point is None else s.grid_types):
                key = f"{name}.{kind}"
                if not st.done_file(key):
                    steps.append((f"quantize and measure {key}", self._file_cost(kind),
                                  lambda n=name, k=kind: self.make_file(n, k)))
        done = len(st.data["speed"]["rounds"])
        for r in range(done, s.rounds):
            steps.append((f"speed round {r + 1}/{s.rounds}", self._round_cost(),
                          lambda: self.speed_round()))
        return steps

    def models(self) -> list[tuple[str, GridPoint | None]]:
        """The front's models: the dense one, its domain-adapted control when the heal
        fits the calibration text and some point heals (:func:`adapts`), the grid."""
        s = self.s
        control = [("dense-heal", None)] if any(p.heal for p in s.points) and \
            adapts(s.heal) else []
        return [("dense", None), *control, *((p.name, p) for p in s.points)]

    def _announce(self, steps: list) -> None:
        total = sum(w for _, w, _ in steps)
        dense = len(self.models()) - len(self.s.points)
        files = dense * len(self.s.types) + len(self.s.points) * len(self.s.grid_types)
        when = f"{total / 3600:.1f} h" if total >= 3600 else f"{total / 60:.0f} min"
        log.info(f"front: {len(self.models())} models, {files} files, {len(steps)} steps "
                 f"left; estimated {when} on this machine (dense forward "
                 f"{self.tps:.0f} tokens/s, {self.s.n_threads} llama.cpp threads)")
        if total >= 3600:
            log.warn(f"this front will take about {total / 3600:.1f} hours: a smaller grid "
                     "(--grid), fewer types (--types / --grid-types) or a shorter heal "
                     "(--heal-set steps=N) shortens it; Ctrl-C keeps every finished step")

    # ------------------------------------------------------------------ estimates
    def _measure_tps(self) -> float:
        ids = self.windows[:1]
        with torch.no_grad():
            self.dense.model(input_ids=ids, use_cache=False)  # warm-up
            t = time.perf_counter()
            self.dense.model(input_ids=ids, use_cache=False)
        return ids.numel() / max(time.perf_counter() - t, 1e-6)

    def _model_cost(self, point: GridPoint | None, name: str) -> float:
        calib = self.s.samples * self.s.seqlen
        units = calib * 1.5 + self.s.windows * self.s.test_seqlen  # imatrix + f16 write
        if point is not None:
            units += calib * PRUNE_PASSES[point.kind]
        if (point is not None and point.heal) or name == "dense-heal":
            h = self.s.heal
            units += HEAL_COST * h.get("steps", 32) * h.get("batch_size", 4) * \
                h.get("seqlen", 256)
        return units / self.tps

    def _file_cost(self, kind: str) -> float:
        return (self.s.windows * self.s.test_seqlen * LLAMA_PPL_COST) / self.tps + 3.0

    def _round_cost(self) -> float:
        dense = len(self.models()) - len(self.s.points)
        files = dense * len(self.s.types) + len(self.s.points) * len(self.s.grid_types)
        per = (self.s.prompt * LLAMA_PROMPT_COST + self.s.gen * LLAMA_GEN_COST) / self.tps
        return files * (per + 0.5)

    # ------------------------------------------------------------------ steps
    def _load(self):
        return api.load(self.s.model, dtype=self.s.dtype, device="cpu",
                        trust_remote_code=self.s.trust_remote_code)

    def _build_named(self, name: str, point: GridPoint | None) -> None:
        """:meth:`build_model`, a user error naming the grid point it came from."""
        try:
            self.build_model(name, point)
        except PrunelabError as e:
            if point is None:
                raise
            raise type(e)(f"grid point {point.spec}: {e}") from e

    def build_model(self, name: str, point: GridPoint | None) -> None:
        """Prune (and heal) a fresh copy of the dense model, write it as f16 and its
        importance matrix; record what was done."""
        s, st = self.s, self.state
        rec: dict = {"spec": None if point is None else point.spec}
        lm = self.dense
        if name == "dense-heal":  # the control: the dense model fine-tuned as the points are
            lm = self._heal(self._load(), rec)
        if point is not None:
            lm = self._load()
            t = time.perf_counter()
            cfg = point.config(self.round_to)
            rep = api.prune(lm, cfg, data=s.data, seqlen=s.seqlen, samples=s.samples,
                            seed=s.seed)
            rec["prune"] = {"method": rep.method, "config": rep.config,
                            "seconds": round(time.perf_counter() - t, 1),
                            "size_before": rep.size_before, "size_after": rep.size_after}
            if point.heal:
                lm = self._heal(lm, rec)
        rec["params"] = model_size(lm.model)["params"]
        f16 = self.out / "gguf" / f"{name}.f16.gguf"
        t = time.perf_counter()
        rep = write_gguf(lm, f16, "f16", overwrite=True, name=name,
                         operations=[{k: v for k, v in op.items()
                                      if k in ("operation", "method", "config")}
                                     for op in lm.history])
        rec.update(f16=str(f16.relative_to(self.out)), f16_bytes=f16.stat().st_size,
                   arch=rep["arch"], blocks=rep["blocks"], ffn=rep["ffn"], heads=rep["heads"])
        if s.imatrix:
            calib = api.tokens_for(lm, s.data, seqlen=s.seqlen, samples=s.samples,
                                   seed=s.seed, mode="calib").input_ids
            im = collect_imatrix(lm, calib, dataset=s.data)
            path = write_imatrix(self.out / "imatrix" / f"{name}.imatrix.gguf", im,
                                 overwrite=True)
            rec["imatrix"] = str(path.relative_to(self.out))
        rec["seconds"] = round(time.perf_counter() - t, 1)
        st.data["models"][name] = rec
        st.save()

    def _heal(self, lm, rec: dict):
        """Heal ``lm`` with the front's heal (the dense model as the teacher of the kd /
        hidden terms); the record goes to ``rec["heal"]``."""
        t = time.perf_counter()
        teacher = self.dense if HealConfig(**self.s.heal).needs_teacher else None
        lm, heal_rec = api.heal(lm, teacher=teacher, data=self.s.data, eval_data=None,
                                **self.s.heal)
        rec["heal"] = {k: heal_rec.get(k) for k in (
            "loss", "mode", "steps", "tokens", "train_loss_first", "train_loss_last")}
        rec["heal"].update(lr=heal_rec["lr_schedule"]["peak"],
                           seconds=round(time.perf_counter() - t, 1))
        return lm

    def make_file(self, name: str, kind: str) -> None:
        """Quantize model ``name`` to ``kind`` (or take its f16 file) and measure its
        perplexity inside llama.cpp."""
        s, st = self.s, self.state
        model = st.data["models"][name]
        src = self.out / model["f16"]
        t = time.perf_counter()
        if kind == "f16":
            path, fell = src, []
        else:
            path = self.out / "gguf" / f"{name}.{kind}.gguf"
            im = read_imatrix(self.out / model["imatrix"]) if model.get("imatrix") else None
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.unlink(missing_ok=True)
            try:
                quantize_gguf(src, tmp, kind, threads=s.n_threads, imatrix=im)
                tmp.replace(path)
            finally:
                tmp.unlink(missing_ok=True)
            fell = fallbacks(path, kind)
            dense = st.data["files"].get(f"dense.{kind}", {}).get("fallbacks") or []
            extra = [f for f in fell if (f["tensor"], f["columns"]) not in
                     {(d["tensor"], d["columns"]) for d in dense}]
            if name != "dense" and (note := fallback_note(extra, kind)) is not None:
                log.warn(f"{name}.{kind}: beyond the dense file's, {note}")
        ppl = llamacpp_perplexity(path, self.windows, threads=s.n_threads)
        st.data["files"][f"{name}.{kind}"] = {
            "model": name, "type": kind, "path": str(path.relative_to(self.out)),
            "bytes": path.stat().st_size, "ppl": ppl["perplexity"], "nll": ppl["nll"],
            "nll_sem": None if math.isnan(ppl["nll_sem"]) else ppl["nll_sem"],
            "nll_windows": ppl["nll_windows"],
            "imatrix": bool(model.get("imatrix")) and kind != "f16",
            "fallbacks": fell, "seconds": round(time.perf_counter() - t, 1)}
        st.save()

    def speed_round(self) -> None:
        """Every file once, type by type, the dense file of each type first."""
        s, st = self.s, self.state
        prompt = self.windows.reshape(-1).tolist()
        prompt = (prompt * (s.prompt // max(len(prompt), 1) + 1))[:s.prompt]
        result = {}
        order = sorted(st.data["files"].items(),
                       key=lambda kv: (kv[1]["type"], kv[1]["model"] != "dense"))
        for key, rec in order:
            sp = llamacpp_speed(self.out / rec["path"], prompt, gen=s.gen,
                                threads=s.n_threads, repeats=1)
            result[key] = [sp["prompt_tokens_per_s"], sp["gen_tokens_per_s"]]
        st.data["speed"]["rounds"].append(result)
        st.save()

    # ------------------------------------------------------------------ results
    def finish(self) -> dict:
        """Mark the fronts; write front.md, front.csv, the plots and front.json."""
        st = self.state
        rows = front_rows(st.data)
        st.data["rows"] = rows
        st.save()
        write_text(self.out / "front.md", "# Served front\n\n" + markdown(st.data, rows),
                   overwrite=True)
        write_text(self.out / "front.csv", to_csv(rows), overwrite=True)
        plot_front(rows, self.out, title=f"{self.s.model}: served front in llama.cpp")
        return st.data

