"""Phi-3: fused qkv_proj ([q; k; v] with GQA) and gate_up_proj ([gate; up]) described as
adapter data, on a tiny random model."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import prunelab
from prunelab import Magnitude, Wanda, Width
from prunelab.calib.runner import BlockRunner, StateStore
from prunelab.data import TokenBatches
from prunelab.models.adapters import get_adapter
from prunelab.models.linear import weight_out_in
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(6, 16)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=6, seed=0, mode="calib",
                     total_windows=6, sha256="0")
FFN, HD = 48, 8


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapter_reads_fused_projections():
    model = tiny_model("phi3")
    ad = get_adapter(model)
    geo = ad.head_geometry(1)
    assert ad.family == "phi3" and (geo.num_heads, geo.num_kv_heads, geo.head_dim) == (4, 2, 8)
    assert ad.is_gated() and ad.ffn_width(1) == FFN and not ad.mlp_post_normed(1)
    blk = ad.block(1)
    assert [list(g.values()) for g in ad.linear_groups(1)] == [
        [blk.self_attn.qkv_proj], [blk.self_attn.o_proj], [blk.mlp.gate_up_proj],
        [blk.mlp.down_proj]]
    assert set(ad.linears(1)) == {"self_attn.qkv_proj", "self_attn.o_proj",
                                  "mlp.gate_up_proj", "mlp.down_proj"}


def test_runner_boundaries_equal_a_hooked_forward():
    model = tiny_model("phi3")
    ad = get_adapter(model)
    seen = {i: [] for i in range(ad.num_blocks)}
    handles = [ad.block(i).register_forward_hook(
        lambda _m, _a, out, _i=i: seen[_i].append(out[0] if isinstance(out, tuple) else out))
        for i in range(ad.num_blocks)]
    try:
        with torch.no_grad():
            for batch in IDS.split(3):
                ad.base(input_ids=batch, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    runner = BlockRunner(model, IDS, batch_size=3)
    store = StateStore("memory")
    runner.run(states=store)
    for i in range(ad.num_blocks):
        torch.testing.assert_close(torch.cat(store.get(i + 1)), torch.cat(seen[i]),
                                   rtol=0, atol=0)


def test_slice_ffn_keeps_both_halves_of_gate_up():
    """Keeping channels ``keep`` keeps rows ``keep`` (gate) and ``48 + keep`` (up); with
    the removed channels' down_proj columns zeroed the logits do not change."""
    model = tiny_model("phi3")
    ad = get_adapter(model)
    drop = [0, 7, 8, 20, 47]
    keep = [c for c in range(FFN) if c not in drop]
    for i in range(ad.num_blocks):
        with torch.no_grad():
            weight_out_in(ad.mlp_projections(i)["down"])[:, drop] = 0
    before = logits(model)
    w = weight_out_in(ad.mlp_projections(2)["gate_up"]).detach().clone()
    for i in range(ad.num_blocks):
        ad.slice_ffn(i, keep)
    idx = torch.tensor(keep)
    torch.testing.assert_close(weight_out_in(ad.mlp_projections(2)["gate_up"]),
                               torch.cat([w[idx], w[FFN + idx]]), rtol=0, atol=0)
    assert ad.ffn_width(2) == len(keep) and ad.vanilla_problems() == []
    torch.testing.assert_close(logits(model), before, rtol=1e-6, atol=1e-6)


def test_slice_kv_groups_in_one_block_only():
    """Removing KV group 0 of block 1 keeps query heads 2, 3 and KV head 1 (rows of the
    fused [q; k; v]) and equals zeroing that group's o_proj columns; the block gets its own
    config (Phi3Attention splits qkv at config.num_attention_heads), the others keep the
    model's."""
    model = tiny_model("phi3")
    masked = copy.deepcopy(model)
    with torch.no_grad():
        weight_out_in(get_adapter(masked).attn_projections(1)["o"])[:, 0:2 * HD] = 0
    ad = get_adapter(model)
    qkv = weight_out_in(ad.attn_projections(1)["qkv"]).detach().clone()
    ad.slice_kv_groups(1, [1])
    rows = torch.cat([torch.arange(16, 32), torch.arange(32 + 8, 32 + 16),
                      torch.arange(48 + 8, 48 + 16)])
    torch.testing.assert_close(weight_out_in(ad.attn_projections(1)["qkv"]), qkv[rows],
                               rtol=0, atol=0)
    geo = ad.head_geometry(1)
    assert (geo.num_heads, geo.num_kv_heads, geo.head_dim) == (2, 1, 8)
    assert ad.attention(1).config.num_attention_heads == 2
    assert ad.attention(0).config.num_attention_heads == model.config.num_attention_heads == 4
    assert ad.head_attribute_values(1) == {"": {"num_key_value_heads": 1,
                                                "num_key_value_groups": 2,
                                                "config.num_attention_heads": 2}}
    torch.testing.assert_close(logits(model), logits(masked), rtol=1e-5, atol=1e-5)
    assert "different head counts" in ad.vanilla_problems()[0]


def test_per_block_heads_reload_with_remote_code(tmp_path):
    """Per-block head counts (as global width pruning leaves them) save with the modeling
    file, which gives each resized attention its own config, and reload identically."""
    lm = wrap(tiny_model("phi3"), char_tokenizer(), spec="tiny-phi3")
    lm.adapter.slice_kv_groups(2, [0])
    lm.adapter.slice_ffn(0, range(0, FFN, 3))
    lm.history.append({"operation": "prune-width"})  # what save checks for per-block widths
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                    attn_implementation="eager").eval()
    torch.testing.assert_close(logits(again), logits(lm.model), rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [Wanda(sparsity=0.5, within_block="sequential",
                                       propagate="modified"), Magnitude(sparsity=0.5)],
                         ids=lambda c: type(c).__name__)
def test_sparsity_prunes_every_phi3_linear(cfg):
    """Needs the sparsity grouping to put role ``gate_up`` with gate/up (e.g. through
    ``Adapter.linear_groups``): without it the sequential executor skips gate_up_proj."""
    lm = wrap(tiny_model("phi3"), char_tokenizer(), spec="tiny-phi3")
    prunelab.prune(lm, cfg, CALIB, batch_size=3)
    ad = lm.adapter
    for i in range(ad.num_blocks):
        for path, m in ad.linears(i).items():
            w = weight_out_in(m)
            assert (w == 0).float().mean().item() == pytest.approx(0.5, abs=0.02), (i, path)
    assert torch.isfinite(logits(lm.model)).all()


def test_ffn_width_on_phi3_saves_a_plain_checkpoint(tmp_path):
    lm = wrap(tiny_model("phi3"), char_tokenizer(), spec="tiny-phi3")
    prunelab.prune(lm, Width(unit="ffn", score="wanda-sp", ratio=0.25), CALIB, batch_size=3)
    ad = lm.adapter
    assert {ad.ffn_width(i) for i in range(ad.num_blocks)} == {32}
    assert all(weight_out_in(ad.mlp_projections(i)["gate_up"]).shape[0] == 64
               for i in range(ad.num_blocks))
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert again.config.intermediate_size == 32
    torch.testing.assert_close(logits(again), logits(lm.model), rtol=0, atol=0)
