"""Checkpoints: an atomic ``save_pretrained`` plus ``manifest.json`` (the manifest explains
every output), the generated remote code where the shapes need it, and the extra files a
method registers (:data:`SAVE_EXTRAS`). The file primitives (temporary sibling, lock,
rename into place, ``--overwrite`` rules) are :mod:`prunelab.io.files`.
"""

from __future__ import annotations

import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from prunelab._version import __version__
from prunelab.checkpoint.remote import has_bridges, has_custom_modules, load_hint, write_remote_code
from prunelab.errors import PrunelabError, UnsupportedOperationError
from prunelab.io.files import (
    MANIFEST_FORMAT,
    _check_target,
    _install,
    _os_errors,
    check_not_input,
    checkpoint_files,
    usual_mode,
    usual_modes,
    write_json,
)
from prunelab.io.lock import (
    clean_leftovers,
    fsync_tree,
    output_lock,
    temp_prefix,
)
from prunelab.models.size import model_size

#: Writers of method-owned extra files, called as ``fn(lm, tmp_folder)`` while a checkpoint
#: is assembled (a method registers one with :func:`register_save_extra`; it writes nothing
#: for a model that is not its own).
SAVE_EXTRAS: list = []


#: Files a model's users load beside its weights (processors, feature extractors, image
#: processors, chat templates, tokenizers): copied from the source checkpoint into every
#: checkpoint prunelab writes, unless the save wrote its own.
PROCESSOR_FILES = (
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "feature_extractor_config.json", "image_processor_config.json", "chat_template.json",
    "chat_template.jinja")
#: The tokenizer's own files: copied only when the model is saved without a tokenizer (a
#: saved tokenizer writes its own, and they must not be mixed with the source's).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "normalizer.json", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model", "spm.model")


def source_files(source, names=PROCESSOR_FILES) -> dict[str, Path]:
    """``{name: path}`` of the files ``names`` the source checkpoint holds: a local folder,
    or a hub id's files already in the local hub cache (no download)."""
    if not source:
        return {}
    folder = Path(str(source))
    if folder.is_dir():
        return {n: folder / n for n in names if (folder / n).is_file()}
    if str(source).count("/") != 1:
        return {}
    try:
        from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - optional
    except ImportError:
        return {}
    found = {}
    for n in names:
        try:
            hit = try_to_load_from_cache(str(source), n)
        except (ValueError, OSError):
            return {}
        if isinstance(hit, str) and Path(hit).is_file():
            found[n] = Path(hit)
    return found


def copy_source_files(lm, folder: Path) -> list[str]:
    """Copy into ``folder`` the processor / tokenizer files of ``lm``'s source that the save
    did not write (a pruned Whisper keeps its feature extractor, a DINOv2 its image
    processor, so ``AutoProcessor.from_pretrained(out)`` works as on the source)."""
    names = PROCESSOR_FILES if lm.tokenizer is not None else PROCESSOR_FILES + TOKENIZER_FILES
    copied = []
    for name, path in source_files(getattr(lm, "source", None), names).items():
        target = folder / name
        if target.exists():
            continue
        shutil.copyfile(path, target)
        target.chmod(usual_mode())
        copied.append(name)
    return sorted(copied)


def register_save_extra(fn):
    """Register ``fn(lm, folder)`` to add files to every checkpoint being saved."""
    if fn not in SAVE_EXTRAS:
        SAVE_EXTRAS.append(fn)
    return fn


def versions() -> dict[str, str]:
    return {"prunelab": __version__, "torch": torch.__version__,
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
        "format": MANIFEST_FORMAT,
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


def save(lm, out_dir: str | Path, manifest: dict | None = None, overwrite: bool = False) -> Path:
    """Save ``lm`` as a plain ``transformers`` checkpoint plus ``manifest.json``.

    The config is brought in line with the (pruned) shapes first; shapes a plain config
    cannot describe raise :class:`~prunelab.errors.UnsupportedOperationError`, except
    after prunelab's width pruning (per-block widths, head counts a family derives from
    ``hidden_size``): those, like models with linear bridges (ghost / lra depth
    recovery) get a modeling file and ``auto_map`` and load with
    ``trust_remote_code=True`` (see :mod:`prunelab.checkpoint.remote`).
    """
    out = Path(out_dir)
    check_not_input(out, {"model (the checkpoint it was loaded from)":
                          getattr(lm, "source", None)})
    _check_target(out, overwrite, "checkpoint")
    gguf_only = getattr(lm.model, "prunelab_gguf_only", None)
    if gguf_only:
        raise UnsupportedOperationError(
            f"this model cannot be saved as a checkpoint: {gguf_only}; write it to GGUF from "
            "memory (prunelab.checkpoint.gguf_export.write_gguf, as prunelab front does) or "
            "slice without gguf_only")
    # per-block widths from prunelab's width pruning: the modeling file resizes the
    # projections at load; other shapes a plain config cannot hold are refused
    widths = bool(lm.adapter.vanilla_problems()) and (any(
        op.get("operation") == "prune-width" for op in getattr(lm, "history", []))
        or getattr(lm.model.config, "prunelab_widths", None) is not None)
    if widths:
        lm.model.config.num_hidden_layers = lm.adapter.num_blocks
    else:
        lm.adapter.sync_config()
    remote = has_bridges(lm.model) or has_custom_modules(lm.model) or widths
    if getattr(lm.model, "hf_quantizer", None) is not None:
        raise PrunelabError("a quantized (GGUF) model cannot be saved; load it by prunelab "
                            "spec so it is converted to a float checkpoint first")
    with _os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(out):
            clean_leftovers(out)
            _check_target(out, overwrite, "checkpoint")
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=temp_prefix(out)))
            try:
                lm.model.save_pretrained(tmp)
                if lm.tokenizer is not None:
                    lm.tokenizer.save_pretrained(tmp)
                for write_extra in SAVE_EXTRAS:  # method-owned files (elastic.json, ...)
                    write_extra(lm, tmp)
                finish_checkpoint(lm, tmp, out, manifest, remote, overwrite)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return out


def finish_checkpoint(lm, tmp: Path, out: Path, manifest: dict | None, remote: bool,
                      overwrite: bool, **extra) -> None:
    """Copy the source's processor files, write the manifest (plus ``extra`` fields) and the
    remote code into the temporary checkpoint folder ``tmp``, make it durable and rename it
    into place at ``out``."""
    copy_source_files(lm, tmp)  # processors, feature extractors, chat templates
    man = dict(manifest) if manifest is not None else build_manifest(lm)
    man.update(extra)
    if remote:
        man["remote_code"] = write_remote_code(lm.model, tmp)
    man["loads_with"] = (load_hint(lm.model) if remote
                         else "plain transformers (no remote code)")
    man["files"] = sorted([*checkpoint_files(tmp), "manifest.json"])  # what --overwrite replaces
    write_json(tmp / "manifest.json", man)
    usual_modes(tmp)  # save_pretrained / mkdtemp leave 0600 / 0700
    fsync_tree(tmp)
    _install(tmp, out, overwrite, "checkpoint")
