"""Importance matrices in llama.cpp's file format, for its quantizer.

An importance matrix ("imatrix", llama.cpp's ``tools/imatrix``, introduced in llama.cpp
PR 4861, January 2024) holds, for every weight matrix ``W`` (``[d_out, d_in]``) of the
blocks, the sum over calibration tokens of each input channel's square,
``in_sum2[j] = sum_t x[t, j]^2``, and the number of tokens summed, ``counts``. llama.cpp's
quantizer divides one by the other and weighs each column's rounding error by that mean
``E_t x_j^2`` when it picks a block's scales (``ggml_quantize_chunk(..., imatrix)``): the
columns that carry large inputs are rounded more carefully. These are exactly the
statistics Wanda already gathers (:class:`prunelab.calib.stats.SumSquares`).

The file written here is llama.cpp's current (GGUF) form, as ``llama-imatrix`` writes it
(read in ``tools/imatrix/imatrix.cpp`` and ``common/imatrix-loader.cpp`` for the names, not
copied): per tensor ``<name>.in_sum2`` (F32, ``d_in`` values) and ``<name>.counts`` (F32, one
value), tensors sorted by name; keys ``general.type = "imatrix"``, ``imatrix.datasets``
(strings), ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32). :func:`read_imatrix`
also reads the legacy binary form (``.dat``: per entry the name, the call count and the
values ``mean x 1`` stored as ``sum / count x ncall``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prunelab.errors import ConfigError, CorruptCheckpointError
from prunelab.io.files import atomic_file

SUM_SUFFIX, COUNT_SUFFIX = ".in_sum2", ".counts"


@dataclass
class IMatrix:
    """``sums[name]``: float64 ``[d_in]`` sums of squared inputs of the weight ``name``
    (llama.cpp's tensor name, ``blk.N.attn_q.weight``); ``counts[name]``: tokens summed."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_size: int = 0
    chunk_count: int = 0

    def means(self) -> dict[str, np.ndarray]:
        """What llama.cpp's quantizer uses: ``E_t x_j^2`` per column (float32); a tensor
        with no tokens gets ones, as llama.cpp does."""
        out = {}
        for name, s in self.sums.items():
            n = self.counts.get(name, 0)
            out[name] = (s / n if n > 0 else np.ones_like(s)).astype(np.float32)
        return out

    def check(self) -> None:
        """Refuse non-finite or negative sums and negative counts (llama.cpp refuses a
        non-finite entry at quantization time)."""
        for name, s in self.sums.items():
            if s.ndim != 1 or not np.isfinite(s).all() or (s < 0).any():
                raise ConfigError(f"imatrix entry {name}: sums must be finite, non-negative "
                                  f"and 1-D (shape {s.shape})")
            if self.counts.get(name, -1) < 0:
                raise ConfigError(f"imatrix entry {name}: no token count")


def write_imatrix(path: str | Path, im: IMatrix, overwrite: bool = False) -> Path:
    """Write ``im`` to ``path`` in llama.cpp's GGUF imatrix form (atomic)."""
    import gguf  # noqa: PLC0415 - gguf: keeps this module light

    im.check()
    path = Path(path)
    with atomic_file(path, overwrite=overwrite) as tmp:
        writer = gguf.GGUFWriter(tmp, "imatrix")
        writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # llama-imatrix has none
        writer.add_string(gguf.Keys.General.TYPE, "imatrix")
        writer.add_array("imatrix.datasets", list(im.datasets))
        writer.add_uint32("imatrix.chunk_count", int(im.chunk_count))
        writer.add_uint32("imatrix.chunk_size", int(im.chunk_size))
        for name in sorted(im.sums):
            writer.add_tensor(name + SUM_SUFFIX,
                              np.asarray(im.sums[name], dtype=np.float32).reshape(1, -1))
            writer.add_tensor(name + COUNT_SUFFIX,
                              np.array([[float(im.counts[name])]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def read_imatrix(path: str | Path) -> IMatrix:
    """Read an importance matrix in llama.cpp's GGUF form or its legacy binary form;
    refuse an unreadable file in one line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"imatrix {path} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    return _read_gguf(path) if magic == b"GGUF" else _read_legacy(path)


def _read_gguf(path: Path) -> IMatrix:
    import gguf  # noqa: PLC0415 - gguf: keeps this module light

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError, EOFError) as e:
        raise CorruptCheckpointError(f"imatrix {path}: not a readable GGUF file ({e})") from e
    kind = reader.fields.get(gguf.Keys.General.TYPE)
    if kind is None or kind.contents() != "imatrix":
        raise ConfigError(f"{path} is a GGUF file but not an importance matrix "
                          "(general.type is not 'imatrix')")
    im = IMatrix()
    field_ = reader.fields.get("imatrix.datasets")
    im.datasets = list(field_.contents()) if field_ is not None else []
    for key, attr in (("imatrix.chunk_count", "chunk_count"),
                      ("imatrix.chunk_size", "chunk_size")):
        if (f := reader.fields.get(key)) is not None:
            setattr(im, attr, int(f.contents()))
    counts = {}
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float64).reshape(-1)
        if t.name.endswith(SUM_SUFFIX):
            im.sums[t.name.removesuffix(SUM_SUFFIX)] = data
        elif t.name.endswith(COUNT_SUFFIX):
            counts[t.name.removesuffix(COUNT_SUFFIX)] = data
    for name in im.sums:
        c = counts.get(name)
        if c is None:
            raise CorruptCheckpointError(f"imatrix {path}: {name} has sums but no counts")
        if c.size != 1:
            raise ConfigError(f"imatrix {path}: {name} has {c.size} counts (expert "
                              "matrices are not read yet)")
        im.counts[name] = int(round(float(c[0])))
    return im


def _read_legacy(path: Path) -> IMatrix:
    """The ``.dat`` form: ``int32 n``; per entry ``int32 len, name, int32 ncall, int32
    nval, float32[nval]`` holding ``mean x ncall``; then optionally ``int32 chunks`` and
    the dataset name. Read back as sums over ``ncall`` "tokens" (the means are exact)."""
    data = path.read_bytes()
    im, pos = IMatrix(), 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise CorruptCheckpointError(f"imatrix {path}: truncated (not an imatrix file?)")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    (n,) = take("<i")
    if not 0 < n < 1_000_000:
        raise CorruptCheckpointError(f"imatrix {path}: not an imatrix file ({n} entries)")
    for _ in range(n):
        (length,) = take("<i")
        if not 0 < length < 4096:
            raise CorruptCheckpointError(f"imatrix {path}: corrupt entry name length")
        name = bytes(take(f"<{length}s")[0]).decode("utf-8", "replace")
        ncall, nval = take("<ii")
        values = np.array(take(f"<{nval}f"), dtype=np.float64)
        im.sums[name] = values  # mean x ncall = sum over ncall units
        im.counts[name] = ncall
    if pos + 4 <= len(data):
        (im.chunk_count,) = take("<i")
        if pos + 4 <= len(data):
            (length,) = take("<i")
            if 0 < length <= len(data) - pos:
                im.datasets = [data[pos:pos + length].decode("utf-8", "replace")]
    return im
