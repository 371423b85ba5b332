"""Resumable state of a heal run: data order, fingerprint, atomic checkpoints.

The batch of step ``t`` is a pure function of the seed and ``t`` (windows ``t*B ..
(t+1)*B - 1`` of the concatenation of one seeded permutation per epoch), so the data
position is the step. A checkpoint (``heal-state.pt`` in the run's folder, written to a
temporary file, fsynced and renamed) holds the trainable tensors, the optimizer state,
torch's RNG state, the step, the evaluation history and the best state, the prune-event
log with the student's weights after the last event, and the REP-LIE / CascadeFlow
accumulators; ``heal-state.json`` beside it is a readable summary. A checkpoint made with
another config, data or model is refused (:class:`~prunelab.errors.ResumeMismatchError`).

The state folder is heal's own: :func:`claim_state_dir` creates it and marks it with
``prunelab-heal-state.json`` (a format id), and refuses an existing folder that is not a
heal state (a user's folder, a model, ``.``, ``..``) or a file; :func:`release_state_dir`
removes only a marked folder, and in it only heal's own files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from prunelab.errors import CorruptCheckpointError, OutputWriteError, ResumeMismatchError
from prunelab.io.files import check_not_input, check_output_path, write_json

STATE_FILE = "heal-state.pt"
SUMMARY_FILE = "heal-state.json"
MARKER_FILE = "prunelab-heal-state.json"
STATE_FORMAT = "prunelab-heal-state/1"


def _is_own(name: str) -> bool:
    """A name heal writes in its state folder (its files, temp files and locks)."""
    if name in (STATE_FILE, SUMMARY_FILE, MARKER_FILE):
        return True
    return name.startswith((".heal-state.", f".{SUMMARY_FILE}.", f".{MARKER_FILE}."))


def _marked(folder: Path) -> bool:
    try:
        return json.loads((folder / MARKER_FILE).read_text()).get("format") == STATE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_state_dir(path: str | Path, inputs: dict | None = None,
                    outputs: dict | None = None) -> Path:
    """Refuse, in one line and before any work, a ``--state`` that heal may not use: an
    unusable path (:func:`~prunelab.io.files.check_output_path`: ``.``, ``..``, an
    unwritable parent...), one of the run's ``inputs`` or ``outputs`` (or inside / holding
    one), a file, a folder that is not heal's own state, a folder without write
    permission."""
    folder = check_output_path(path, inputs=inputs)
    if outputs:
        check_not_input(folder, outputs, what="output")
    if not os.path.lexists(folder):
        return folder
    if not folder.is_dir():
        raise OutputWriteError(f"--state {folder} is a file, not a folder: give a new folder "
                               "path (heal creates its state folder itself)")
    try:
        names = [p.name for p in folder.iterdir()]
    except OSError as exc:
        raise OutputWriteError(f"--state {folder} cannot be read: {exc.strerror}") from exc
    legacy = STATE_FILE in names and all(_is_own(n) for n in names)
    if not (_marked(folder) or legacy):
        raise OutputWriteError(f"--state {folder} is an existing folder that is not a heal "
                               f"state (no {MARKER_FILE}); heal writes and removes only a "
                               "state folder it created: give a new path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputWriteError(f"--state {folder}: no permission to write in it")
    return folder


def claim_state_dir(path: str | Path) -> Path:
    """Make ``path`` heal's state folder: create it and its marker, or accept the folder
    of an earlier heal run (:func:`check_state_dir` refuses anything else)."""
    folder = check_state_dir(path)
    if not _marked(folder):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputWriteError(f"cannot create --state {folder}: {exc.strerror}") from exc
        write_json(folder / MARKER_FILE, {"format": STATE_FORMAT,
                                          "what": "resumable state of prunelab heal; "
                                          "removed when the run ends"}, overwrite=True)
    return folder


def release_state_dir(path: str | Path) -> bool:
    """Remove heal's state folder ``path`` at the end of a run: only when it carries heal's
    marker, only heal's own files in it, and the folder itself only when that leaves it
    empty (anything else put there is kept). Returns whether the folder is gone."""
    folder = Path(path)
    if not folder.is_dir() or folder.is_symlink() or not _marked(folder):
        return False
    for entry in folder.iterdir():
        if _is_own(entry.name) and entry.name != MARKER_FILE and not entry.is_dir():
            entry.unlink(missing_ok=True)
    try:
        rest = [p for p in folder.iterdir() if p.name != MARKER_FILE]
        if rest:
            return False
        (folder / MARKER_FILE).unlink(missing_ok=True)
        folder.rmdir()
    except OSError:
        return False
    return True


class DataOrder:
    """Window indices of each step (see module docstring)."""

    def __init__(self, num_windows: int, batch_size: int, seed: int):
        self.n, self.b, self.seed = num_windows, batch_size, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=gen)
        return self._perms[epoch]

    def indices(self, step: int) -> torch.Tensor:
        pos = torch.arange(step * self.b, (step + 1) * self.b)
        return torch.stack([self._perm(int(p) // self.n)[int(p) % self.n] for p in pos])


def tensor_hash(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def fingerprint(lm, config, train_ids, eval_ids) -> dict:
    """What must match for a checkpoint to resume: the config (without ``quiet``), the
    token windows and the student's shapes."""
    cfg = {k: v for k, v in config.to_dict().items() if k != "quiet"}
    shapes = sorted((n, list(p.shape)) for n, p in lm.model.named_parameters())
    return {"config": cfg, "train": tensor_hash(train_ids), "eval": tensor_hash(eval_ids),
            "model_type": lm.model.config.model_type,
            "shapes": hashlib.sha256(repr(shapes).encode()).hexdigest()[:16]}


def save_state(out_dir: str | Path, state: dict[str, Any], summary: dict) -> None:
    """Write ``state`` atomically (temp file + fsync + rename) and its JSON summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".heal-state.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out / STATE_FILE)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    write_json(out / SUMMARY_FILE, summary, overwrite=True)


def load_state(out_dir: str | Path | None, expected: dict) -> dict | None:
    """The checkpoint in ``out_dir`` (``None`` when there is none); its fingerprint must
    equal ``expected``."""
    if out_dir is None:
        return None
    path = Path(out_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is reported in one line
        raise CorruptCheckpointError(f"cannot read {path}: {type(exc).__name__}") from exc
    found = state.get("fingerprint") if isinstance(state, dict) else None
    if found != expected:
        what = _first_difference(found or {}, expected)
        raise ResumeMismatchError(f"{path} was made with another {what}; use another folder "
                                  "or delete it")
    return state


def _first_difference(found: dict, expected: dict) -> str:
    for key in ("config", "train", "eval", "model_type", "shapes"):
        if found.get(key) != expected.get(key):
            if key == "config":
                diff = [k for k in expected["config"]
                        if (found.get("config") or {}).get(k) != expected["config"][k]]
                return f"config ({', '.join(diff[:3])})" if diff else "config"
            return {"train": "training data", "eval": "evaluation data",
                    "model_type": "model", "shapes": "model (shapes differ)"}[key]
    return "fingerprint"


def rng_state() -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor | None) -> None:
    if state is not None:
        torch.set_rng_state(state)
