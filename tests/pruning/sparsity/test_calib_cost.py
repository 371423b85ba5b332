"""What calibration costs, counted: the matmul work and attention calls a sparsity method
spends in the blocks, against one plain pass over the same calibration (issue 53)."""

from __future__ import annotations

import pytest
import torch

from prunelab import SparseGPT, Wanda
from prunelab.calib.runner import BlockRunner
from prunelab.models.loading import wrap
from prunelab.pruning.sparsity.execute import prune_sparsity

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(6, 16)


class _Counter:
    """Multiply-adds of every ``F.linear`` and completed calls of the attention class's
    own forward (a replayed attention does not call it; a stage that stops at the q/k/v
    inputs leaves it before any work)."""

    def __init__(self, monkeypatch, attn_cls):
        self.macs = 0
        self.attn = 0
        linear = torch.nn.functional.linear

        def counted_linear(x, w, b=None):
            self.macs += x.numel() // x.shape[-1] * w.numel()
            return linear(x, w, b)

        forward = attn_cls.forward

        def counted_forward(module, *args, **kwargs):
            out = forward(module, *args, **kwargs)
            self.attn += 1
            return out

        monkeypatch.setattr(torch.nn.functional, "linear", counted_linear)
        monkeypatch.setattr(attn_cls, "forward", counted_forward)


def _count(monkeypatch, work):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    counter = _Counter(monkeypatch, type(lm.adapter.block(0).self_attn))
    runner = work(lm)
    return counter, lm, runner


def test_one_plain_pass_is_the_unit(monkeypatch):
    c, lm, runner = _count(monkeypatch, lambda lm: BlockRunner(lm, IDS, batch_size=3).run()
                           and None)
    n = lm.adapter.num_blocks
    assert c.attn == n * 2  # two batches of three windows


@pytest.mark.parametrize("cfg", [SparseGPT(sparsity=0.5), SparseGPT(pattern="2:4"),
                                 Wanda(sparsity=0.5)], ids=["sparsegpt", "sparsegpt-2:4",
                                                            "wanda"])
def test_methods_spend_at_most_one_block_forward_per_block(monkeypatch, cfg):
    """SparseGPT (sequential: [q,k,v] -> o -> [gate,up] -> down, pruned outputs passed
    on) and Wanda (dense statistics, dense outputs passed on) each compute every linear
    once per batch and run attention once per batch and block: one block forward per
    block. Nothing is run twice -- the next block's inputs are the outputs of this
    block's last stage."""
    plain, _, _ = _count(monkeypatch, lambda lm: BlockRunner(lm, IDS, batch_size=3).run())
    monkeypatch.undo()
    got, lm, _ = _count(monkeypatch, lambda lm: prune_sparsity(lm, cfg, IDS, batch_size=3))
    assert got.attn == plain.attn  # once per batch and block
    assert got.macs == plain.macs  # every linear once per token
