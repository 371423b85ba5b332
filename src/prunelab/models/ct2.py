"""A small reader of CTranslate2's ``model.bin`` (binary format version 6), no ctranslate2.

Layout (all integers little-endian; what ``ModelSpec._serialize`` in CTranslate2's
``python/ctranslate2/specs/model_spec.py`` writes)::

    uint32   binary version (6)
    string   spec name (e.g. "WhisperSpec")
    uint32   spec revision
    uint32   number of variables V
    V times: string  name ("encoder/layer_0/self_attention/linear_0/weight")
             uint8   rank R, then R x uint32 dims
             uint8   dtype id: 0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16
             uint32  number of bytes, then the raw row-major data
    uint32   number of aliases A
    A times: string alias, string target variable name

A ``string`` is a uint16 length that counts a trailing NUL, the UTF-8 bytes, then the NUL.
Scalars (rank 0) hold model options such as ``encoder/num_heads``.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prunelab.errors import CorruptCheckpointError

SUPPORTED_VERSIONS = (5, 6)
DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")


@dataclass
class CT2Model:
    """The decoded contents of a ``model.bin``: spec name, revision, variables by name
    (numpy arrays; bfloat16 widened to float32) and aliases (alias -> target name)."""

    version: int
    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)

    def get(self, name: str) -> np.ndarray:
        """Variable ``name``, following an alias; KeyError when absent."""
        return self.variables[self.aliases.get(name, name)]

    def scalar(self, name: str, default=None):
        """A rank-0 option as a Python number (``default`` when absent)."""
        key = self.aliases.get(name, name)
        if key not in self.variables:
            return default
        return self.variables[key].reshape(()).item()


class _Reader:
    def __init__(self, fh, source: str):
        self.fh, self.source = fh, source

    def take(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise CorruptCheckpointError(f"{self.source}: truncated CTranslate2 model "
                                         f"(wanted {n} bytes, got {len(data)})")
        return data

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def string(self) -> str:
        raw = self.take(self.u16())
        if not raw or raw[-1] != 0:
            raise CorruptCheckpointError(f"{self.source}: malformed string in CTranslate2 model")
        return raw[:-1].decode("utf-8")


def _array(raw: bytes, dims: tuple[int, ...], dtype_id: int, source: str, name: str):
    if dtype_id >= len(DTYPES):
        raise CorruptCheckpointError(f"{source}: variable {name} has unknown dtype {dtype_id}")
    dtype = DTYPES[dtype_id]
    if dtype == "bfloat16":  # numpy has none: widen the 16 high bits of a float32
        half = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        arr = half.view(np.float32)
    else:
        arr = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if arr.size != int(np.prod(dims, dtype=np.int64)):
        raise CorruptCheckpointError(f"{source}: variable {name} has {arr.size} values for "
                                     f"shape {list(dims)}")
    return arr.reshape(dims), dtype


def read_ct2(path: str | Path | list[str | Path]) -> CT2Model:
    """Read a CTranslate2 ``model.bin``; a list of paths is read as their concatenation
    (a model split into chunks). Raises CorruptCheckpointError on a malformed file."""
    paths = [Path(p) for p in path] if isinstance(path, (list, tuple)) else [Path(path)]
    buf = b"".join(p.read_bytes() for p in paths)
    return parse_ct2(buf, source=paths[0].name)


def parse_ct2(data: bytes, source: str = "model.bin") -> CT2Model:
    """Decode the bytes of a ``model.bin`` (see the module docstring for the layout)."""
    r = _Reader(io.BytesIO(data), source)
    version = r.u32()
    if version not in SUPPORTED_VERSIONS:
        raise CorruptCheckpointError(f"{source}: CTranslate2 binary version {version} is not "
                                     f"supported (expected {SUPPORTED_VERSIONS})")
    spec, revision = r.string(), r.u32()
    variables, dtypes = {}, {}
    for _ in range(r.u32()):
        name = r.string()
        dims = tuple(r.u32() for _ in range(r.u8()))
        dtype_id = r.u8()
        raw = r.take(r.u32())
        variables[name], dtypes[name] = _array(raw, dims, dtype_id, source, name)
    aliases = {}
    for _ in range(r.u32()):
        alias = r.string()
        aliases[alias] = r.string()
    missing = sorted(t for t in aliases.values() if t not in variables)
    if missing:
        raise CorruptCheckpointError(f"{source}: aliases point at missing variables {missing[:3]}")
    return CT2Model(version, spec, revision, variables, aliases, dtypes)
