"""Save a streamed model (:mod:`prunelab.models.streaming`) shard by shard.

The checkpoint is assembled in a temporary folder beside the target: first every source
shard whose tensors all go into the output unchanged, under their own names and in the
output's dtype (:func:`link_plan`: e.g. the blocks before the first one a depth prune
removed, the embeddings, the head) is hard-linked into it (no bytes written; copied when
the folder is on another filesystem); then one safetensors shard per block with tensors
left to write (the block read from its staged or source shard, renamed to its current
index, written, freed), one per side unit (embeddings, head) and a last one with the other
resident parameters (final norm), plus ``model.safetensors.index.json``, the config, the
tokenizer and ``manifest.json``. Shards are named ``model-0000K-of-0000N.safetensors``.
Then it is fsynced and renamed into place under the output lock like
:func:`prunelab.checkpoint.save.save` (no partial folder on failure).

A kept block after a removed one is renamed (``layers.7`` becomes ``layers.3``), and a
safetensors file holds its tensors' names in its header, so such blocks are written again;
on this project's ext4 disks neither ``copy_file_range`` (an in-kernel copy, counted as
written) nor reflinks (not supported) avoid that.
"""

from __future__ import annotations

import json
import os
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


def read_header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file as its header lists them (name -> ``dtype``,
    ``shape``, ``data_offsets``), without reading any tensor."""
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    return header


def _rest(lm, tied: set[str], side_names: set[str]) -> dict[str, torch.Tensor]:
    """The resident parameters and buffers outside the blocks and the side units."""
    st = lm.streamer
    rest, seen = {}, set()
    for k, v in lm.model.state_dict(keep_vars=True).items():
        if k.startswith(st.prefix + ".") or k in tied or k in side_names or id(v) in seen:
            continue
        seen.add(id(v))
        rest[k] = v
    return rest


def _unchanged(lm, blocks, tied: set[str], rest: dict) -> dict[str, torch.Tensor]:
    """Output tensors (name -> a tensor of the output's dtype and shape, meta for a block
    on disk) that are in the source shards under that name with the same values: blocks
    read from there and not modified, still at their index; the side units (read from
    there, never written); resident tensors equal to their source."""
    st = lm.streamer
    out: dict[str, torch.Tensor] = {}
    for i, blk in enumerate(blocks):
        if st.unchanged_source(blk) == i:
            out.update({f"{st.prefix}.{i}.{k}": v
                        for k, v in blk.state_dict(keep_vars=True).items()})
    for unit in st.side_units:
        out.update({x: unit.get(x) for x in unit.refs if x not in tied})
    mine = {k: v for k, v in rest.items() if k in st.store}
    if mine:
        source = st.store.read({k: k for k in mine})
        out.update({k: v for k, v in mine.items() if source[k].dtype == v.dtype
                    and torch.equal(source[k], v.detach().cpu())})
    return out


def link_plan(lm, blocks, tied: set[str], rest: dict) -> dict[Path, dict[str, dict]]:
    """The source shards (-> their headers) to hard-link into the output: every tensor in
    them is an output tensor under the same name, unchanged, with the output's dtype and
    shape (:func:`_unchanged`), and read from that shard."""
    st = lm.streamer
    same = _unchanged(lm, blocks, tied, rest)
    plan = {}
    for path in sorted(set(st.store.files.values())):
        header = read_header(path)
        if header and all(
                name in same and st.store.files.get(name) == path
                and meta["dtype"] == _DTYPES.get(same[name].dtype)
                and list(meta["shape"]) == list(same[name].shape)
                for name, meta in header.items()):
            plan[path] = header
    return plan


def _alone(st, blk, i: int) -> tuple[Path, dict[str, dict]] | None:
    """``(file, header)`` when block ``i`` is read from a file that holds it alone, named
    as at index ``i``, with the tensors and dtypes of its state (a staged block whose index
    the prune kept), else ``None``."""
    stored = st.stored_alone(blk)
    if stored is None or stored[1] != f"{st.prefix}.{i}" or not Path(stored[0]).is_file():
        return None
    header = read_header(Path(stored[0]))
    state = blk.state_dict(keep_vars=True)
    want = {f"{stored[1]}.{k}": v for k, v in state.items()}
    if header.keys() != want.keys() or any(
            m["dtype"] != _DTYPES.get(want[n].dtype) or list(m["shape"]) != list(want[n].shape)
            for n, m in header.items()):
        return None
    return Path(stored[0]), header


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` as a hard link to ``src`` (no bytes written), or a copy where a link is
    refused (another filesystem, a file owned by someone else under protected links)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_shards(lm, folder: Path) -> dict[str, str]:
    """Link the unchanged source shards (:func:`link_plan`), then write every block's
    remaining tensors, then each side unit's (embeddings, head), then the other resident
    parameters as shards of ``folder``; return the weight map (tensor name -> shard). At
    most one block and one side unit are in memory at a time."""
    st = lm.streamer
    blocks = list(lm.adapter.blocks())
    tied = _tied(lm.model) if getattr(lm.model.config, "tie_word_embeddings", False) else set()
    side_names = {n for unit in st.side_units for n in unit.names}
    rest = _rest(lm, tied, side_names)
    linked = link_plan(lm, blocks, tied, rest)
    done = {name for header in linked.values() for name in header}
    todo = [[k for k in blk.state_dict(keep_vars=True) if f"{st.prefix}.{i}.{k}" not in done]
            for i, blk in enumerate(blocks)]
    sides = [[x for x in (u.refs if all(x in tied for x in u.refs)
                          else [x for x in u.refs if x not in tied]) if x not in done]
             for u in st.side_units]
    rest = {k: v for k, v in rest.items() if k not in done}
    n = len(linked) + sum(map(bool, todo)) + sum(map(bool, sides)) + bool(rest)
    weight_map: dict[str, str] = {}
    total, count = 0, 0

    def next_name() -> str:
        nonlocal count
        count += 1
        return f"model-{count:05d}-of-{n:05d}.safetensors"

    def shard(tensors: dict) -> str:
        nonlocal total
        name = next_name()
        total += write_safetensors(folder / name, tensors)
        weight_map.update(dict.fromkeys(tensors, name))
        return name

    for src, header in linked.items():
        name = next_name()
        link_or_copy(src, folder / name)
        weight_map.update(dict.fromkeys(header, name))
        total += max((m["data_offsets"][1] for m in header.values()), default=0)
    for i, (blk, keys) in enumerate(zip(blocks, todo, strict=True)):
        if not keys:
            continue
        alone = _alone(st, blk, i)
        if alone is not None:  # its staged (or earlier saved) file: linked, not rewritten
            name = next_name()
            link_or_copy(alone[0], folder / name)
            weight_map.update(dict.fromkeys(alone[1], name))
            total += max((m["data_offsets"][1] for m in alone[1].values()), default=0)
        else:
            with st.hold(blk):
                state = blk.state_dict()
                name = shard({f"{st.prefix}.{i}.{k}": state[k] for k in keys})
            st.release()
        if st.consume_staging:  # a pruned block is read from here on, its staged copy deleted
            st.moved(blk, folder / name, f"{st.prefix}.{i}")
    for unit, names in zip(st.side_units, sides, strict=True):
        if names:
            st.acquire_side(unit)
            shard({x: unit.get(x) for x in names})
            st.release_side()
    if rest:
        shard(rest)
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
