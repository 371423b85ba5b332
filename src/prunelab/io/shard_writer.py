"""Write safetensors shards one tensor at a time.

``safetensors.torch.save_file`` (and :func:`prunelab.checkpoint.stream_save.write_safetensors`)
need every tensor of a file in memory at once. When the names, shapes and dtypes are known
before the values (a GGUF file's tensor table, for example), the header of each shard can
be written first and the tensors appended in order as they are produced, so only one
tensor is ever in memory. Format (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length, a JSON header mapping each name to ``dtype``, ``shape`` and
``data_offsets`` (relative to the end of the header, contiguous, no holes), then the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its checkpoint name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Split ``specs`` (kept in order) into shards of at most ``max_bytes`` of data each;
    a tensor larger than ``max_bytes`` gets a shard of its own."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (size + spec.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_name(k: int, n: int) -> str:
    """``model-0000k-of-0000n.safetensors`` (1-based, as transformers names shards)."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def _header(specs: Sequence[TensorSpec]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        header[s.name] = {"dtype": _DTYPES[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_shard(path: Path, specs: Sequence[TensorSpec],
                produce: Callable[[TensorSpec], torch.Tensor]) -> int:
    """Write one shard: the header from ``specs``, then ``produce(spec)`` for each spec in
    order, each written straight from its memory and dropped before the next is produced.
    A produced tensor must match its spec (shape and dtype); returns the bytes of data."""
    raw = _header(specs)
    total = 0
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for spec in specs:
            t = produce(spec)
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise ValueError(f"{spec.name}: produced {t.dtype} {tuple(t.shape)}, "
                                 f"planned {spec.dtype} {spec.shape}")
            t = t.detach().contiguous().cpu()
            if t.numel():
                fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            total += spec.nbytes
            del t
        fh.flush()
        os.fsync(fh.fileno())
    return total


def write_sharded(folder: Path, specs: Sequence[TensorSpec],
                  produce: Callable[[TensorSpec], torch.Tensor],
                  max_shard_bytes: int = 2 * 1024**3) -> dict[str, str]:
    """Write ``specs`` as ``model-0000k-of-0000n.safetensors`` shards of ``folder`` plus
    ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``, as
    transformers writes it); return the weight map. One tensor in memory at a time."""
    shards = plan_shards(specs, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(shards, start=1):
        name = shard_name(k, len(shards))
        total += write_shard(folder / name, group, produce)
        weight_map.update(dict.fromkeys((s.name for s in group), name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return weight_map
