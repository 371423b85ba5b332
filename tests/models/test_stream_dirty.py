"""Which blocks a streamed prune writes to staging (:class:`prunelab.models.streaming.Streamer`):
only those a pass modified -- marked by the pass (:func:`mark_modified`) or caught by the
guard on their parameters' version counters -- never those a probe or a KL pass only read."""

from __future__ import annotations

import pytest
import torch

import prunelab
from prunelab.calib.runner import BlockRunner
from prunelab.data.batches import TokenBatches
from prunelab.models.streaming import Streamer, mark_modified

from tiny_models import save_tiny_checkpoint, tiny_tokens

CALIB = TokenBatches(input_ids=tiny_tokens(4, 12), spec="tiny", seqlen=12, samples=4, seed=0,
                     mode="calib", total_windows=4, sha256="0")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint("llama", tmp_path_factory.mktemp("dirty") / "model")


@pytest.fixture
def spy(monkeypatch):
    """The blocks (their index at the time) written to staging, by a spy on ``_stage``."""
    seen: list[int] = []
    real = Streamer._stage

    def stage(self, block):
        seen.append(next(i for i, b in enumerate(self.adapter.blocks()) if b is block))
        return real(self, block)

    monkeypatch.setattr(Streamer, "_stage", stage)
    return seen


def _streamed(ckpt, tmp_path):
    lm = prunelab.load(str(ckpt), stream=True)
    lm.streamer.work_dir = tmp_path
    return lm


@pytest.mark.parametrize("cfg, staged", [
    (prunelab.Depth(remove=1, probe="block-influence"), []),  # probe pass + KL pass: reads
    (prunelab.Depth(blocks=(1,)), []),
    (prunelab.Depth(blocks=(2,), recovery="foldable"), [1]),  # the fold: block 1 only
    (prunelab.Wanda(sparsity=0.5), [0, 1, 2, 3]),
    (prunelab.Width(unit="ffn", ratio=0.25), [0, 1, 2, 3]),
], ids=["depth-probe", "depth-given", "depth-foldable", "wanda", "width"])
def test_only_modified_blocks_are_staged(ckpt, tmp_path, spy, cfg, staged):
    lm = _streamed(ckpt, tmp_path)
    prunelab.prune(lm, cfg, CALIB, batch_size=2)
    assert spy == staged and lm.streamer.staged == len(staged)
    assert len(list(tmp_path.glob(".prunelab-stream-*/block-*.safetensors"))) == len(staged)
    if not staged:
        assert lm.streamer.staged_bytes == 0
    lm.streamer.close()


def test_a_write_the_pass_did_not_mark_is_still_staged(ckpt, tmp_path, spy):
    """The guard: a parameter written in place (its version counter moves) or replaced
    makes the block dirty without a mark; a forward pass and a device round trip do not."""
    lm = _streamed(ckpt, tmp_path)
    st, blocks = lm.streamer, list(lm.adapter.blocks())
    runner = BlockRunner(lm, CALIB.input_ids, batch_size=2)
    with st.writing():
        hidden = runner.run_block(0, runner.capture())  # read: clean
        blocks[0].to(torch.float64).to(torch.float32)
        assert not st.is_dirty(blocks[0])
        with st.hold(blocks[1]), torch.no_grad():
            blocks[1].mlp.down_proj.weight.mul_(0.5)  # in place, unmarked
        with st.hold(blocks[2]):
            blocks[2].mlp.up_proj.weight = torch.nn.Parameter(
                blocks[2].mlp.up_proj.weight.detach() * 2)  # replaced, unmarked
        with st.hold(blocks[3]):
            blocks[3].mlp.up_proj.weight.data.mul_(2)  # invisible to the guard: marked
            mark_modified(runner, blocks[3])
        runner.run_block(1, hidden)
    assert spy == [1, 2, 3]
    assert torch.equal(st.block_tensors(blocks[3])["mlp.up_proj.weight"],
                       2 * prunelab.load(str(ckpt)).adapter.block(3).mlp.up_proj.weight)
    with st.writing():  # a staged block read again and left alone is not staged again
        runner.run_block(1, hidden)
        runner.run_block(2, hidden)
    assert spy == [1, 2, 3]
    st.close()


def test_mark_modified_is_a_no_op_without_a_streamer(ckpt):
    lm = prunelab.load(str(ckpt))
    mark_modified(lm, lm.adapter.block(0))
    assert not hasattr(lm.adapter.block(0), "_prunelab_stream_dirty")
