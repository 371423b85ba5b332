"""ExpectedAttention: the expected-logit formula on a hand-computed case, and the press
on a tiny Llama against an independent computation (pre-RoPE queries from q_proj, the
rotation matrices built from the rotary frequencies)."""

import math

import pytest
import torch
from transformers import DynamicCache

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.inference import PRESSES, press
from prunelab.inference.expected import ExpectedAttention, expected_scores
from prunelab.models.loading import wrap

from tiny_models import tiny_model, tiny_tokens


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _apply(x, cos, sin):  # the Llama convention, cos / sin broadcast over heads
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def test_registered_and_validated():
    assert PRESSES.make("expected-attention") == ExpectedAttention()
    with pytest.raises(ConfigError, match="horizon"):
        ExpectedAttention(horizon=0)
    with pytest.raises(ConfigError, match="covariance must be true or false"):
        ExpectedAttention(covariance="yes")


def test_expected_logits_by_hand():
    """No rotation (cos 1, sin 0): sink token 0 out; the queries at 1..3 are (1,0), (3,0),
    (2,0): mean (2, 0), covariance diag(2/3, 0). Keys (1,0), (0,1), (2,0) have expected
    logits mu.k + k^T S k / 2 = 2 + 1/3, 0, 4 + 4/3; softmax, times the value norms 1, 2,
    0.5; the sink gets the top score + 1."""
    q = torch.tensor([[9.0, 9.0], [1.0, 0.0], [3.0, 0.0], [2.0, 0.0]])[None, None]
    k = torch.tensor([[5.0, 5.0], [1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])[None, None]
    v = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.3, 0.4]])[None, None]
    cos, sin = torch.ones(4, 2), torch.zeros(4, 2)
    cfg = ExpectedAttention(sinks=1, horizon=8)
    got = expected_scores(cfg, q, k, v, 1.0, cos, sin, _apply)
    z = [2 + 1 / 3, 0.0, 4 + 4 / 3]
    p = [math.exp(x) / sum(math.exp(y) for y in z) for x in z]
    want = [p[0] * 1.0, p[1] * 2.0, p[2] * 0.5]
    assert torch.allclose(got[0, 0, 1:], torch.tensor(want), atol=1e-6)
    assert got[0, 0, 0] == pytest.approx(max(want) + 1)
    no_cov = expected_scores(ExpectedAttention(sinks=1, covariance=False, vnorm=False),
                             q, k, v, 1.0, cos, sin, _apply)
    z = [2.0, 0.0, 4.0]
    assert torch.allclose(no_cov[0, 0, 1:], torch.tensor(z).softmax(0), atol=1e-6)
    last2 = expected_scores(ExpectedAttention(sinks=1, queries=2, vnorm=False),
                            q, k, v, 1.0, cos, sin, _apply)  # queries 2, 3: mean 2.5, var 1/4
    z = [2.5 + 1 / 8, 0.0, 5 + 1 / 2]
    assert torch.allclose(last2[0, 0, 1:], torch.tensor(z).softmax(0), atol=1e-6)


def _independent_scores(lm, ids, cfg):
    """Per block: pre-RoPE queries from q_proj of the block's input, the mean rotation
    matrix of positions L .. L + horizon - 1 from the rotary frequencies, the expected
    logits with 1 / sqrt(d), softmax, mean over each KV group, times ||v||."""
    model = lm.model
    inputs, caches = {}, DynamicCache(config=model.config)
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(
        lambda mod, args, kw, i=i: inputs.__setitem__(i, kw["hidden_states"]), with_kwargs=True)
        for i in range(4)]
    with torch.no_grad():
        model(ids, cache=caches, use_cache=True)
    for h in hooks:
        h.remove()
    length, d, heads, groups = ids.shape[1], 8, 4, 2
    inv = model.model.rotary_emb.inv_freq.double()  # [d / 2]
    rbar = torch.zeros(d, d, dtype=torch.float64)
    for t in range(length, length + cfg.horizon):
        c, s = torch.cos(t * inv), torch.sin(t * inv)
        r = torch.zeros(d, d, dtype=torch.float64)
        half = d // 2
        for i in range(half):  # x'_i = x_i c - x_{i+h} s, x'_{i+h} = x_{i+h} c + x_i s
            r[i, i], r[i, i + half] = c[i], -s[i]
            r[i + half, i + half], r[i + half, i] = c[i], s[i]
        rbar += r / cfg.horizon
    out = {}
    for layer in range(4):
        attn = model.model.layers[layer].self_attn
        with torch.no_grad():
            q = attn.q_proj(inputs[layer])[0].view(length, heads, d).transpose(0, 1).double()
        q = q[:, cfg.sinks:]
        mu = q.mean(1)  # [H, d]
        cen = q - mu[:, None]
        cov = cen.transpose(1, 2) @ cen / q.shape[1]
        mu_r = mu @ rbar.T
        cov_r = rbar @ cov @ rbar.T
        keys = caches.layers[layer].keys[0].double()[:, cfg.sinks:]  # [G, L', d]
        vals = caches.layers[layer].values[0].double()[:, cfg.sinks:]
        k = keys.repeat_interleave(heads // groups, 0)
        z = (k @ mu_r[..., None])[..., 0] / math.sqrt(d) + \
            0.5 * ((k @ cov_r) * k).sum(-1) / d
        p = z.softmax(-1).view(groups, heads // groups, -1).mean(1) * vals.norm(dim=-1)
        out[layer] = p
    return out


def test_the_press_scores_and_keeps_as_an_independent_computation(monkeypatch):
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(1, 24)
    cfg = ExpectedAttention(ratio=0.5, sinks=2, horizon=16)
    want = _independent_scores(lm, ids, cfg)
    seen = []
    real = ExpectedAttention.score
    monkeypatch.setattr(ExpectedAttention, "score",
                        lambda *a: seen.append(real(*a)) or seen[-1])
    with press(lm, cfg) as s:
        lm.model(ids, use_cache=True)
    assert len(seen) == 4
    for layer, got in enumerate(seen):
        assert torch.allclose(got[0, :, 2:].double(), want[layer], rtol=1e-4, atol=1e-7)
    assert set(s.report["keep"]) == {0, 1, 2, 3}
    for layer, idx in s.report["keep"].items():
        for g in range(2):
            top = (want[layer][g].topk(12 - 2).indices + 2).tolist()
            assert set(idx[0, g].tolist()) == {0, 1} | set(top)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "phi3", "gpt_neox"])
def test_the_pressed_cache_matches_a_hand_built_one(arch):
    """q_norm, sliding layers, fused qkv, partial rotary: the next tokens equal the plain
    model on its own cache gathered to the kept entries at the original positions."""
    m = tiny_model(arch)
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 3, seed=4)
    with torch.no_grad(), press(m, ExpectedAttention(ratio=0.5, sinks=2)) as s:
        out = m(ids, use_cache=True)
        step = m(nxt, cache=out.cache, use_cache=True)
    assert s.report["keep"] and all(i.shape[-1] == 10 for i in s.report["keep"].values())
    assert all(set(range(2)) <= set(i[0, 0].tolist()) for i in s.report["keep"].values())
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        m(ids, cache=cache, use_cache=True)
        for i, idx in s.report["keep"].items():
            layer = cache.layers[i]
            g = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
        ref = m(nxt, cache=cache, use_cache=True, position_ids=torch.tensor([[20, 21, 22]]))
    assert torch.allclose(step.logits, ref.logits, atol=1e-5)


def test_a_model_without_rope_is_refused_up_front():
    with pytest.raises(UnsupportedOperationError, match="needs rotary position embeddings"):
        with press(wrap(tiny_model("gpt2")), ExpectedAttention()):
            pass
