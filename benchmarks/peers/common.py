"""Shared plumbing of the peer benchmarks: venvs, the worker protocol, token ids, peak RSS.

Imported by both sides: by ``run.py`` and the peer modules in prunelab's environment, and
by the workers that run inside a peer's own virtual environment (which has no prunelab).
So this module imports only the standard library at module level (numpy, torch, psutil
lazily, inside the functions that need them).

Worker protocol (one job = one fresh process):

- the driver writes the job's token ids to ``<workdir>/<name>.ids.npy`` (int64,
  ``[N, T]``) with :func:`save_ids`, which returns their :func:`ids_sha256`;
- it writes a JSON spec (``spec.json``: the ids' path and hash and the job's settings)
  and runs ``<venv python> <worker.py> --spec spec.json --result result.json``
  (:func:`run_worker`), under the driver's CPU affinity (``taskset -c 1`` when started so)
  and with one BLAS / OpenMP thread (:data:`ONE_THREAD`);
- the worker loads the ids with :func:`load_ids`, which recomputes the hash and refuses
  ids that do not match, and writes its JSON result, which carries the hash it saw
  (``ids_sha256``); the driver checks it again with :func:`check_result_ids`.

Peak memory on both sides is prunelab's own ``prunelab.eval.speed.PeakRSS`` (RSS sampled
every 2 ms), loaded from its source file by :func:`peak_rss_class` so a peer's venv
measures with the same code without importing prunelab.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / ".bench" / "peers"
SPEED_PY = ROOT / "src" / "prunelab" / "eval" / "speed.py"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel on this machine's disk (/opt/wheels)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
#: glibc settings under which RSS follows the live tensors: every block of 64 KiB or more
#: is its own mapping, returned to the system when freed. Without them the peak over the
#: baseline of one press varied by 50-70 MiB between repeats in one process (freed heap
#: kept or not), more than the differences measured; with them, within 2 MiB. They cost
#: both sides the same page faults (about 20 % more CPU time in the press runs).
EXACT_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
MiB = 2**20


class IdsMismatch(RuntimeError):
    """The token ids a side used are not the ids the driver wrote."""


# --------------------------------------------------------------------------- token ids

def ids_sha256(ids) -> str:
    """sha256 over ``"<N>x<T>:"`` then the ids as little-endian int64, row-major.

    ``ids``: a 2-D integer numpy array or torch tensor ``[N, T]``. Shape and dtype enter
    the hash, so a transposed or truncated copy of the same numbers hashes differently.
    """
    import numpy as np

    if hasattr(ids, "detach"):  # torch tensor
        ids = ids.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(ids), dtype="<i8")
    if arr.ndim != 2:
        raise ValueError(f"token ids must be 2-D [N, T], got shape {arr.shape}")
    h = hashlib.sha256(f"{arr.shape[0]}x{arr.shape[1]}:".encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def save_ids(path: Path, ids) -> str:
    """Write ``ids`` ``[N, T]`` as an int64 ``.npy`` file; returns their hash."""
    import numpy as np

    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(ids), dtype="<i8")
    np.save(path, arr, allow_pickle=False)
    return ids_sha256(arr)


def load_ids(path, expected_sha256: str):
    """The ids saved at ``path`` (numpy int64 ``[N, T]``), after checking their hash."""
    import numpy as np

    arr = np.load(path, allow_pickle=False)
    got = ids_sha256(arr)
    if got != expected_sha256:
        raise IdsMismatch(f"token ids {path}: sha256 {got[:12]} != expected "
                          f"{expected_sha256[:12]}")
    return arr


def save_ragged(path: Path, rows) -> tuple[str, list[int]]:
    """Write 1-D token id rows of different lengths as one ``[1, sum]`` int64 ``.npy``;
    returns its hash and the lengths (to give :func:`load_ragged`)."""
    import numpy as np

    arrs = [np.asarray(r.detach().cpu().numpy() if hasattr(r, "detach") else r,
                       dtype="<i8").reshape(-1) for r in rows]
    return save_ids(path, np.concatenate(arrs)[None]), [int(a.size) for a in arrs]


def load_ragged(path, expected_sha256: str, lengths: list[int]) -> list:
    """The rows :func:`save_ragged` wrote (hash checked), as ``[1, n_i]`` numpy arrays."""
    arr = load_ids(path, expected_sha256)[0]
    if sum(lengths) != arr.size:
        raise IdsMismatch(f"token ids {path}: {arr.size} ids, the lengths add to "
                          f"{sum(lengths)}")
    out, at = [], 0
    for n in lengths:
        out.append(arr[at:at + n][None])
        at += n
    return out


def check_result_ids(result: dict, expected_sha256: str, side: str) -> None:
    """A worker's result must name the ids the driver gave it."""
    got = result.get("ids_sha256")
    if got != expected_sha256:
        raise IdsMismatch(f"{side}: ran on token ids {str(got)[:12]}, the driver wrote "
                          f"{expected_sha256[:12]}")


# ------------------------------------------------------------------------ peak memory

def peak_rss_class():
    """prunelab's ``PeakRSS`` loaded from ``src/prunelab/eval/speed.py`` (no package
    import, so it works inside a peer's venv)."""
    spec = importlib.util.spec_from_file_location("_prunelab_speed", SPEED_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PeakRSS


def trim_heap() -> None:
    """Return free heap pages to the system (glibc ``malloc_trim``) before a baseline."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


# ------------------------------------------------------------------------------ venvs

def venv_python(name: str) -> Path:
    return BENCH / f"{name}-venv" / "bin" / "python"


def probe_venv(py: Path, imports: list[str]) -> dict | None:
    """``{module: version}`` if ``py`` imports every module of ``imports``, else None."""
    if not py.is_file():
        return None
    code = ("import importlib, json; v = {}\n"
            f"for m in {imports!r}:\n"
            "    mod = importlib.import_module(m)\n"
            "    v[m] = getattr(mod, '__version__', '?')\n"
            "print('VERSIONS', json.dumps(v))")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True,
                       env={**os.environ, **ONE_THREAD})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("VERSIONS ")]
    if r.returncode != 0 or not lines:
        return None
    return json.loads(lines[-1].removeprefix("VERSIONS "))


def ensure_venv(name: str, pins: list[str], imports: list[str]) -> tuple[Path, dict]:
    """The venv ``.bench/peers/<name>-venv`` with ``pins`` installed; created on first use.

    torch is installed first at :data:`TORCH_PIN` (the CPU wheel; an unpinned torch pulled
    by a peer would be a CUDA build), then ``pins`` with torch pinned again. Reused when
    it imports ``imports``. Returns the venv's Python and ``{module: version}``; raises
    ``RuntimeError`` with the log's last lines when the install fails.
    """
    py = venv_python(name)
    found = probe_venv(py, imports)
    if found is not None:
        return py, found
    BENCH.mkdir(parents=True, exist_ok=True)
    log = BENCH / f"{name}-install.log"
    steps = [[sys.executable, "-m", "venv", str(py.parent.parent)],
             [str(py), "-m", "pip", "install", "--progress-bar", "off", TORCH_PIN],
             [str(py), "-m", "pip", "install", "--progress-bar", "off", TORCH_PIN, *pins]]
    print(f"{name}: installing {' '.join(pins)} into {py.parent.parent} (log {log})",
          flush=True)
    with open(log, "a") as fh:
        for cmd in steps:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                tail = log.read_text(errors="replace").splitlines()[-8:]
                raise RuntimeError(f"{name}: `{' '.join(cmd[2:])}` failed (exit {rc}): "
                                   + " | ".join(tail))
    found = probe_venv(py, imports)
    if found is None:
        raise RuntimeError(f"{name}: the venv does not import {imports}; see {log}")
    return py, found


# ----------------------------------------------------------------------------- workers

def run_worker(python, script: Path, spec: dict, workdir: Path, tag: str,
               timeout: float | None = None, env: dict | None = None) -> dict:
    """Run ``script`` under ``python`` in a fresh process on ``spec``; its JSON result.

    The spec goes in as ``<workdir>/<tag>.spec.json``; stdout and stderr go to
    ``<tag>.log``. The job gets its own session (``start_new_session``: on Linux with
    autogroup scheduling, concurrent jobs on a shared core are then scheduled as separate
    groups, not as one). A failed job returns ``{"error": ..., "log": ...}`` with the log's last
    lines, never raises (one peer's failure must not stop the others). ``env``: more
    environment variables (e.g. :data:`EXACT_RSS`).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = workdir / f"{tag}.spec.json", workdir / f"{tag}.result.json"
    log_path = workdir / f"{tag}.log"
    spec_path.write_text(json.dumps(spec, indent=2))
    result_path.unlink(missing_ok=True)
    cmd = [str(python), str(script), "--spec", str(spec_path), "--result", str(result_path)]
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, **ONE_THREAD, **(env or {})},
                                start_new_session=True).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0 or not result_path.is_file():
        tail = log_path.read_text(errors="replace").splitlines()[-6:]
        return {"error": f"exit {rc}: " + " | ".join(t.strip() for t in tail),
                "log": str(log_path)}
    out = json.loads(result_path.read_text())
    out["process_seconds"] = time.perf_counter() - t0
    return out


def worker_io(argv=None) -> tuple[dict, Path]:
    """A worker's ``--spec`` (parsed) and ``--result`` path."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    return json.loads(Path(a.spec).read_text()), Path(a.result)


def one_thread() -> None:
    """Inside a worker: one intra-op thread, as the driver's side."""
    import torch

    torch.set_num_threads(1)
