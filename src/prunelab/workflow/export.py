"""``prunelab export``: cut an elastic checkpoint to a smaller plain model, or write any
model as a GGUF file for llama.cpp (:mod:`prunelab.checkpoint.gguf_export`)."""

from __future__ import annotations

from pathlib import Path

from prunelab.api import load, save
from prunelab.checkpoint.gguf_export import OUT_TYPES, QUANT_TYPES, write_gguf
from prunelab.checkpoint.imatrix import read_imatrix
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.io.files import check_output_path
from prunelab.io.manifest import read_manifest
from prunelab.models.gguf_llama import require_llama_cpp
from prunelab.models.loading import check_model_path
from prunelab.pruning.width.elastic.method import cut


def export(model: str, keep: float, out: str | Path, allocation: str = "global",
           round_to: int = 8, overwrite: bool = False, device: str = "cpu",
           dtype: str = "auto") -> Path:
    """``prunelab export --model DIR --budget keep-units:0.7 --out SMALL``: load an elastic
    checkpoint, cut it and save the smaller model (manifest: the cut as a width operation)."""
    check_output_path(out, kind="checkpoint", overwrite=overwrite, inputs={"--model": model})
    lm = load(model, dtype=dtype, device=device, trust_remote_code=True)
    _from_manifest_history(lm)
    cut(lm, keep, allocation, round_to)
    return save(lm, out, overwrite=overwrite,
                extra={"elastic_export": {"keep": keep, "allocation": allocation,
                                          "source": str(model)}})


def export_gguf(model: str, out: str | Path, out_type: str = "f16",
                overwrite: bool = False, device: str = "cpu", dtype: str = "float32",
                trust_remote_code: bool = False, imatrix: str | Path | None = None) -> dict:
    """``prunelab export --format gguf --model M --out FILE.gguf``: load ``model`` (a
    prunelab checkpoint, an embedded model, a hub id) and write it as one GGUF file; the
    file's ``prunelab.operations`` key holds the checkpoint's operations. ``imatrix``: an
    importance matrix file for llama.cpp's quantizer (quantized types only; read and
    checked before the model is loaded)."""
    if out_type not in OUT_TYPES and out_type not in QUANT_TYPES:
        raise ConfigError(f"--outtype must be one of {' | '.join([*OUT_TYPES, *QUANT_TYPES])}"
                          f", got {out_type!r}")
    if imatrix is not None and out_type not in QUANT_TYPES:
        raise ConfigError(f"--imatrix weighs llama.cpp's quantizer: it needs a quantized "
                          f"--outtype, not {out_type}")
    if imatrix is None and out_type in QUANT_TYPES and QUANT_TYPES[out_type].needs_imatrix:
        raise ConfigError(f"--outtype {out_type} needs an importance matrix (llama.cpp "
                          "refuses it without one): give --imatrix FILE (prunelab imatrix "
                          "writes one)")
    check_output_path(out, kind="file", overwrite=overwrite, inputs={"--model": model})
    if out_type in QUANT_TYPES:  # a missing --model is said first, then a missing module
        check_model_path(model)
        require_llama_cpp()  # before the model is loaded
    if (Path(model) / "elastic.json").is_file():
        raise UnsupportedOperationError(
            "GGUF export: an elastic checkpoint holds every size: cut one first (prunelab "
            "export --model DIR --budget keep-units:F --allocation uniform --out SMALL), "
            "then export SMALL")
    im = read_imatrix(imatrix) if imatrix is not None else None
    lm = load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    _from_manifest_history(lm)
    ops = [{k: v for k, v in op.items() if k in ("operation", "method", "config")}
           for op in lm.history]
    return write_gguf(lm, out, out_type, overwrite=overwrite, operations=ops, imatrix=im)


def _from_manifest_history(lm) -> None:
    """Carry the source checkpoint's operations into ``lm.history`` (so the exported
    manifest tells the whole story), without the bulky ranking."""
    base = Path(str(lm.source))
    man = read_manifest(base) if base.is_dir() else None
    if man is not None and not lm.history:
        ops = man.get("operations", [])
        lm.history.extend({k: v for k, v in op.items() if k != "ranking"} for op in ops)
