"""Sub-block removal: a removed attention / MLP branch is exactly that branch zeroed, a block
without both branches is the block deleted, checkpoints reload with identical logits, and
cached generation counts past tokens right."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.errors import UnsupportedOperationError
from prunelab.models.custom import custom_modules, flops_per_token
from prunelab.models.loading import wrap
from prunelab.models.sublayer import (
    branch_paths,
    remove_sublayers,
    removed_sublayers,
    sublayer_params,
)

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(2, 12, seed=5)
DECODERS = ["llama", "qwen2", "gemma", "gemma3_text", "phi3"]


def _lm(arch):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


def _zeroed_logits(lm, parts):
    """Reference: the dense model with each branch's output multiplied by 0 by a hook."""
    handles = []
    for i, part in parts:
        branch = lm.adapter.residual_branches(i)[part]

        def hook(module, args, out):
            if isinstance(out, tuple):
                return (torch.zeros_like(out[0]), *out[1:])
            return torch.zeros_like(out)
        handles.append(branch.register_forward_hook(hook))
    try:
        return _logits(lm.model)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("arch", DECODERS)
def test_removed_branches_equal_zeroed_branches(arch):
    lm = _lm(arch)
    parts = [(0, "attention"), (1, "mlp"), (2, "attention")]
    ref = _zeroed_logits(lm, parts)
    params_before = sum(p.numel() for p in lm.model.parameters())
    expect_removed = sum(sublayer_params(lm.adapter, i, p) for i, p in parts)
    flops_before = flops_per_token(lm.model)
    rec = remove_sublayers(lm, parts)
    torch.testing.assert_close(_logits(lm.model), ref, rtol=1e-6, atol=1e-6)
    assert rec["deleted_blocks"] == [] and rec["params_removed"] == expect_removed
    assert params_before - sum(p.numel() for p in lm.model.parameters()) == expect_removed
    assert removed_sublayers(lm.adapter) == sorted(parts)
    # the removed projections no longer count: attention q/k/v/o and the MLP are gone
    assert flops_per_token(lm.model) < flops_before


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_both_branches_of_a_block_equal_deleting_it(arch):
    lm, ref_lm = _lm(arch), _lm(arch)
    rec = remove_sublayers(lm, [(1, "attention"), (1, "mlp"), (3, "mlp")])
    ref_lm.adapter.delete_blocks([1])
    assert rec["deleted_blocks"] == [1] and rec["partial_blocks"] == [[3, "mlp"]]
    assert lm.adapter.num_blocks == ref_lm.adapter.num_blocks
    # block 3 (now 2) also lost its MLP in ``lm``: zero it in the reference too
    ref = _zeroed_logits(ref_lm, [(2, "mlp")])
    torch.testing.assert_close(_logits(lm.model), ref, rtol=1e-6, atol=1e-6)
    assert lm.model.config.num_hidden_layers == ref_lm.adapter.num_blocks


def test_whole_blocks_only_stay_a_plain_checkpoint(tmp_path):
    lm = _lm("llama")
    remove_sublayers(lm, [(2, "attention"), (2, "mlp")])
    assert custom_modules(lm.model) == []
    out = prunelab.save(lm, tmp_path / "plain")
    assert "prunelab_modules" not in json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_checkpoint_reloads_with_identical_logits(arch, tmp_path):
    lm = _lm(arch)
    remove_sublayers(lm, [(0, "attention"), (2, "mlp")])
    ref = _logits(lm.model)
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    torch.testing.assert_close(_logits(again), ref, rtol=0, atol=0)
    kinds = sorted(m["kind"] for m in json.loads((out / "config.json").read_text())
                   ["prunelab_modules"])
    assert kinds.count("skipped_attention") == 1 and kinds.count("skipped_mlp") == 1


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_cached_generation_matches_uncached_when_block_0_lost_its_attention(arch):
    lm = _lm(arch)
    remove_sublayers(lm, [(0, "attention"), (1, "mlp")])
    prompt = IDS[:1, :6]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = lm.model.generate(prompt, use_cache=True, **kw)
        plain = lm.model.generate(prompt, use_cache=False, **kw)
    assert torch.equal(cached, plain)


def test_sublayer_removal_refuses_other_families_in_one_line():
    lm = _lm("gpt2")
    with pytest.raises(UnsupportedOperationError) as err:
        remove_sublayers(lm, [(0, "mlp")])
    assert "\n" not in str(err.value) and "pre-norm decoder" in str(err.value)
    with pytest.raises(UnsupportedOperationError):
        branch_paths(_lm("llama").adapter, 0, "ffn")
    with pytest.raises(UnsupportedOperationError):
        remove_sublayers(_lm("llama"), [(9, "mlp")])
