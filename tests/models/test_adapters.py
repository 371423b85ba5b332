"""Adapters: structural operations on tiny random models of every supported architecture."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from prunelab.errors import UnsupportedArchitectureError, UnsupportedOperationError
from prunelab.models.adapters import get_adapter
from prunelab.models.linear import weight_out_in

from tiny_models import ALL_ARCHS, tiny_config, tiny_model, tiny_tokens

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
GQA = (*LLAMA_LIKE, "phi3")  # 2 KV groups of 2 query heads; explicit head_dim in the config


def out_of(model, ids):
    with torch.no_grad():
        o = model(input_ids=ids)
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def blocks_prefix(model) -> str:
    blocks = get_adapter(model).blocks()
    return next(name for name, mod in model.named_modules() if mod is blocks)


def auto_class(arch):
    return tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_geometry_read_from_weights(arch):
    ad = get_adapter(tiny_model(arch))
    geo = ad.head_geometry(0)
    expected_kv = 2 if arch in GQA else 4
    assert (geo.num_heads, geo.num_kv_heads, geo.head_dim) == (4, expected_kv, 8)
    assert ad.ffn_width(0) == 48 and ad.num_blocks == 4 and ad.hidden_size() == 32
    assert set(ad.linears(0)) == set(ad.spec.attn_proj.values()) | set(ad.spec.mlp_proj.values())


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_delete_equals_manually_built_shorter_model(arch):
    model = tiny_model(arch)
    ids = tiny_tokens(2, 12)
    # the manual model: a fresh config with 3 blocks and renumbered weights
    cfg = tiny_config(arch)
    cfg.num_hidden_layers = 3
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [t for i, t in enumerate(cfg.layer_types) if i != 1]
    manual = auto_class(arch).from_config(cfg, attn_implementation="eager").eval()
    prefix = blocks_prefix(model)
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith(prefix + "."):
            idx, rest = key[len(prefix) + 1:].split(".", 1)
            idx = int(idx)
            if idx == 1:
                continue
            key = f"{prefix}.{idx - 1 if idx > 1 else idx}.{rest}"
        state[key] = value
    manual.load_state_dict(state, strict=False)
    ad = get_adapter(model)
    kept = ad.delete_blocks([1])
    assert kept == [0, 2, 3]
    assert model.config.num_hidden_layers == 3
    assert all(m.layer_idx == pos for pos, blk in enumerate(ad.blocks())
               for m in blk.modules() if hasattr(m, "layer_idx"))
    torch.testing.assert_close(out_of(model, ids), out_of(manual, ids), rtol=0, atol=1e-6)


def test_gemma3_layer_types_follow_their_blocks():
    model = tiny_model("gemma3_text")
    ad = get_adapter(model)
    ad.delete_blocks([0, 1])
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert [b.self_attn.is_sliding for b in ad.blocks()] == [False, True]


def zero_group_inputs(model, arch, block, group):
    """Masking reference: zero o_proj's input columns of one KV group (and its heads)."""
    ad = get_adapter(model)
    geo = ad.head_geometry(block)
    width = geo.group_size * geo.head_dim
    with torch.no_grad():
        weight_out_in(ad.attn_projections(block)["o"])[:, group * width:(group + 1) * width] = 0


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_slicing_equals_masking(arch):
    """Removing KV group 0 and FFN channels equals zeroing their consumer columns."""
    model = tiny_model(arch)
    masked = copy.deepcopy(model)
    ids = tiny_tokens(2, 12)
    drop = [1, 5, 6, 30, 47]
    keep = [c for c in range(48) if c not in drop]
    zero_group_inputs(masked, arch, 2, 0)
    mad = get_adapter(masked)
    with torch.no_grad():
        weight_out_in(mad.mlp_projections(2)["down"])[:, drop] = 0
    ad = get_adapter(model)
    n_groups = ad.head_geometry(2).num_kv_heads
    ad.slice_kv_groups(2, range(1, n_groups))
    ad.slice_ffn(2, keep)
    geo = ad.head_geometry(2)
    assert geo.num_kv_heads == n_groups - 1 and ad.ffn_width(2) == len(keep)
    torch.testing.assert_close(out_of(model, ids), out_of(masked, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", LLAMA_LIKE)
def test_query_heads_within_groups(arch):
    model = tiny_model(arch)
    masked = copy.deepcopy(model)
    ids = tiny_tokens(2, 12)
    ad = get_adapter(model)
    ad.slice_query_heads(1, [[1], [0]])  # group 0 keeps head 1, group 1 keeps its head 0
    geo = ad.head_geometry(1)
    assert (geo.num_heads, geo.num_kv_heads) == (2, 2)
    hd = 8
    with torch.no_grad():
        o = weight_out_in(get_adapter(masked).attn_projections(1)["o"])
        o[:, 0:hd] = 0  # group 0, head 0
        o[:, 3 * hd:4 * hd] = 0  # group 1, head 1
    torch.testing.assert_close(out_of(model, ids), out_of(masked, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedOperationError, match="same"):
        ad.slice_query_heads(0, [[0, 1], [0]])


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_prune_save_reload_plain_transformers(arch, tmp_path):
    """Delete a block, slice FFN channels in every block (and a KV group / query heads where
    a plain config can hold it); a plain transformers reload gives identical outputs."""
    model = tiny_model(arch)
    ids = tiny_tokens(2, 12)
    ad = get_adapter(model)
    ad.delete_blocks([2])
    for i in range(ad.num_blocks):
        ad.slice_ffn(i, range(0, 48, 2))
        if arch in GQA:
            ad.slice_kv_groups(i, [1])
    if arch in GQA:
        assert ad.vanilla_problems() == []
    else:
        # a family that derives head_dim from hidden_size cannot describe fewer heads
        sliced = copy.deepcopy(model)
        sad = get_adapter(sliced)
        for i in range(sad.num_blocks):
            sad.slice_kv_groups(i, [0, 1, 3])
        with pytest.raises(UnsupportedOperationError, match="head_dim"):
            sad.sync_config()
    before = out_of(model, ids)
    ad.sync_config()
    model.save_pretrained(tmp_path)
    reloaded = auto_class(arch).from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.num_hidden_layers == 3
    torch.testing.assert_close(out_of(reloaded, ids), before, rtol=0, atol=0)


def test_nonuniform_blocks_cannot_be_vanilla():
    model = tiny_model("llama")
    ad = get_adapter(model)
    ad.slice_ffn(0, range(10))
    assert "different FFN widths" in ad.vanilla_problems()[0]
    with pytest.raises(UnsupportedOperationError, match="custom modeling file"):
        ad.sync_config()


def test_invalid_operations():
    ad = get_adapter(tiny_model("llama"))
    with pytest.raises(UnsupportedOperationError, match="out of range"):
        ad.delete_blocks([7])
    with pytest.raises(UnsupportedOperationError, match="all 4 blocks"):
        ad.delete_blocks(range(4))
    with pytest.raises(UnsupportedOperationError, match="invalid"):
        ad.slice_kv_groups(0, [2])
    with pytest.raises(UnsupportedOperationError, match="needs GQA"):
        get_adapter(tiny_model("gpt2")).slice_query_heads(0, [[0]] * 4)


def test_unknown_architecture_lists_supported():
    cfg = tf.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    model = tf.T5ForConditionalGeneration(cfg)
    with pytest.raises(UnsupportedArchitectureError) as err:
        get_adapter(model)
    msg = str(err.value)
    assert "'t5'" in msg and "gemma3_text" in msg and "bert" in msg and "\n" not in msg


def test_tied_head_is_not_a_block_linear():
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ad = get_adapter(model)
    head = ad.head()
    for i in range(ad.num_blocks):
        assert all(m is not head for m in ad.linears(i).values())


# ---------------------------------------------------------------- family data
def test_linear_groups_follow_execution_order_and_shared_inputs():
    ad = get_adapter(tiny_model("llama"))
    assert [list(g) for g in ad.linear_groups(0)] == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    gpt2 = get_adapter(tiny_model("gpt2"))
    assert [list(g) for g in gpt2.linear_groups(0)] == [["attn.c_attn"], ["attn.c_proj"],
                                                        ["mlp.c_fc"], ["mlp.c_proj"]]
    only = {p: m for p, m in ad.linears(0).items() if p.endswith(("k_proj", "down_proj"))}
    assert [list(g) for g in ad.linear_groups(0, only)] == [["self_attn.k_proj"],
                                                           ["mlp.down_proj"]]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_post_norms_are_family_data(arch):
    ad = get_adapter(tiny_model(arch))
    assert ad.mlp_post_normed(0) == (arch in ("gemma2", "gemma3_text"))


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_head_attributes_follow_slicing(arch):
    """Every head attribute the family names holds the sliced counts in the sliced block
    and the old ones elsewhere (gpt_neox reshapes with -1 and stores none)."""
    model = tiny_model(arch)
    ad = get_adapter(model)
    geo = ad.head_geometry(1)
    ad.slice_kv_groups(1, [geo.num_kv_heads - 1])
    new = ad.head_geometry(1)

    def expected(g):
        return {"heads": g.num_heads, "kv": g.num_kv_heads, "groups": g.group_size,
                "width": g.num_heads * g.head_dim}

    for index, g in ((1, new), (0, geo)):
        found = ad.head_attribute_values(index)
        flat = {f"{o}.{k}" if o else k: v for o, d in found.items() for k, v in d.items()}
        assert flat == {k: expected(g)[q] for k, q in ad.spec.head_attributes.items()
                        if k in flat}
        assert bool(flat) == (arch != "gpt_neox")


@pytest.mark.parametrize(("arch", "key"), [("llama", "cache"), ("gpt_neox", "layer_past"),
                                           ("phi3", "cache")])
def test_runner_clears_the_family_cache_keyword(arch, key):
    from prunelab.calib.runner import BlockRunner

    runner = BlockRunner(tiny_model(arch), tiny_tokens(1, 4), batch_size=1)
    args, kwargs = runner._clean(((), {key: object(), "use_cache": True, "other": 3}))
    assert kwargs == {key: None, "other": 3} and key in runner.adapter.spec.cache_kwargs
