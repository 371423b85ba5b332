"""Convert a GGUF file into safetensors shards one tensor at a time.

The whole-model path (``transformers`` ``from_pretrained(gguf_file=...)``, then
``save_pretrained``) holds every de-quantized tensor at once: about 1.55x the float32 model
at its peak. This converter follows the same steps as transformers' legacy GGUF loader
(``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint``: ``gguf.dequantize``,
the architecture's ``TensorProcessor`` -- e.g. the reverse q/k row permutation of llama --
and the GGUF -> Hugging Face name map), but for **one tensor at a time**: the tensor's
quantized bytes are read from the file in row chunks (``os.pread``, so the file's pages
never pile up in the process), de-quantized into one float32 array, written into the
current safetensors shard (:mod:`prunelab.io.shard_writer`, header first, so nothing else
is held) and freed. The shards and ``model.safetensors.index.json`` then stream like any
checkpoint. Peak memory: the largest tensor (the embeddings or the LM head) plus one chunk
of de-quantization temporaries, plus the parsed GGUF metadata (tokenizer vocabulary).

Only architectures whose processor maps each GGUF tensor to one Hugging Face tensor of the
same shape are converted this way (``TensorProcessor``, ``LlamaTensorProcessor``,
``Gemma2TensorProcessor``: llama, mistral, qwen2, qwen3, gemma2/3, phi3, ...). Others (MoE
processors that merge experts, architectures transformers loads through its newer packed
GGUF path) return ``None`` from :func:`plan_gguf` and keep the whole-model path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import transformers
from gguf import GGUFReader, dequantize
from transformers.integrations.gguf.utils import is_gguf_arch_supported
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    Gemma2TensorProcessor,
    LlamaTensorProcessor,
    TensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
    read_field,
)

from prunelab.errors import CorruptCheckpointError
from prunelab.io.shard_writer import TensorSpec, write_sharded
from prunelab.models.conversion import GGUF_ERRORS, first_line, publish_checkpoint, short_names
from prunelab.models.memory import release_free_memory

CHUNK_BYTES = 32 * 1024**2  # float32 output rows de-quantized per step


class GGUFTensor(NamedTuple):
    """Where one tensor lies in the GGUF file (the reader itself is not kept)."""

    name: str
    ggml_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # absolute, in bytes
    raw_shape: tuple[int, ...]  # numpy shape of the stored data (rows, bytes per row)
    raw_dtype: np.dtype
    n_elements: int


@dataclass
class GGUFPlan:
    """What a streamed conversion of one GGUF file writes."""

    path: Path
    processor: Any  # transformers TensorProcessor
    model: torch.nn.Module  # the target model on the meta device (config, names, shapes)
    specs: list[TensorSpec] = field(default_factory=list)
    sources: dict[str, GGUFTensor] = field(default_factory=dict)  # HF name -> its tensor
    missing: list[str] = field(default_factory=list)  # HF names the file lacks


def _per_tensor_processors() -> tuple[type, ...]:
    return (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor)


def _tied_targets(model: torch.nn.Module) -> set[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    keys: set[str] = set()
    for attr in ("_tied_weights_keys", "all_tied_weights_keys"):
        keys |= set(getattr(model, attr, None) or ())
    return keys


def plan_gguf(path: Path) -> GGUFPlan | None:
    """Read ``path``'s metadata and plan its tensors (names, shapes, shards); ``None``
    when the architecture needs the whole-model path. Errors of an unreadable file
    propagate (the caller turns them into one line)."""
    reader = GGUFReader(str(path))
    arch = read_field(reader, "general.architecture")[0]
    proc_cls = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    if is_gguf_arch_supported(arch) or proc_cls not in _per_tensor_processors():
        return None
    processor = proc_cls(config=dict(load_gguf_checkpoint(str(path))["config"]))
    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.dtype = torch.float32
    gemma3_keys(reader, config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    key_map = get_gguf_hf_weights_map(model, processor)
    plan = GGUFPlan(path=path, processor=processor, model=model)
    expected = dict(model.state_dict().items())
    skip = _tied_targets(model)
    for t in reader.tensors:
        hf = key_map.get(t.name)
        if hf is None or hf in skip or hf in plan.sources:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        want = tuple(expected[hf].shape) if hf in expected else None
        if want is not None and want != shape:
            raise ValueError(f"{t.name}: shape {shape} in the file, {want} in the model")
        plan.specs.append(TensorSpec(hf, shape, torch.float32))
        plan.sources[hf] = GGUFTensor(t.name, t.tensor_type, int(t.data_offset),
                                      tuple(t.data.shape), t.data.dtype, int(t.n_elements))
    plan.missing = sorted(set(expected) - set(plan.sources) - skip)
    return plan


def gemma3_keys(reader, config) -> None:
    """Apply the ``gemma3`` keys transformers' GGUF reader leaves out: which blocks use
    sliding-window attention (``attention.sliding_window_pattern``: a per-block array of
    booleans, as prunelab writes after depth pruning, or the period) and the sliding
    layers' rotary base (``rope.freq_base_swa``)."""
    if read_field(reader, "general.architecture")[0] != "gemma3":
        return
    pattern = read_field(reader, "gemma3.attention.sliding_window_pattern")
    n = config.num_hidden_layers
    if len(pattern) == n and all(isinstance(p, (bool, np.bool_)) for p in pattern):
        config.layer_types = ["sliding_attention" if p else "full_attention"
                              for p in pattern]
    elif len(pattern) == 1 and int(pattern[0]) > 0:
        k = int(pattern[0])
        config.layer_types = ["full_attention" if (i + 1) % k == 0 else "sliding_attention"
                              for i in range(n)]
    base = read_field(reader, "gemma3.rope.freq_base_swa")
    params = getattr(config, "rope_parameters", None)
    if base and isinstance(params, dict) and "sliding_attention" in params:
        params["sliding_attention"]["rope_theta"] = float(base[0])


def dequantize_tensor(path: Path, tensor: GGUFTensor) -> np.ndarray:
    """De-quantize one GGUF tensor into a new array, reading its bytes from ``path`` in
    row chunks with ``os.pread`` (so only the output and one chunk are in memory). Same
    values as ``gguf.dequantize(reader_tensor.data, reader_tensor.tensor_type)``."""
    shape, dtype = tensor.raw_shape, np.dtype(tensor.raw_dtype)
    row_shape = shape[1:] if len(shape) > 1 else shape
    rows = shape[0] if len(shape) > 1 else 1
    row_bytes = int(np.prod(row_shape)) * dtype.itemsize
    step = max(1, CHUNK_BYTES // max(1, 4 * tensor.n_elements // rows))
    out = None
    with open(path, "rb") as fh:
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            buf = os.pread(fh.fileno(), (stop - start) * row_bytes,
                           tensor.data_offset + start * row_bytes)
            chunk = np.frombuffer(buf, dtype=dtype)
            values = dequantize(chunk.reshape((stop - start, *row_shape) if len(shape) > 1
                                              else row_shape), tensor.ggml_type)
            if len(shape) == 1:
                return np.array(values, copy=True)
            if out is None:
                out = np.empty((rows, *values.shape[1:]), dtype=values.dtype)
            out[start:stop] = values
            del buf, chunk, values
    return out


def _produce(plan: GGUFPlan):
    def produce(spec: TensorSpec) -> torch.Tensor:
        src = plan.sources[spec.name]
        result = plan.processor.process(weights=dequantize_tensor(plan.path, src),
                                        name=src.name, tensor_key_mapping={},
                                        parsed_parameters={"tensors": {}})
        if result.name != src.name:
            raise ValueError(f"{src.name}: the processor renamed it to {result.name}")
        return torch.from_numpy(np.ascontiguousarray(result.weights)).to(spec.dtype)

    return produce


def write_streamed(plan: GGUFPlan, folder: Path,
                   max_shard_bytes: int = 2 * 1024**3) -> dict[str, str]:
    """Write the config and generation config, then the plan's tensors as shards of
    ``folder`` (one tensor in memory at a time); return the weight map."""
    model = plan.model
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    return write_sharded(folder, plan.specs, _produce(plan), max_shard_bytes)


def convert_gguf_streamed(path: Path, target: Path,
                          max_shard_bytes: int = 2 * 1024**3) -> bool:
    """Convert ``path`` into the checkpoint folder ``target`` tensor by tensor (written in
    a temp folder, published once, as the whole-model path does); ``False`` (nothing
    written) when the architecture needs the whole-model path. An unreadable file or one
    that lacks declared weights is a one-line CorruptCheckpointError."""
    try:
        plan = plan_gguf(path)
        if plan is None:
            return False
        tok = [transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)]
    except GGUF_ERRORS as exc:
        raise CorruptCheckpointError(
            f"{path.name} is not a readable GGUF model: {first_line(exc)}") from exc
    if plan.missing:
        raise CorruptCheckpointError(f"{path.name} lacks {len(plan.missing)} weights its "
                                     f"metadata declares ({short_names(plan.missing)})")

    def write(tmp: Path) -> None:
        tok.pop().save_pretrained(tmp)  # and dropped: the vocabulary is not held meanwhile
        release_free_memory()
        write_streamed(plan, tmp, max_shard_bytes)

    publish_checkpoint(target, write)
    return True
