"""TOVA and KNorm: scores checked against the plain model's attention weights and cached
keys, hand-made selection cases, decode-time TOVA, and the pressed cache against a hand-built
one on several families."""

import pytest
import torch
from transformers import DynamicCache

from prunelab.inference import PRESSES, TOVA, KNorm, press
from prunelab.inference.kv import keep_indices
from prunelab.inference.scores import key_norm_scores, last_query_scores
from prunelab.models.loading import wrap

from tiny_models import tiny_model, tiny_tokens


def test_registered_with_their_defaults():
    assert PRESSES.make("tova") == TOVA(ratio=0.5, every=0)
    assert PRESSES.make("knorm", ratio=0.25) == KNorm(ratio=0.25)


def test_hand_made_selection():
    # TOVA: the last token always stays, then the highest scores
    sc = torch.tensor([[[0.1, 0.5, 0.05, 0.3, 0.2, 0.01]]])
    assert keep_indices(TOVA(), 6, 3, sc, 1, 1, "cpu").tolist() == [[[1, 3, 5]]]
    # KNorm: norms 5, 1, sqrt(2), 10 -> the two smallest are tokens 1 and 2, per KV head
    keys = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [1.0, 1.0], [6.0, 8.0]],
                          [[0.0, 0.5], [9.0, 0.0], [0.0, 2.0], [0.3, 0.4]]]])
    scores = key_norm_scores(keys)
    assert torch.allclose(scores, -torch.tensor([[[5.0, 1.0, 2 ** 0.5, 10.0],
                                                  [0.5, 9.0, 2.0, 0.5]]]))
    assert keep_indices(KNorm(), 4, 2, scores, 1, 2, "cpu").tolist() == [[[1, 2], [0, 3]]]


def test_tova_score_is_the_last_querys_attention_averaged_over_heads():
    """Against the plain model's eager attention weights: per block, the 9 prompt tokens
    the last query attends most (mean over all 4 query heads) and the last token; both KV
    heads drop the same tokens."""
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(1, 20)
    att = lm.model(ids, output_attentions=True).attentions
    with press(lm, TOVA(ratio=0.5)) as s:
        lm.model(ids, use_cache=True)
    assert set(s.report["keep"]) == {0, 1, 2, 3}
    for layer, idx in s.report["keep"].items():
        row = att[layer][0, :, -1].mean(0)  # [20]
        want = set(row[:19].topk(9).indices.tolist()) | {19}
        assert set(idx[0, 0].tolist()) == want and torch.equal(idx[0, 0], idx[0, 1])


def test_last_query_scores_by_hand():
    """One head pair, two keys: softmax of the scaled dot products of the last query."""
    q = torch.tensor([[[[0.0, 0.0], [1.0, 0.0]], [[0.0, 0.0], [0.0, 2.0]]]])  # [1, 2, 2, 2]
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # [1, 1, 2, 2]: one KV head
    got = last_query_scores(q, k, 1.0, None)
    e = torch.e
    head0 = torch.tensor([e / (e + 1), 1 / (e + 1)])
    head1 = torch.tensor([1 / (1 + e ** 2), e ** 2 / (1 + e ** 2)])
    assert torch.allclose(got[0, 0], (head0 + head1) / 2)


def test_knorm_keeps_the_smallest_cached_key_norms_per_kv_head():
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(1, 20)
    plain = lm.model(ids, use_cache=True).cache
    with press(lm, KNorm(ratio=0.5)) as s:
        lm.model(ids, use_cache=True)
    for layer, idx in s.report["keep"].items():
        norms = plain.layers[layer].keys[0].norm(dim=-1)  # [G, 20]
        for g in range(2):
            assert set(idx[0, g].tolist()) == set((-norms[g]).topk(10).indices.tolist())


def test_tova_every_step_keeps_a_fixed_size_state():
    """every=1: after each decode token the cache is back to the post-prefill size, the
    dropped entry being the lowest of that step's last query (averaged over heads), as
    computed by hand from the plain model on the same cache at position 20."""
    lm = wrap(tiny_model("llama"))
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 1, seed=3)
    plain = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        lm.model(ids[:, :1], cache=plain, use_cache=True)  # creates the layers
        with press(lm, TOVA(ratio=0.5, every=1)):
            cache = lm.model(ids, use_cache=True).cache
            for src, dst in zip(cache.layers, plain.layers, strict=True):
                dst.keys, dst.values = src.keys.clone(), src.values.clone()
            lm.model(nxt, cache=cache, use_cache=True)
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    assert lengths == [10] * 4 and cache.prunelab_seen == 21
    with torch.no_grad():
        att = lm.model(nxt, cache=plain, use_cache=True, position_ids=torch.tensor([[20]]),
                       output_attentions=True).attentions
    for layer in range(4):
        row = att[layer][0, :, -1].mean(0)  # [11]
        keep = sorted(set(row[:10].topk(9).indices.tolist()) | {10})
        assert torch.allclose(cache.layers[layer].keys, plain.layers[layer].keys[:, :, keep])


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "phi3", "gpt2", "gemma3_text"])
@pytest.mark.parametrize("cfg", [TOVA(ratio=0.5), KNorm(ratio=0.5)],
                         ids=lambda c: type(c).__name__)
def test_pressed_cache_matches_a_hand_built_one(arch, cfg):
    """The next tokens equal the plain model on its own cache gathered to the kept
    entries, at explicit original positions (softcapping, fused qkv, learned positions,
    sliding layers)."""
    m = tiny_model(arch)
    ids, nxt = tiny_tokens(1, 20), tiny_tokens(1, 3, seed=4)
    with torch.no_grad(), press(m, cfg) as s:
        out = m(ids, use_cache=True)
        step = m(nxt, cache=out.cache, use_cache=True)
    assert s.report["keep"] and all(i.shape[-1] == 10 for i in s.report["keep"].values())
    cache = DynamicCache(config=m.config)
    with torch.no_grad():
        m(ids, cache=cache, use_cache=True)
        for i, idx in s.report["keep"].items():
            layer = cache.layers[i]
            g = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)
        ref = m(nxt, cache=cache, use_cache=True, position_ids=torch.tensor([[20, 21, 22]]))
    assert torch.allclose(step.logits, ref.logits, atol=1e-5)
