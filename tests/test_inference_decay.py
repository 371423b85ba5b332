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
