"""PrunePath's few-token (decode) path: same output as the grouped routed path, reads only
the selected experts, keeps the checkpoint format (pruning/moe/module.py)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data import TokenBatches
from prunelab.models.loading import wrap
from prunelab.pruning.moe import PrunePath, PrunePathMLP, prunepath_modules, reset_stats, set_mass

from tiny_models import char_tokenizer, tiny_model, tiny_tokens


def _module(fused=False, bias=False, act="silu", sizes=(5, 7, 6, 6, 8), seed=0):
    torch.manual_seed(seed)
    m = PrunePathMLP(24, list(sizes), act=act, fused=fused, bias=bias)
    torch.nn.init.normal_(m.router.weight, std=1.5)  # spread the routing probabilities
    if bias:
        for p in (m.down_proj.bias, m.router.bias):
            torch.nn.init.normal_(p)
    return m


CASES = [dict(fused=f, bias=b, act=a) for f, b, a in
         itertools.product((False, True), (False, True), ("silu", "gelu_tanh", "relu"))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_few_token_path_equals_the_grouped_path(case):
    m = _module(**case)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in range(1, m.FEW_TOKENS + 2):
            for mass in (0.2, 0.5, 0.8, 0.95, 1.0):
                h = torch.randn(n, 24, generator=g)
                sel = m.select(m.route(h), mass)
                torch.testing.assert_close(m.few(h, sel), m.routed(h, sel), rtol=1e-5,
                                           atol=1e-6)
                # forward takes the few-token path up to FEW_TOKENS tokens
                m.mass = mass
                want = m.dense(h) if mass >= 1 else m.routed(h, sel)
                torch.testing.assert_close(m(h.reshape(1, n, 24)).reshape(n, 24), want,
                                           rtol=1e-5, atol=1e-6)
        # every expert: the dense FFN
        h = torch.randn(3, 24, generator=g)
        every = torch.ones(3, m.num_experts, dtype=torch.bool)
        torch.testing.assert_close(m.few(h, every), m.dense(h), rtol=1e-5, atol=1e-6)


def test_select_one_makes_the_same_choice_as_select():
    m = _module()
    g = torch.Generator().manual_seed(2)
    for mass in (1e-6, 0.3, 0.6, 0.9, 0.999):
        for _ in range(100):
            probs = m.route(torch.randn(1, 24, generator=g) * 3)
            assert m.select_one(probs, mass) == m.select(probs, mass)[0].int().tolist()
    ties = torch.tensor([[0.25, 0.25, 0.5, 0.0, 0.0]])
    for mass in (0.3, 0.5, 0.6, 0.75, 0.76):
        assert m.select_one(ties, mass) == m.select(ties, mass)[0].int().tolist()


def test_runs_merge_adjacent_experts():
    m = PrunePathMLP(8, [2, 3, 4, 5])  # channels [0,2) [2,5) [5,9) [9,14)
    assert m.runs([1, 1, 0, 1]) == [(0, 5), (9, 14)]
    assert m.runs([0, 1, 1, 1]) == [(2, 14)]
    assert m.runs([1, 0, 1, 0]) == [(0, 2), (5, 9)]
    assert m.runs([0, 0, 0, 0]) == []


@pytest.mark.parametrize("fused", [False, True])
def test_the_few_token_path_never_touches_unselected_experts(fused):
    """NaN weights in the experts a token does not use leave its output finite."""
    m = _module(fused=fused, bias=True)
    h = torch.randn(1, 24)
    m.mass = 0.5
    with torch.no_grad():
        flags = m.select_one(m.route(h), 0.5)
        assert 0 < sum(flags) < m.num_experts
        want = m(h)
        for e, on in enumerate(flags):
            if on:
                continue
            s, t = m.starts[e], m.starts[e + 1]
            m.down_proj.weight[:, s:t] = float("nan")
            if fused:
                m.gate_up_proj.weight[s:t] = float("nan")
                m.gate_up_proj.weight[m.ffn + s:m.ffn + t] = float("nan")
            else:
                m.gate_proj.weight[s:t] = float("nan")
                m.up_proj.weight[s:t] = float("nan")
        got = m(h)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


def test_down_is_stored_column_major_in_the_parameter_itself():
    m = _module(bias=True)
    w = m.down_proj.weight
    assert w.shape == (24, m.ffn) and w.t().is_contiguous()
    rows = m.down_rows()
    assert rows.is_contiguous() and rows.data_ptr() == w.data_ptr()  # a view, no copy
    keys = set(m.state_dict())
    assert keys == {"gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
                    "down_proj.weight", "down_proj.bias", "router.weight", "router.bias"}
    h = torch.randn(1, 24)
    m.mass = 0.6
    with torch.no_grad():
        want = m(h)
        values = w.detach().clone()
        # a checkpoint load puts a row-major tensor in the parameter's place
        w.data = w.detach().contiguous()
        assert not w.t().is_contiguous()
        got = m(h)
    assert m.down_proj.weight is w and w.t().is_contiguous()  # laid out again, in place
    assert torch.equal(w.detach(), values) and torch.equal(got, want)
    assert set(m.state_dict()) == keys


def test_counters_match_the_grouped_path():
    a = _module()
    b = copy.deepcopy(a)
    b.FEW_TOKENS = 0  # this instance always groups by expert
    g = torch.Generator().manual_seed(3)
    a.mass = b.mass = 0.7
    with torch.no_grad():
        for n in (1, 1, 2, 3, 1, 4, 1):
            h = torch.randn(n, 24, generator=g)
            torch.testing.assert_close(a(h), b(h), rtol=1e-5, atol=1e-6)
    assert a.stat_tokens == b.stat_tokens == 13
    assert a.stat_routed == b.stat_routed == 13
    assert a.stat_expert_tokens == b.stat_expert_tokens
    assert a.flops_per_token() == b.flops_per_token()
    a.mass = 1.0
    a.reset_stats()
    with torch.no_grad():
        a(torch.randn(1, 24))
    assert a.stat_tokens == 1 and a.stat_routed == 0 and a.stat_expert_tokens == [1] * 5


def test_gradients_match_the_grouped_path():
    m = _module(bias=True)
    h = torch.randn(3, 24, requires_grad=True)
    sel = m.select(m.route(h), 0.6)
    grads = []
    for path in (m.few, m.routed):
        h.grad = None
        m.zero_grad()
        path(h, sel).square().sum().backward()
        grads.append([h.grad.clone()] + [p.grad.clone() for p in
                                         (m.gate_proj.weight, m.up_proj.weight,
                                          m.down_proj.weight, m.down_proj.bias)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- whole models
def _pruned(mass=0.6):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    calib = TokenBatches(input_ids=tiny_tokens(8, 32, seed=1), spec="tiny", seqlen=32,
                         samples=8, seed=0, mode="calib", total_windows=8, sha256="0")
    prunelab.prune(lm, PrunePath(experts=4, router_steps=20, mass=mass), calib, batch_size=4)
    return lm


@torch.no_grad()
def _decode(model, ids, prompt=6):
    """Logits at positions ``prompt - 1`` onwards: ``ids[:, :prompt]`` prefilled, the rest
    fed one token per step with the KV cache."""
    out = model(input_ids=ids[:, :prompt], use_cache=True)
    cache, logits = out.cache, [out.logits[:, -1]]
    for j in range(prompt, ids.shape[1]):
        out = model(input_ids=ids[:, j:j + 1], cache=cache, use_cache=True)
        cache = out.cache
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def test_decode_equals_the_full_forward_and_reloads_identically(tmp_path):
    lm = _pruned()
    ids = tiny_tokens(1, 20, seed=4)
    with torch.no_grad():
        full = lm.model(input_ids=ids, use_cache=False).logits[:, 5:]  # grouped path
    reset_stats(lm)
    step = _decode(lm.model, ids)  # one token per step: the few-token path
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
    for _, m in prunepath_modules(lm):
        assert m.stat_tokens == 20 and m.stat_routed == 20  # 6 prefilled, 14 decoded
        assert sum(m.stat_expert_tokens) < 20 * m.num_experts  # experts were skipped
    out = prunelab.save(lm, tmp_path / "ckpt")
    kw = {"trust_remote_code": True, "attn_implementation": "eager"}
    again = tf.AutoModelForCausalLM.from_pretrained(out, **kw).eval()
    keys = set(lm.model.state_dict())
    assert set(again.state_dict()) == keys
    torch.testing.assert_close(_decode(again, ids), step, rtol=0, atol=0)
    for (_, a), (_, b) in zip(prunepath_modules(again), prunepath_modules(lm), strict=True):
        assert a.down_proj.weight.t().is_contiguous()  # laid out on the first call
        assert torch.equal(a.down_proj.weight, b.down_proj.weight)
    # the reloaded (re-laid-out) model saves the same tensors under the same keys
    second = prunelab.save(prunelab.load(str(out), trust_remote_code=True), tmp_path / "again")
    third = tf.AutoModelForCausalLM.from_pretrained(second, **kw).eval()
    assert set(third.state_dict()) == keys
    torch.testing.assert_close(_decode(third, ids), step, rtol=0, atol=0)
    set_mass(third, 1.0)
    dense = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    torch.testing.assert_close(_decode(third, ids), _decode(dense.model, ids), rtol=0,
                               atol=2e-5)
