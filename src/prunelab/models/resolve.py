"""An embedded model's name -> what loads it: its GGUF file, or a checkpoint folder (unpacked
once, or converted once from what ships in another format: DINOv2 from ONNX, Whisper from
CTranslate2). The files themselves are found by the torch-free
:mod:`prunelab.models.embedded`."""

from __future__ import annotations

from pathlib import Path

from prunelab.models.embedded import EMBEDDED, assemble_parts, locate, unzip_once
from prunelab.models.onnx_dinov2 import convert_onnx_dinov2
from prunelab.models.whisper_ct2 import ct2_whisper_once


def resolve_embedded(name: str) -> tuple[str, Path]:
    """``("gguf", path)`` or ``("dir", path)`` for an embedded model name."""
    em = EMBEDDED[name]
    paths = locate(em)
    if em.kind == "gguf":
        return "gguf", paths[0]
    if em.kind == "gguf-parts":
        return "gguf", assemble_parts(em, paths)
    if em.kind == "onnx-dinov2":
        return "dir", convert_onnx_dinov2(paths[0], em.name)
    if em.kind == "ct2-whisper":
        return "dir", ct2_whisper_once(em.name, paths)
    return "dir", unzip_once(em, paths[0])
