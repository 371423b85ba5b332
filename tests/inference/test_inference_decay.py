"""Learned decay-based KV eviction (after Universal Attention) on tiny random models."""

import torch
from transformers import DynamicCache

from prunelab.inference import PRESSES, DecayEviction, StreamingLLM, fit_decay, press
from prunelab.inference.decay import key_features
from prunelab.models.loading import wrap
from prunelab.registry import to_dict

from tiny_models import tiny_model, tiny_tokens


def test_fit_matches_an_independent_least_squares_on_the_attention_targets():
    m = tiny_model("llama")
    lm = wrap(m)
    calib = tiny_tokens(3, 20, seed=3)
    cfg = fit_decay(lm, calib, ratio=0.5, window=4, ridge=0.0)
    assert len(cfg.weights) == 4 * 2 * 5
    assert PRESSES.from_dict(to_dict(cfg)) == cfg
    w = torch.tensor(cfg.weights).view(4, 2, 5)
    layer = 2
    xs, ys = [], []
    for row in calib.split(1):
        cache = DynamicCache(config=m.config)
        att = m(row, cache=cache, use_cache=True, output_attentions=True).attentions[layer]
        mass = att[0, :, -4:].mean(1).view(2, 2, 20).mean(1)  # [G, L]
        x = key_features(cache.layers[layer].keys, cache.layers[layer].values)[0]
        xs.append(x[:, 1:16])
        ys.append(torch.log(mass[:, 1:16] + 1e-6))
    x, y = torch.cat(xs, 1).double(), torch.cat(ys, 1).double()
    for g in range(2):
        theta = torch.linalg.lstsq(x[g], y[g]).solution
        assert torch.allclose(w[layer, g].double(), theta, atol=1e-3, rtol=1e-3)
        # the key statistics explain more than the recency prior alone
        prior = torch.linalg.lstsq(x[g][:, [0, 4]], y[g]).solution
        assert ((x[g] @ theta - y[g]) ** 2).sum() < ((x[g][:, [0, 4]] @ prior - y[g]) ** 2).sum()


def test_decay_press_shrinks_and_keeps_sink_and_window():
    m = tiny_model("llama")
    lm = wrap(m)
    cfg = fit_decay(lm, tiny_tokens(2, 20, seed=3), ratio=0.75, window=3)
    ids = tiny_tokens(1, 20)
    with press(lm, cfg) as s:
        cache = m(ids, use_cache=True).cache
        seq = m.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert all(layer.keys.shape == (1, 2, 5, 8) for layer in cache.layers)
    for idx in s.report["keep"].values():
        assert (idx[..., 0] == 0).all() and (idx[..., -3:] == torch.tensor([17, 18, 19])).all()
    assert seq.shape == (1, 23)


def test_unfitted_decay_is_the_recency_prior():
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(1, 20)
    with press(lm, DecayEviction(ratio=0.5, window=2)) as s:
        lm.model(ids, use_cache=True)
    with press(lm, StreamingLLM(ratio=0.5, sinks=1)) as r:
        lm.model(ids, use_cache=True)
    for i in s.report["keep"]:
        assert torch.equal(s.report["keep"][i], r.report["keep"][i])


def test_decay_ratio_zero_is_exact():
    m = tiny_model("llama")
    lm = wrap(m)
    ids = tiny_tokens(2, 16)
    ref = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with press(lm, DecayEviction(ratio=0.0)):
        out = m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ref, out)


def test_lookahead_fit_with_observation_feature_matches_an_independent_least_squares():
    # observe=3, horizon=5 on windows of 20: prompt = 15 tokens; the target is the mean
    # attention of queries 15..19 on the prompt keys, the sixth feature the log of the mean
    # attention of queries 12..14; fitted tokens 1..11 (sink and the last window=4 kept)
    m = tiny_model("llama")
    lm = wrap(m)
    calib = tiny_tokens(3, 20, seed=5)
    cfg = fit_decay(lm, calib, window=4, ridge=0.0, observe=3, horizon=5, kernel=3)
    assert cfg.observe == 3 and cfg.features == 6 and len(cfg.weights) == 4 * 2 * 6
    assert PRESSES.from_dict(to_dict(cfg)) == cfg
    w = torch.tensor(cfg.weights).view(4, 2, 6)
    layer = 1
    xs, ys = [], []
    for row in calib.split(1):
        cache = DynamicCache(config=m.config)
        att = m(row, cache=cache, use_cache=True, output_attentions=True).attentions[layer]
        future = att[0, :, 15:, :15].mean(1).view(2, 2, 15).mean(1)
        seen = att[0, :, 12:15, :15].mean(1)  # [H, 15], max-pooled over 3 neighbours
        seen = torch.nn.functional.max_pool1d(seen[:, None], 3, 1, 1)[:, 0]
        seen = seen.view(2, 2, 15).mean(1)
        keys, values = cache.layers[layer].keys[:, :, :15], cache.layers[layer].values[:, :, :15]
        x = torch.cat([key_features(keys, values)[0], torch.log(seen + 1e-6)[..., None]], -1)
        xs.append(x[:, 1:11])
        ys.append(torch.log(future[:, 1:11] + 1e-6))
    x, y = torch.cat(xs, 1).double(), torch.cat(ys, 1).double()
    for g in range(2):
        theta = torch.linalg.lstsq(x[g], y[g]).solution
        assert torch.allclose(w[layer, g].double(), theta, atol=1e-3, rtol=1e-3)


def test_observation_only_decay_keeps_the_top_observed_tokens():
    # weights that use only the sixth feature: besides the sink and the last window, each
    # KV head keeps the tokens the last 4 queries attended most (computed independently)
    m = tiny_model("llama")
    lm = wrap(m)
    only = [0.0] * 5 + [1.0]
    cfg = DecayEviction(ratio=0.5, window=4, observe=4, kernel=1,
                        weights=tuple(only * 4 * 2))
    ids = tiny_tokens(1, 24, seed=2)
    with press(lm, cfg) as s:
        m(ids, use_cache=True)
    att = m(ids, output_attentions=True).attentions
    for i, kept in s.report["keep"].items():
        seen = att[i][0, :, -4:].mean(1).view(2, 2, 24).mean(1)  # [G, 24]
        for g in range(2):
            top = seen[g, 1:20].topk(12 - 5).indices + 1
            want = sorted({0, 20, 21, 22, 23} | set(top.tolist()))
            assert kept[0, g].tolist() == want


def test_decay_weight_length_must_match_the_features():
    import pytest

    from prunelab.errors import ConfigError

    with pytest.raises(ConfigError, match="multiple of 6"):
        DecayEviction(observe=2, weights=(0.0,) * 5)
