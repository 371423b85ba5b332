"""``Streamer.consume_staging`` (on in the CLI's ``--stream`` prunes): save moves each
staged (pruned) block into the checkpoint, deleting its staging shard once written, so the
disk holds the output plus one copy of the pruned blocks rather than two. The checkpoint is
the same as without it, and the model stays readable (from the saved checkpoint). A staged
block whose index the prune kept is linked into the checkpoint (no bytes written), a
renumbered one written again: the spies count both."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers

import prunelab
from prunelab.data.batches import TokenBatches

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint, tiny_tokens


def _batches(seed):
    ids = tiny_tokens(4, 12, seed=seed)
    return TokenBatches(input_ids=ids, spec="tiny", seqlen=12, samples=4, seed=0,
                        mode="calib", total_windows=4, sha256="0")


def _staged(folder: Path) -> list[Path]:
    return sorted(folder.glob(".prunelab-stream-*/block-*.safetensors"))


def _spy(monkeypatch, folder: Path) -> list[int]:
    """Staged shards left at each shard the save writes or links."""
    from prunelab.checkpoint import stream_save

    seen: list[int] = []
    for name in ("write_safetensors", "link_or_copy"):
        real = getattr(stream_save, name)

        def counting(*a, real=real, **kw):
            seen.append(len(_staged(folder)))
            return real(*a, **kw)

        monkeypatch.setattr(stream_save, name, counting)
    return seen


def _state(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_consumed_save_moves_blocks_and_keeps_the_model_readable(tmp_path, monkeypatch):
    save_tiny_checkpoint("llama", tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    outs = {}
    for consume in (False, True):
        lm = prunelab.load(str(tmp_path / "model"), stream=True)
        lm.streamer.work_dir = work
        lm.streamer.consume_staging = consume
        prunelab.prune(lm, prunelab.Wanda(sparsity=0.5), _batches(0), batch_size=2)
        assert len(_staged(work)) == 4
        out = tmp_path / f"out-{consume}"
        with monkeypatch.context() as m:
            seen = _spy(m, work)
            prunelab.save(lm, out)
        if consume:  # one staged block fewer before each later shard
            assert seen[:5] == [4, 3, 2, 1, 0] and _staged(work) == []
        else:
            assert set(seen) == {4} and len(_staged(work)) == 4
        # the model still evaluates (blocks read from the saved checkpoint when consumed)
        outs[consume] = (out, prunelab.evaluate(lm, _batches(1), batch_size=2)["perplexity"])
        lm.streamer.close()
    (a, ppl_a), (b, ppl_b) = outs[False], outs[True]
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ppl_a == ppl_b
    resident = prunelab.evaluate(prunelab.load(str(b)), _batches(1), batch_size=2)
    assert resident["perplexity"] == ppl_b


def test_consumed_blocks_follow_a_second_save(tmp_path):
    """A block moved into one checkpoint moves again into the next (and is read there)."""
    save_tiny_checkpoint("llama", tmp_path / "model")
    lm = prunelab.load(str(tmp_path / "model"), stream=True)
    lm.streamer.work_dir = tmp_path
    lm.streamer.consume_staging = True
    prunelab.prune(lm, prunelab.Magnitude(sparsity=0.5), _batches(0), batch_size=2)
    prunelab.save(lm, tmp_path / "one")
    prunelab.save(lm, tmp_path / "two")
    for name in os.listdir(tmp_path / "one"):  # "two" must not read "one"
        if name.endswith(".safetensors"):
            (tmp_path / "one" / name).unlink()
    ppl = prunelab.evaluate(lm, _batches(1), batch_size=2)["perplexity"]
    assert ppl == prunelab.evaluate(prunelab.load(str(tmp_path / "two")), _batches(1),
                                    batch_size=2)["perplexity"]


def test_cli_stream_prune_consumes_its_staging(tmp_path, capsys, monkeypatch):
    from prunelab.cli import cli_main

    save_tiny_checkpoint("llama", tmp_path / "model")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    seen = _spy(monkeypatch, tmp_path)
    code = cli_main(["--quiet", "prune", "sparsity", "--model", str(tmp_path / "model"),
                     "--method", "wanda", "--out", str(tmp_path / "out"), "--stream",
                     "--data", f"text:{tmp_path / 'text.txt'}", "--seqlen", "16",
                     "--samples", "4", "--batch-size", "2"])
    assert code == 0, capsys.readouterr().err
    assert seen[:5] == [4, 3, 2, 1, 0]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
