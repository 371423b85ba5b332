"""What the conversions into the cache share (GGUF, ONNX DINOv2, CTranslate2 Whisper):
publishing a checkpoint folder once, the errors reading a GGUF file raises, and the short
one-line texts their error messages use."""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

from prunelab.io.lock import clean_leftovers, publish_once, temp_prefix

#: what reading an unreadable GGUF file (empty, garbage, unsupported) raises
GGUF_ERRORS = (ValueError, OSError, KeyError, IndexError, EOFError, struct.error)


def publish_checkpoint(target: Path, write) -> None:
    """Run ``write(tmp)`` in a temp folder beside ``target``, then install it with
    :func:`~prunelab.io.lock.publish_once` (a complete ``target`` is never replaced)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(target)))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)
        publish_once(tmp, target, lambda t: (t / "config.json").is_file())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def short_names(keys: list[str], known: set[str] | None = None, whole: bool = False,
           limit: int = 3) -> str:
    """Name ``keys`` briefly: ``model.layers.4-5 (whole blocks)`` when ``whole`` and every
    weight of those blocks is listed (or, for unexpected keys, none belongs to the model),
    else the first ``limit`` names and a count of the rest."""
    blocks: dict[tuple[str, int], list[str]] = {}
    rest = []
    for k in keys:
        m = re.match(r"(.+?)\.(\d+)\.", k)
        if m and known is not None:
            blocks.setdefault((m.group(1), int(m.group(2))), []).append(k)
        else:
            rest.append(k)
    entire: dict[str, list[int]] = {}
    for (prefix, i), ks in blocks.items():
        ours = {a for a in known if a.startswith(f"{prefix}.{i}.")}
        if (ours <= set(ks)) if whole else not ours:
            entire.setdefault(prefix, []).append(i)
        else:
            rest.extend(ks)
    parts = [f"{p}.{ranges(sorted(ix))} (whole blocks)" for p, ix in entire.items()]
    parts += sorted(rest)
    text = ", ".join(parts[:limit])
    return text + (f" and {len(parts) - limit} more" if len(parts) > limit else "")


def ranges(ix: list[int]) -> str:
    """``[4, 5, 7]`` -> ``4-5,7``."""
    out, start = [], ix[0]
    for a, b in zip(ix, ix[1:] + [None], strict=True):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
