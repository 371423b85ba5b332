"""Layer-wise loading from disk: a model whose blocks live in safetensors shards and are
materialised one at a time (``prunelab.load(spec, stream=True)``, CLI ``--stream``).

The skeleton is built with empty (meta) parameters (accelerate's ``init_empty_weights``;
buffers such as rotary frequencies stay real). The embeddings, the final norm and the LM
head are read at load and stay resident; each block's parameters are read from the
shards (memory-mapped through ``safetensors.safe_open``, the file closed again so its
pages leave the process) when the block runner needs the block, and turned back into
meta tensors when another block is needed: at most one block is resident at a time.

While a prune runs (:meth:`Streamer.writing`), a block that leaves memory *modified* is
first written to a staging shard, and from then on it is read from there (later passes see
the pruned block). A block is modified when a pass that writes weights marks it
(:func:`mark_modified`: sparsity, width, a depth recovery) or when its parameters were
written in place or replaced since it was read (their autograd version counters and
identities; a guard for a writer that forgot to mark). Passes that only read (a probe, the
KL of a depth prune) leave their blocks clean, and a clean block is never written: it stays
read from where it was. :func:`prunelab.checkpoint.stream_save.save_streamed` assembles the
checkpoint from the staged and source shards, hard-linking the source shards whose tensors
are all kept unchanged under their names. The idea follows llm-compressor's layer-wise
loading from disk (its PR #2748).

Calibration activations of every sample are still held in memory (``[N, T, hidden]`` per
block boundary in flight), as in the non-streamed runner.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from prunelab.errors import UnsupportedOperationError
from prunelab.models import loading as L
from prunelab.models.size import model_size

# on each block module: ("source", index), or ("staged" | "saved", (file, key prefix)): a
# safetensors file that holds the block alone, its tensors named "{key prefix}.{name}"
_TAG = "_prunelab_stream_key"
_DIRTY = "_prunelab_stream_dirty"  # on a resident block marked modified (mark_dirty)
_READ = "_prunelab_stream_read"  # on a resident block: its parameters as read (_fingerprint)


def _fingerprint(block: nn.Module) -> dict[str, tuple]:
    """Per parameter: the object, its autograd version counter (bumped by every in-place
    write, ``copy_`` under ``no_grad`` included; moving it to a device and back is not a
    write) and its shape -- what changes when a pass writes or replaces it."""
    return {n: (id(p), p._version, tuple(p.shape)) for n, p in block.named_parameters()}


class ShardStore:
    """Tensor names of a safetensors checkpoint folder and the shard that holds each."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {k: self.folder / v for k, v in weight_map.items()}
        else:
            single = self.folder / "model.safetensors"
            if not single.is_file():
                raise UnsupportedOperationError(
                    f"--stream reads safetensors shards: {self.folder} has none "
                    "(model.safetensors or model.safetensors.index.json)")

            with safe_open(single, framework="pt") as fh:
                self.files = {k: single for k in fh.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, names: dict[str, str], dtype: torch.dtype | None = None
             ) -> dict[str, torch.Tensor]:
        """``{key: tensor}`` for ``names`` (key -> tensor name in the shards); each shard
        is opened (memory-mapped) once and closed before returning."""
        return read_tensors({k: self.files[n] for k, n in names.items()}, names, dtype)


def read_tensors(files: dict[str, Path], names: dict[str, str],
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read ``names[key]`` from ``files[key]`` for every key, one open per file."""
    by_file: dict[Path, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    out = {}
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as fh:
            for key in keys:
                t = fh.get_tensor(names[key])
                out[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def _trim() -> None:
    """Give freed heap memory back to the system (glibc), so RSS follows the one block."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _device_of(args) -> torch.device | None:
    first = args[0] if args else None
    return first.device if isinstance(first, torch.Tensor) else None


def _set_param(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    old = owner._parameters[leaf]
    owner._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)


def is_materialised(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` holds data (is not on the meta device)."""
    return any(not p.is_meta for p in module.parameters())


class SideUnit:
    """Large parameters outside the blocks (the token embeddings, the LM head; one unit
    when tied): ``refs`` maps each parameter's name in the shards to every
    ``(owner module, attribute)`` that holds it; ``modules`` run it."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], store: ShardStore):
        self.modules = modules
        ids = {id(p) for m in modules for p in m.parameters()}
        groups: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for owner_name, owner in model.named_modules(remove_duplicate=False):
            for leaf, p in owner._parameters.items():
                if p is not None and id(p) in ids:
                    name = f"{owner_name}.{leaf}" if owner_name else leaf
                    groups.setdefault(id(p), []).append((name, owner, leaf))
        self.refs: dict[str, list[tuple[nn.Module, str]]] = {}
        for holders in groups.values():
            stored = next((n for n, _o, _l in holders if n in store), None)
            if stored is None:
                raise UnsupportedOperationError(
                    f"--stream: the shards of {store.folder} hold no tensor named "
                    f"{holders[0][0]} (the checkpoint names its weights differently from "
                    "the model): load it without --stream")
            self.refs[stored] = [(o, leaf) for _n, o, leaf in holders]
        self.names = {n for holders in groups.values() for n, _o, _l in holders}

    def set(self, name: str, value: torch.Tensor) -> None:
        """One parameter object for ``value``, set on every holder (ties kept)."""
        param = nn.Parameter(value, requires_grad=False)
        for owner, leaf in self.refs[name]:
            owner._parameters[leaf] = param

    def get(self, name: str) -> torch.Tensor:
        owner, leaf = self.refs[name][0]
        return owner._parameters[leaf]


class Streamer:
    """Owns the residency of the blocks of a streamed model (see the module docstring).

    ``acquire(block)`` makes ``block`` the resident one (the previous one is released);
    ``release()`` frees it (staging it first inside :meth:`writing` when it was modified:
    :meth:`is_dirty`). ``listeners`` are called as ``fn(event, block_index)`` after every
    load and free (tests count the materialised blocks with them); ``peak_resident`` is the
    most blocks ever resident; ``staged`` / ``staged_bytes`` count the blocks written to
    staging and their tensor bytes.
    """

    def __init__(self, model: nn.Module, adapter, store: ShardStore, dtype: torch.dtype,
                 prefix: str, work_dir: str | Path | None = None):
        self.model, self.adapter, self.store = model, adapter, store
        self.dtype, self.prefix = dtype, prefix
        self.resident: nn.Module | None = None
        self.peak_resident = 0
        self.loads = 0
        self.staged = 0
        self.staged_bytes = 0
        self.listeners: list[Callable[[str, int], None]] = []
        self._writing = 0
        self.work_dir = work_dir  # where the staging folder is made (default: system temp)
        self._staging: Path | None = None
        # save moves the pruned blocks into the checkpoint (:meth:`moved`): disk holds the
        # output plus one copy of the model, not two; a failed save then loses them
        self.consume_staging = False
        for i, blk in enumerate(adapter.blocks()):
            setattr(blk, _TAG, ("source", i))
        self.side_units: list[SideUnit] = []
        self.side_resident: SideUnit | None = None
        self._hooks: list = []

    # ------------------------------------------------------------------ side units
    def add_side_unit(self, unit: SideUnit) -> None:
        """Stream ``unit``: its parameters become meta and are read when one of its
        modules runs (a forward pre-hook owned by the streamer)."""
        self.side_units.append(unit)
        for name in unit.refs:
            unit.set(name, torch.empty_like(unit.get(name), device="meta"))
        for m in unit.modules:
            self._hooks.append(m.register_forward_pre_hook(
                lambda _m, args, u=unit: self.acquire_side(u, _device_of(args))))

    def acquire_side(self, unit: SideUnit, device: torch.device | None = None) -> None:
        """Read ``unit`` (embeddings or head) onto ``device`` (default: the CPU), freeing
        the other side unit first."""
        device = device or torch.device("cpu")
        if unit is self.side_resident and unit.get(next(iter(unit.refs))).device == device:
            return
        self.release_side()
        for name, t in self.store.read({n: n for n in unit.refs}, self.dtype).items():
            unit.set(name, t.to(device))
        self.side_resident = unit

    def release_side(self) -> None:
        """Free the resident side unit (embeddings or head; never pruned)."""
        unit, self.side_resident = self.side_resident, None
        if unit is not None:
            for name in unit.refs:
                unit.set(name, torch.empty_like(unit.get(name), device="meta"))
            _trim()

    # ------------------------------------------------------------------ residency
    def acquire(self, block: nn.Module) -> None:
        """Make ``block`` resident (read from its shard), releasing the previous one."""
        if block is self.resident:
            return
        self.release()
        self._load(block)
        self.resident = block
        self.loads += 1
        count = sum(is_materialised(b) for b in self.adapter.blocks())
        self.peak_resident = max(self.peak_resident, count)
        self._tell("load", block)

    def release(self) -> None:
        """Free the resident block (written to a staging shard first while writing, when
        it was modified: :meth:`is_dirty`)."""
        block, self.resident = self.resident, None
        if block is None:
            return
        if self._writing and self.is_dirty(block):
            self._stage(block)
        block.__dict__.pop(_DIRTY, None)
        block.__dict__.pop(_READ, None)
        for name, p in list(block.named_parameters()):
            _set_param(block, name, torch.empty_like(p, device="meta"))
        _trim()
        self._tell("free", block)

    def mark_dirty(self, block: nn.Module) -> None:
        """``block`` (resident) was modified by a pass that writes weights: it is staged
        when it leaves memory inside :meth:`writing`."""
        setattr(block, _DIRTY, True)

    def is_dirty(self, block: nn.Module) -> bool:
        """Whether ``block`` differs from where it is read from: marked by
        :meth:`mark_dirty`, or a parameter written in place, replaced, added or removed
        since it was read (reading passes never change these)."""
        if getattr(block, _DIRTY, False):
            return True
        read = getattr(block, _READ, None)
        return read is not None and read != _fingerprint(block)

    @contextlib.contextmanager
    def hold(self, block: nn.Module) -> Iterator[nn.Module]:
        """``block`` resident inside (it stays resident until another is acquired)."""
        self.acquire(block)
        yield block

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Inside: every block leaving memory is staged (a prune); the resident block is
        staged and freed on exit, so the pruned model is wholly on disk afterwards."""
        self._writing += 1
        try:
            yield
        finally:
            try:
                self.release()
            finally:
                self._writing -= 1

    def _tell(self, event: str, block: nn.Module) -> None:
        index = next((i for i, b in enumerate(self.adapter.blocks()) if b is block), -1)
        for fn in self.listeners:
            fn(event, index)

    # ------------------------------------------------------------------ disk
    def block_tensors(self, block: nn.Module) -> dict[str, torch.Tensor]:
        """The parameters of ``block`` (block-relative names) read from disk."""
        kind, where = getattr(block, _TAG)
        names = [n for n, _ in block.named_parameters()]
        if kind in ("staged", "saved"):  # a staging shard or a saved checkpoint's shard
            shard, pre = where
            return read_tensors({n: shard for n in names}, {n: f"{pre}.{n}" for n in names},
                                self.dtype)
        full = {n: f"{self.prefix}.{where}.{n}" for n in names}
        missing = [v for v in full.values() if v not in self.store]
        if missing:
            raise UnsupportedOperationError(
                f"--stream: {missing[0]} is not in the shards of {self.store.folder} "
                "(checkpoint names differ from the model's): load without --stream")
        return self.store.read(full, self.dtype)

    def unchanged_source(self, block: nn.Module) -> int | None:
        """The index under which ``block``'s tensors are in the source shards when it is
        read from there and not modified since (its tensors there are its tensors), else
        ``None`` (staged, saved, or modified while resident)."""
        kind, where = getattr(block, _TAG)
        return where if kind == "source" and not self.is_dirty(block) else None

    def stored_alone(self, block: nn.Module) -> tuple[Path, str] | None:
        """``(file, key prefix)`` when ``block`` is read from a file that holds it alone
        (staged, or moved into a saved checkpoint) and was not modified since, else
        ``None``: a save can link that file instead of writing the block again."""
        kind, where = getattr(block, _TAG)
        return where if kind in ("staged", "saved") and not self.is_dirty(block) else None

    def _load(self, block: nn.Module) -> None:
        for name, t in self.block_tensors(block).items():
            _set_param(block, name, t)
        setattr(block, _READ, _fingerprint(block))

    def _stage(self, block: nn.Module) -> None:
        if self._staging is None:
            self._staging = Path(tempfile.mkdtemp(prefix=".prunelab-stream-",
                                                  dir=self.work_dir))
            weakref.finalize(self, shutil.rmtree, self._staging, True)
        path = self._staging / f"block-{id(block)}.safetensors"
        # named as in a checkpoint at the block's index now (a save that keeps the index
        # links the file instead of writing it again)
        index = next((i for i, b in enumerate(self.adapter.blocks()) if b is block), -1)
        pre = f"{self.prefix}.{index}"
        tensors = {f"{pre}.{n}": p.detach().contiguous() for n, p in block.named_parameters()}
        path.unlink(missing_ok=True)  # a new file: a save may have linked the old one
        save_file(tensors, str(path))
        setattr(block, _TAG, ("staged", (path, pre)))
        self.staged += 1
        self.staged_bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def moved(self, block: nn.Module, shard: Path, key_prefix: str) -> None:
        """``block``, when pruned (staged or saved before), is now read from ``shard`` of a saved
        checkpoint, where its tensors are ``key_prefix.NAME``; its staging shard is deleted
        (``consume_staging``: the disk never holds two copies of the pruned blocks)."""
        kind, where = getattr(block, _TAG)
        if kind == "source":  # never changed: it stays read from the source shards
            return
        setattr(block, _TAG, ("saved", (Path(shard), key_prefix)))
        if kind == "staged" and Path(where[0]) != Path(shard):
            Path(where[0]).unlink(missing_ok=True)

    def relocate(self, old: Path, new: Path) -> None:
        """Blocks moved into the checkpoint folder ``old`` read it at ``new`` (renamed)."""
        for blk in self.adapter.blocks():
            kind, where = getattr(blk, _TAG)
            if kind == "saved" and Path(where[0]).parent == Path(old):
                setattr(blk, _TAG, ("saved", (Path(new) / Path(where[0]).name, where[1])))

    def close(self) -> None:
        """Remove the staging folder (the model can no longer read staged blocks) and
        the side units' hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None



def blocks_prefix(model: nn.Module, adapter) -> str:
    """The module path of the block list (``model.layers``)."""
    blocks = adapter.blocks()
    return next(name for name, m in model.named_modules() if m is blocks)


def load_streamed(spec: str, dtype: str | torch.dtype | None = "auto",
                  device: str | None = "cpu", trust_remote_code: bool = False,
                  work_dir: str | Path | None = None):
    """A :class:`~prunelab.models.loading.LoadedModel` whose blocks stay on disk until
    needed (``lm.streamer``, a :class:`Streamer`). ``spec``: an embedded name, a local
    safetensors checkpoint or a ``.gguf`` file (converted once into the cache); computing
    ``device`` may be ``cpu`` or ``cuda`` (the resident parts and the block in turn move
    there). ``work_dir``: where pruned blocks are staged (default: the system temp)."""
    from accelerate import init_empty_weights  # noqa: PLC0415 - accelerate (heavy)

    dev = L.resolve_device(device)
    dt = L.resolve_dtype(dtype, dev)
    source = L.resolve_source(spec)
    if not isinstance(source, Path):
        raise UnsupportedOperationError(
            f"--stream needs a local checkpoint, an embedded model or a .gguf file, not the "
            f"hub id {spec!r}: download it first (huggingface-cli download)")
    cfg = L._load_config(source, trust_remote_code)
    fam = L.family_for_model_type(getattr(cfg, "model_type", None))
    if fam is None:
        raise UnsupportedOperationError(
            f"unsupported architecture {getattr(cfg, 'model_type', None)!r}")
    L._check_blocks(cfg, source)
    store = ShardStore(source)
    tok = L._load_tokenizer(source, spec, trust_remote_code)
    cls = transformers.AutoModel if fam.encoder else transformers.AutoModelForCausalLM
    with init_empty_weights():
        model = cls.from_config(cfg, dtype=dt, trust_remote_code=trust_remote_code)
    model.eval()
    lm = L.LoadedModel(model=model, tokenizer=tok, spec=spec, source=str(source), dtype=dt,
                       device=torch.device("cpu"))
    if dev.type != "cpu":  # weights stay on the CPU; the runner computes on the device
        lm.offload_to = dev
    prefix = blocks_prefix(model, lm.adapter)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    side = _side_units(model, lm.adapter, store)
    _load_resident(model, store, prefix, dt, spec,
                   skip={n for u in side for n in u.names})
    lm.streamer = Streamer(model, lm.adapter, store, dt, prefix, work_dir)
    for unit in side:
        lm.streamer.add_side_unit(unit)

    lm.size_before = model_size(model)
    return lm


def _side_units(model: nn.Module, adapter, store: ShardStore) -> list[SideUnit]:
    """The token embeddings and the LM head as streamed units (one unit when tied)."""
    emb, head = adapter.embeddings(), adapter.head()
    if not isinstance(emb, nn.Embedding):
        return []
    if head is None or not isinstance(head, nn.Linear):
        return [SideUnit(model, [emb], store)]
    if head.weight is emb.weight:
        return [SideUnit(model, [emb, head], store)]
    return [SideUnit(model, [emb], store), SideUnit(model, [head], store)]


def _load_resident(model: nn.Module, store: ShardStore, prefix: str, dt: torch.dtype,
                   spec: str, skip: set[str]) -> None:
    """Read every parameter outside the blocks and the side units (final norm, position
    embeddings...); tied parameters absent from the shards are tied again after."""
    names = {n: n for n, _ in model.named_parameters()
             if not n.startswith(prefix + ".") and n in store and n not in skip}
    for name, t in store.read(names, dt).items():
        _set_param(model, name, t)
    left = [n for n, p in model.named_parameters()
            if p.is_meta and not n.startswith(prefix + ".") and n not in skip]
    if left:
        raise UnsupportedOperationError(
            f"--stream: the shards of {spec} hold no tensor named {left[0]} (the checkpoint "
            "names its weights differently from the model): load it without --stream")


def streamer_of(lm) -> Streamer | None:
    """The :class:`Streamer` of a streamed model, else ``None``."""
    return getattr(lm, "streamer", None)


def mark_modified(owner, block: nn.Module) -> None:
    """Tell the streamer of ``owner`` (a model or a block runner), if it streams, that
    ``block`` was modified (a pass that writes weights): it is staged when it leaves memory
    during a prune. A no-op for a model that is not streamed."""
    st = getattr(owner, "streamer", None)
    if st is not None:
        st.mark_dirty(block)


def holding(owner, block: nn.Module):
    """``block`` resident inside when ``owner`` (a model or a block runner) streams; a
    no-op context otherwise (for weight reads outside the runner's block turns)."""
    st = getattr(owner, "streamer", None)
    return st.hold(block) if st is not None else contextlib.nullcontext(block)
