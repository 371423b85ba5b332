"""Save a streamed model (:mod:`prunelab.models.streaming`) shard by shard.

The checkpoint is assembled in a temporary folder beside the target, one safetensors shard
per block (``model-00001-of-000NN.safetensors``: the block read from its staged or source
shard, renamed to its current index, written, freed) and a last shard with the resident
parameters (embeddings, final norm, head), plus ``model.safetensors.index.json``, the
config, the tokenizer and ``manifest.json``; then it is fsynced and renamed into place
under the output lock like :func:`prunelab.checkpoint.save.save` (no partial folder on failure).
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from prunelab.checkpoint.remote import has_bridges, has_custom_modules
from prunelab.checkpoint.save import finish_checkpoint
from prunelab.io.files import _check_target, _os_errors, check_not_input
from prunelab.io.lock import clean_leftovers, output_lock, temp_prefix


def _tied(model) -> set[str]:
    keys: set[str] = set()
    for attr in ("_tied_weights_keys", "all_tied_weights_keys"):
        keys |= set(getattr(model, attr, None) or ())
    return keys


_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` (CPU) as one safetensors file straight from their memory (no
    serialised copy of the shard, unlike ``safetensors.torch.save_file``); returns the
    bytes of tensor data. Format: 8-byte little-endian header length, JSON header,
    data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    items = [(k, t.detach().contiguous()) for k, t in sorted(tensors.items())]
    for name, t in items:
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for _name, t in items:
            if t.numel():
                fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return offset


def write_shards(lm, folder: Path) -> dict[str, str]:
    """Write every block, then each side unit (embeddings, head), then the other resident
    parameters as shards of ``folder``; return the weight map (tensor name -> shard). At
    most one block and one side unit are in memory at a time."""
    st = lm.streamer
    blocks = list(lm.adapter.blocks())
    n = len(blocks) + len(st.side_units) + 1
    tied = _tied(lm.model) if getattr(lm.model.config, "tie_word_embeddings", False) else set()
    weight_map: dict[str, str] = {}
    total = 0

    def shard(k: int, tensors: dict) -> str:
        nonlocal total
        name = f"model-{k:05d}-of-{n:05d}.safetensors"
        total += write_safetensors(folder / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
        return name

    for i, blk in enumerate(blocks):
        with st.hold(blk):
            name = shard(i + 1, {f"{st.prefix}.{i}.{k}": v
                                 for k, v in blk.state_dict().items()})
        st.release()
        if st.consume_staging:  # a pruned block is read from here on, its staged copy deleted
            st.moved(blk, folder / name, f"{st.prefix}.{i}")
    side_names: set[str] = set()
    for j, unit in enumerate(st.side_units):
        st.acquire_side(unit)
        names = [x for x in unit.refs if x not in tied] or list(unit.refs)
        shard(len(blocks) + j + 1, {x: unit.get(x) for x in names})
        st.release_side()
        side_names |= unit.names
    rest, seen = {}, set()
    for k, v in lm.model.state_dict(keep_vars=True).items():
        if k.startswith(st.prefix + ".") or k in tied or k in side_names or id(v) in seen:
            continue
        seen.add(id(v))
        rest[k] = v
    shard(n, rest)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return weight_map


def save_streamed(lm, out_dir: str | Path, manifest: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Save a streamed (possibly pruned) model as a plain ``transformers`` checkpoint plus
    ``manifest.json``, atomically; the config follows the pruned shapes like
    :func:`prunelab.checkpoint.save.save` (per-block widths get the generated modeling file)."""
    out = Path(out_dir)
    check_not_input(out, {"model (the checkpoint it was loaded from)":
                          getattr(lm, "source", None)})
    _check_target(out, overwrite, "checkpoint")
    widths = bool(lm.adapter.vanilla_problems()) and any(
        op.get("operation") == "prune-width" for op in getattr(lm, "history", []))
    if widths:
        lm.model.config.num_hidden_layers = lm.adapter.num_blocks
    else:
        lm.adapter.sync_config()
    remote = has_bridges(lm.model) or has_custom_modules(lm.model) or widths
    with _os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(out):
            clean_leftovers(out)
            _check_target(out, overwrite, "checkpoint")
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=temp_prefix(out)))
            try:
                write_shards(lm, tmp)
                lm.model.config.save_pretrained(tmp)
                gen = getattr(lm.model, "generation_config", None)
                if gen is not None:
                    gen.save_pretrained(tmp)
                if lm.tokenizer is not None:
                    lm.tokenizer.save_pretrained(tmp)
                finish_checkpoint(lm, tmp, out, manifest, remote, overwrite, streamed=True)
                lm.streamer.relocate(tmp, out)  # blocks moved into it (consume_staging)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return out
