"""Atomic checkpoint and JSON writes, and the manifest that explains every output.

A checkpoint is written to a temporary directory next to the target and renamed into
place, so a crash never leaves a half-written output; an existing target is refused
unless ``overwrite=True`` (then it is replaced only after the new one is complete).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from prunelab.errors import OutputExistsError, PrunelabError
from prunelab.models.size import model_size


def versions() -> dict[str, str]:
    import torch
    import transformers

    import prunelab

    return {"prunelab": prunelab.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def build_manifest(lm, *, operation: str | None = None, config: dict | None = None,
                   data: Any = None, before: dict | None = None,
                   metrics: dict | None = None, extra: dict | None = None) -> dict:
    """The manifest of a prunelab output (plain JSON-serialisable dict).

    Records the source model, what was done (``lm.history`` plus ``operation``), the
    calibration data (spec, samples, seqlen, seed, sha256), library versions, parameter
    counts and bytes before/after, and metrics.
    """
    after = model_size(lm.model)
    history = list(getattr(lm, "history", []))
    if operation:
        history.append({"operation": operation, "config": config or {}})
    manifest = {
        "format": "prunelab-manifest/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source_model": {"spec": lm.spec, "source": lm.source,
                         "model_type": lm.model.config.model_type,
                         "family": lm.adapter.family},
        "operations": history,
        "data": data.to_dict() if hasattr(data, "to_dict") else data,
        "size_before": before or getattr(lm, "size_before", None) or after,
        "size_after": after,
        "num_blocks": lm.adapter.num_blocks,
        "metrics": metrics or {},
        "versions": versions(),
    }
    if extra:
        manifest.update(extra)
    return manifest


def _check_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path} exists; pass --overwrite (overwrite=True) to replace it")


def _replace(tmp: Path, target: Path) -> None:
    """Move ``tmp`` to ``target``; an old ``target`` is removed only after the move."""
    backup = None
    if target.exists():
        backup = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, backup)
    os.replace(tmp, target)
    if backup is not None:
        if backup.is_dir():
            shutil.rmtree(backup, ignore_errors=True)
        else:
            backup.unlink(missing_ok=True)


def write_json(path: str | Path, obj: Any, overwrite: bool = False) -> Path:
    """Write ``obj`` as indented JSON atomically."""
    path = Path(path)
    _check_target(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh, indent=2, default=_json_default)
        fh.write("\n")
    _replace(Path(tmp), path)
    return path


def _json_default(obj):
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def save(lm, out_dir: str | Path, manifest: dict | None = None, overwrite: bool = False) -> Path:
    """Save ``lm`` as a plain ``transformers`` checkpoint plus ``manifest.json``.

    The config is brought in line with the (pruned) shapes first; shapes a plain config
    cannot describe raise :class:`~prunelab.errors.UnsupportedOperationError`, except
    after prunelab's width pruning (per-block widths, head counts a family derives from
    ``hidden_size``): those, like models with linear bridges (ghost / lra depth
    recovery) get a modeling file and ``auto_map`` and load with
    ``trust_remote_code=True`` (see :mod:`prunelab.io.remote`).
    """
    from prunelab.io.remote import has_bridges, load_hint, write_remote_code

    out = Path(out_dir)
    _check_target(out, overwrite)
    # per-block widths from prunelab's width pruning: the modeling file resizes the
    # projections at load; other shapes a plain config cannot hold are refused
    widths = bool(lm.adapter.vanilla_problems()) and (any(
        op.get("operation") == "prune-width" for op in getattr(lm, "history", []))
        or getattr(lm.model.config, "prunelab_widths", None) is not None)
    if widths:
        lm.model.config.num_hidden_layers = lm.adapter.num_blocks
    else:
        lm.adapter.sync_config()
    remote = has_bridges(lm.model) or widths
    if getattr(lm.model, "hf_quantizer", None) is not None:
        raise PrunelabError("a quantized (GGUF) model cannot be saved; load it by prunelab "
                            "spec so it is converted to a float checkpoint first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        lm.model.save_pretrained(tmp)
        if lm.tokenizer is not None:
            lm.tokenizer.save_pretrained(tmp)
        man = dict(manifest) if manifest is not None else build_manifest(lm)
        if remote:
            man["remote_code"] = write_remote_code(lm.model, tmp)
        man["loads_with"] = (load_hint(lm.model) if remote
                             else "plain transformers (no remote code)")
        write_json(tmp / "manifest.json", man)
        os.chmod(tmp, 0o755)
        _replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
