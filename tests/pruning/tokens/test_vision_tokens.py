"""TAP-Path token pruning on tiny random ViTs: identity at keep = 1, CLS kept and the
right token counts, the CLS attention equal to the model's own, the gated depth head."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from prunelab.errors import ConfigError, UnsupportedArchitectureError
from prunelab.models.loading import wrap
from prunelab.pruning.tokens import (
    TokenPrunedEncoder,
    TokenPruning,
    cls_attention,
    depth_features,
    lfw_gated_accuracy,
    train_gated_head,
)
from prunelab.pruning.tokens.runtime import prune_tokens
from tiny_media import hidden, pixels, tiny_vision


@pytest.mark.parametrize("arch", ["dinov2", "vit"])
def test_keep_all_tokens_is_the_dense_forward(arch):
    lm = wrap(tiny_vision(arch))
    x = pixels(3).input_ids
    for cfg in (TokenPruning(keep=1.0, layers=(0, 2)), TokenPruning(keep=0.5, layers=())):
        assert torch.equal(TokenPrunedEncoder(lm, cfg)(x), hidden(lm.model, x))


def test_token_counts_and_cls_kept():
    lm = wrap(tiny_vision())
    x = pixels(3).input_ids
    enc = TokenPrunedEncoder(lm, TokenPruning(keep=0.5, layers=(1, 2)))
    out = enc(x)
    # 16 patches -> 8 kept + CLS + fused = 10; then 9 patches -> 5 + CLS + fused = 7
    assert enc.tokens_per_block == [17, 10, 7, 7] and out.shape == (3, 7, 32)
    drop = TokenPrunedEncoder(lm, TokenPruning(keep=0.7, layers=(1,), fuse=False))
    drop(x)
    assert drop.tokens_per_block == [17, 1 + 12, 13, 13]  # ceil(0.7 * 16) = 12


def test_prune_tokens_hand_case():
    h = torch.arange(5 * 2, dtype=torch.float).view(1, 5, 2)  # CLS + 4 patches
    scores = torch.tensor([[0.5, 0.1, 0.4, 0.3, 0.2]])
    kept = prune_tokens(h, scores, keep=0.5, fuse=False)
    assert kept[0].tolist() == [[0, 1], [4, 5], [6, 7]]  # CLS, patches 2 and 3 in order
    fused = prune_tokens(h, scores, keep=0.5, fuse=True)
    w = torch.tensor([0.1, 0.2]) / 0.3  # dropped: patch 1 (0.1), patch 4 (0.2)
    want = w[0] * h[0, 1] + w[1] * h[0, 4]
    torch.testing.assert_close(fused[0, -1], want)
    assert torch.equal(prune_tokens(h, scores, keep=1.0, fuse=True), h)


def test_cls_attention_equals_the_models_attention_probabilities():
    model = tiny_vision()
    model.config._attn_implementation = "eager"
    lm = wrap(model)
    x = pixels(2).input_ids
    with torch.no_grad():
        out = model(pixel_values=x, output_attentions=True, output_hidden_states=True)
    for i in (0, 2):
        want = out.attentions[i][:, :, 0].mean(1)
        torch.testing.assert_close(cls_attention(lm.adapter, i, out.hidden_states[i]), want,
                                   rtol=1e-5, atol=1e-6)


def test_gated_head_learns_a_separable_task_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(40) % 2
    feats = torch.randn(40, 3, 4, generator=g)
    feats[:, 2, 0] += 8 * y  # only depth 2 carries the label
    a = train_gated_head(feats, y, steps=200)
    b = train_gated_head(feats, y, steps=200)
    assert torch.equal(a(feats), b(feats))
    assert float((a(feats).argmax(-1) == y).float().mean()) == 1.0


def test_depth_features_and_lfw_head_run_on_a_tiny_model():
    lm = wrap(tiny_vision())
    enc = TokenPrunedEncoder(lm, TokenPruning(keep=0.7, layers=(1,)))
    f = depth_features(enc, pixels(3).input_ids, (1, 3))
    assert f.shape == (3, 2, 64)
    res = lfw_gated_accuracy(enc, (1, 3), size=28)
    assert 0.0 <= res["lfw_gated_accuracy"] <= 1.0
    assert sum(res["gate_weights"]) == pytest.approx(1.0)


def test_token_pruning_errors():
    with pytest.raises(ConfigError, match="keep"):
        TokenPruning(keep=0.0)
    with pytest.raises(ConfigError, match="out of range"):
        TokenPrunedEncoder(wrap(tiny_vision()), TokenPruning(layers=(7,)))
    bert = tf.BertModel(tf.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=8))
    with pytest.raises(UnsupportedArchitectureError, match="vision"):
        TokenPrunedEncoder(wrap(bert))


def test_cli_prune_tokens_writes_json_and_rejects_bad_layers(tmp_path):
    from prunelab.cli import cli_main

    ckpt = tmp_path / "tiny"
    tiny_vision().save_pretrained(ckpt)
    out = tmp_path / "tokens.json"
    rc = cli_main(["prune", "tokens", "--model", str(ckpt), "--budget", "keep-tokens:0.5",
                   "--layers", "1",
                   "--depths", "1,3", "--samples", "3", "--size", "56", "--lfw-size", "28",
                   "--json", str(out)])
    assert rc == 0
    import json

    res = json.loads(out.read_text())
    assert res["tokens_per_block"] == [17, 10, 10, 10] and res["keep"] == 0.5
    assert 0 < res["cls_cosine"] <= 1 + 1e-9 and "lfw_gated_accuracy" in res
    assert cli_main(["prune", "tokens", "--model", str(ckpt), "--layers", "x"]) == 2


def test_cli_prune_depth_on_a_vision_checkpoint_reloads_in_transformers(tmp_path):
    import json

    from prunelab.cli import cli_main

    ckpt = tmp_path / "tiny"
    tiny_vision().save_pretrained(ckpt)
    out = tmp_path / "pruned"
    rc = cli_main(["prune", "depth", "--model", str(ckpt), "--budget", "remove-blocks:1",
                   "--recovery",
                   "foldable", "--samples", "4", "--bootstrap", "0", "--out", str(out)])
    assert rc == 0
    man = json.loads((out / "manifest.json").read_text())
    assert "images:calib" in json.dumps(man)
    again = tf.AutoModel.from_pretrained(out)
    assert again.config.num_hidden_layers == 3
