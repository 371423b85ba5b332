"""Saving a streamed depth prune (:mod:`prunelab.checkpoint.stream_save`): the output loads
with plain ``transformers`` and gives the very logits of the same prune done in memory,
whether the removed blocks are the first, middle or last ones; source shards whose tensors
are all kept unchanged under their names are hard-linked into it (no bytes written), the
rest is written; blocks that were only read are never staged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

import prunelab
from prunelab.checkpoint import stream_save
from prunelab.checkpoint.stream_save import read_header
from prunelab.data.batches import TokenBatches
from prunelab.io.files import usual_mode

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

CALIB = TokenBatches(input_ids=tiny_tokens(4, 12), spec="tiny", seqlen=12, samples=4, seed=0,
                     mode="calib", total_windows=4, sha256="0")
IDS = tiny_tokens(2, 12, seed=1)
CASES = {"first": (0,), "middle": (1, 2), "last": (3,)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A 4-block Llama saved in shards of at most 20 kB (a block is 31 kB: one or two
    shards per block, the embeddings and the head in their own)."""
    path = tmp_path_factory.mktemp("sharded") / "model"
    tiny_model("llama").save_pretrained(path, max_shard_size="20KB")
    char_tokenizer().save_pretrained(path)
    assert len(list(path.glob("*.safetensors"))) >= 6
    return path


def _inodes(folder: Path) -> dict[int, str]:
    return {os.stat(p).st_ino: p.name for p in folder.glob("*.safetensors")}


def _prune_both(src: Path, out: Path, cfg, consume: bool = True):
    """The prune in memory and streamed (saved to ``out``): both loaded models."""
    dense = prunelab.load(str(src))
    prunelab.prune(dense, cfg, CALIB, batch_size=2)
    lm = prunelab.load(str(src), stream=True)
    lm.streamer.work_dir = out.parent
    lm.streamer.consume_staging = consume
    prunelab.prune(lm, cfg, CALIB, batch_size=2)
    prunelab.save(lm, out)
    return dense, lm


def _same_as_in_memory(dense, out: Path) -> None:
    saved = transformers.AutoModelForCausalLM.from_pretrained(out)
    sd, so = dense.model.state_dict(), saved.state_dict()
    assert sorted(sd) == sorted(so)
    assert all(torch.equal(sd[k], so[k]) for k in sd)
    with torch.no_grad():
        assert torch.equal(dense.model(IDS).logits, saved(IDS).logits)


@pytest.mark.parametrize("case", CASES)
def test_depth_stream_output_equals_in_memory(sharded, tmp_path, case):
    blocks = CASES[case]
    dense, lm = _prune_both(sharded, tmp_path / "out", prunelab.Depth(blocks=blocks))
    _same_as_in_memory(dense, tmp_path / "out")
    assert lm.streamer.staged == 0  # the KL pass only read the blocks
    assert not list(tmp_path.glob(".prunelab-stream-*/*"))
    src, out = _inodes(sharded), _inodes(tmp_path / "out")
    linked = {out[i]: src[i] for i in out.keys() & src.keys()}
    for name, origin in linked.items():  # a linked shard: the very tensors, same names
        assert read_header(tmp_path / "out" / name) == read_header(sharded / origin)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    linked_blocks = {int(k.split(".")[2]) for k, f in index["weight_map"].items()
                     if f in linked and k.startswith("model.layers.")}
    assert linked_blocks <= set(range(min(blocks)))  # only blocks before the first removed
    assert any(f in linked for k, f in index["weight_map"].items() if "embed_tokens" in k)
    # the fixture's shards: block 0 in 2-3, block 1 in 3-5, block 2 in 5-6, block 3 in 7-8
    assert linked_blocks == {"first": set(), "middle": {0}, "last": {0, 1, 2}}[case]


def test_depth_foldable_stages_only_the_refitted_block(sharded, tmp_path):
    cfg = prunelab.Depth(blocks=(2,), recovery="foldable")
    dense, lm = _prune_both(sharded, tmp_path / "out", cfg)
    _same_as_in_memory(dense, tmp_path / "out")
    assert lm.streamer.staged == 1  # block 1 took the fold; blocks 0 and (old) 3 were only read
    out = _inodes(tmp_path / "out")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    block1 = {f for k, f in index["weight_map"].items() if k.startswith("model.layers.1.")}
    assert not block1 & set(out.values()) & set(_inodes(sharded).values())
    assert not block1 & {out[i] for i in out.keys() & _inodes(sharded).keys()}


def test_a_refused_link_copies_the_shard(sharded, tmp_path, monkeypatch):
    def refuse(*a, **kw):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(stream_save.os, "link", refuse)
    dense, _lm = _prune_both(sharded, tmp_path / "out", prunelab.Depth(blocks=(3,)))
    _same_as_in_memory(dense, tmp_path / "out")
    assert not _inodes(tmp_path / "out").keys() & _inodes(sharded).keys()


def test_a_single_file_source_is_written(tmp_path):
    """A one-file checkpoint holds the removed block too: nothing to link."""
    src = tmp_path / "model"
    tiny_model("llama").save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    dense, lm = _prune_both(src, tmp_path / "out", prunelab.Depth(blocks=(3,)),
                            consume=False)
    _same_as_in_memory(dense, tmp_path / "out")
    assert not _inodes(tmp_path / "out").keys() & _inodes(src).keys()


def test_linked_input_shards_keep_their_mode(tmp_path):
    src = tmp_path / "model"
    tiny_model("llama").save_pretrained(src, max_shard_size="20KB")
    char_tokenizer().save_pretrained(src)
    for p in src.glob("*.safetensors"):
        p.chmod(0o600)
    _prune_both(src, tmp_path / "out", prunelab.Depth(blocks=(3,)))
    assert {p.stat().st_mode & 0o777 for p in src.glob("*.safetensors")} == {0o600}
    written = [p for p in (tmp_path / "out").glob("*.safetensors") if p.stat().st_nlink == 1]
    assert written and {p.stat().st_mode & 0o777 for p in written} == {usual_mode()}



def test_staged_blocks_at_their_index_are_linked_and_stay_intact(sharded, tmp_path):
    """Wanda keeps every block's index: the save links the staged shards. Pruning the same
    model again stages new files, so the first checkpoint is not changed through its links."""
    dense, lm = _prune_both(sharded, tmp_path / "one", prunelab.Wanda(sparsity=0.5),
                            consume=False)
    _same_as_in_memory(dense, tmp_path / "one")
    staged = {os.stat(p).st_ino for p in tmp_path.glob(".prunelab-stream-*/*.safetensors")}
    assert len(staged) == 4 and staged <= _inodes(tmp_path / "one").keys()
    prunelab.prune(lm, prunelab.Magnitude(sparsity=0.75), CALIB, batch_size=2)
    prunelab.prune(dense, prunelab.Magnitude(sparsity=0.75), CALIB, batch_size=2)
    prunelab.save(lm, tmp_path / "two")
    lm.streamer.close()
    _same_as_in_memory(dense, tmp_path / "two")
    first = prunelab.load(str(sharded))
    prunelab.prune(first, prunelab.Wanda(sparsity=0.5), CALIB, batch_size=2)
    _same_as_in_memory(first, tmp_path / "one")  # unchanged by the second prune
