"""Elastic ranking: the budget threshold, soft vs hard masks, cutting any size through the
width machinery, elastic checkpoints and export."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import prunelab
from prunelab.data.batches import TokenBatches
from prunelab.errors import ConfigError
from prunelab.eval.divergence import kl_from_logits
from prunelab.models.loading import wrap
from prunelab.pruning.base import METHODS
from prunelab.pruning.width import Width
from prunelab.pruning.width.elastic import (
    ElasticRanking,
    cut,
    elastic,
    fit_ranking,
    hard_keep,
    masked,
    model_units,
    soft_keep,
    threshold,
)
from prunelab.pruning.width.elastic.fit import ranking_dict
from prunelab.pruning.width.elastic.ranking import initial_scores, removed_count
from prunelab.pruning.width.scoring import ElasticScore
from prunelab.registry import to_dict
from prunelab.workflow.export import export

from tiny_models import char_tokenizer, save_tiny_checkpoint, tiny_model, tiny_tokens


def _calib(n=2, t=8):
    return TokenBatches(input_ids=tiny_tokens(n, t), spec="tiny", seqlen=t, samples=n, seed=0,
                        mode="calib", total_windows=n, sha256="0")


def _logits(lm, ids):
    with torch.no_grad():
        return lm.model(input_ids=ids, use_cache=False).logits


def test_threshold_hand_case_and_budget_cover():
    s = torch.tensor([3.0, 1.0, 2.0, 4.0])
    c = torch.tensor([1.0, 1.0, 2.0, 1.0])
    # budget 0.4 of 5 = 2: unit 1 (cum 1) is short, unit 2 (cum 3) covers it
    assert removed_count(s, c, 0.4) == 2
    assert float(threshold(s, c, 0.4)) == 2.5
    assert hard_keep(s, c, 0.4).tolist() == [True, False, False, True]
    assert removed_count(s, c, 0.0) == 0 and hard_keep(s, c, 0.0).all()
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        s = torch.randn(40, generator=g)
        c = torch.randint(1, 9, (40,), generator=g).double()
        b = float(torch.rand(1, generator=g)) * 0.9
        keep = hard_keep(s, c, b)
        gone = c[~keep].sum()
        assert gone >= b * c.sum() - 1e-9  # the budget is met ...
        last = s[~keep].max()  # ... and not by more than the last unit taken
        assert gone - c[~keep][s[~keep] == last].sum() < b * c.sum()
        assert (s[~keep].max() if (~keep).any() else -1e9) < s[keep].min()


def test_soft_mask_at_zero_temperature_is_the_hard_mask():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(64, generator=g) * 3 + 1
    c = torch.randint(1, 5, (64,), generator=g).double()
    for b in (0.1, 0.35, 0.6):
        soft = soft_keep(s, c, b, 1e-6)
        assert torch.equal(soft, hard_keep(s, c, b).float())
        warm = soft_keep(s, c, b, 1.0)
        assert ((warm > 0) & (warm < 1)).all()  # soft at a high temperature
    # the mask is differentiable in the scores, through the threshold too
    x = s.clone().requires_grad_(True)
    soft_keep(x, c, 0.3, 0.5).sum().backward()
    assert x.grad.abs().sum() > 0


def test_soft_model_mask_at_zero_temperature_matches_hard_mask_logits():
    lm = wrap(tiny_model("llama"))
    units = model_units(lm.adapter)
    ids = tiny_tokens(2, 10, seed=3)
    s = torch.randn(units.n, generator=torch.Generator().manual_seed(2))
    with masked(lm, units, soft_keep(s, units.costs, 0.4, 1e-6)):
        soft = _logits(lm, ids)
    with masked(lm, units, hard_keep(s, units.costs, 0.4).float()):
        hard = _logits(lm, ids)
    with masked(lm, units, torch.ones(units.n)):
        ones = _logits(lm, ids)
    torch.testing.assert_close(soft, hard, rtol=0, atol=0)
    torch.testing.assert_close(ones, _logits(lm, ids), rtol=0, atol=0)
    assert not torch.allclose(hard, ones)
    assert not lm.model.model.layers[0].self_attn.o_proj._forward_pre_hooks  # removed


def _with_ranking(arch="llama", heads_high=True, seed=0):
    lm = wrap(tiny_model(arch), char_tokenizer())
    units = model_units(lm.adapter)
    s = torch.randn(units.n, generator=torch.Generator().manual_seed(seed))
    if heads_high:  # keep heads out of small budgets: only channels compete
        for hs, _ in units.spans():
            s[hs] += 10
    lm.elastic_ranking = ranking_dict(lm.adapter, units, s, {})
    return lm, units, s


def test_cut_equals_hard_mask_and_prune_width_with_elastic_score():
    lm, units, s = _with_ranking()
    ids = tiny_tokens(2, 10, seed=4)
    small = elastic(lm, round_to=1).at(0.7)  # removes 30% of the units' parameters
    keep = hard_keep(s, units.costs, 0.3)
    with masked(lm, units, keep.float()):
        ref = _logits(lm, ids)
    torch.testing.assert_close(_logits(small, ids), ref, rtol=1e-5, atol=1e-5)
    widths = [small.adapter.ffn_width(i) for i in range(4)]
    assert sum(widths) == int(keep[units.costs == units.costs.min()].sum())
    # the same size through prune width --score elastic
    other = wrap(copy.deepcopy(lm.model), char_tokenizer())
    other.elastic_ranking = lm.elastic_ranking
    prunelab.prune(other, Width(unit="joint", score="elastic", ratio=0.3, allocation="global",
                                bias_compensation=False, round_to=1), _calib())
    a, b = small.model.state_dict(), other.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    # the source model is untouched; keep 1.0 reproduces the dense logits
    assert lm.adapter.ffn_width(0) == 48
    torch.testing.assert_close(_logits(elastic(lm).at(1.0), ids), _logits(lm, ids),
                               rtol=0, atol=0)


def test_cut_uniform_and_heads_by_ranking():
    lm, units, s = _with_ranking(heads_high=False, seed=5)
    small = elastic(lm, allocation="uniform", round_to=8).at(0.5)
    assert all(small.adapter.ffn_width(i) == 24 for i in range(4))
    assert all(small.adapter.head_geometry(i).num_kv_heads == 1 for i in range(4))
    for i, d in enumerate(units.split(s)):  # each block keeps its best-ranked KV group
        kept = small.history[-2]  # heads cut first
        assert kept["operation"] == "prune-width"
        o_small = small.adapter.attn_projections(i)["o"].weight
        o = lm.adapter.attn_projections(i)["o"].weight
        g = int(torch.argmax(d["heads"]))
        torch.testing.assert_close(o_small, o[:, g * 16:(g + 1) * 16], rtol=0, atol=0)


def test_fit_improves_on_the_initial_ranking_and_errors():
    lm = wrap(tiny_model("llama"), char_tokenizer())
    ids = tiny_tokens(4, 16, seed=7)
    units = model_units(lm.adapter)
    ranking = fit_ranking(lm, ids, steps=30, lr=0.1, budgets=(0.2, 0.5), batch_size=4)
    dense = _logits(lm, ids)

    def kl_at(scores, b):
        with masked(lm, units, hard_keep(scores, units.costs, b).float()):
            return float(kl_from_logits(dense, _logits(lm, ids)).mean())
    fitted = torch.cat([torch.tensor(d["heads"] + d["ffn"]) for d in ranking["blocks"]])
    start = initial_scores(lm.adapter, units)
    assert sum(kl_at(fitted, b) for b in (0.25, 0.4)) < sum(kl_at(start, b) for b in (0.25, 0.4))
    assert all(p.requires_grad for p in lm.model.parameters())  # restored
    assert len(ranking["blocks"]) == 4 and len(ranking["blocks"][0]["ffn"]) == 48
    lm.elastic_ranking = ranking
    small = elastic(lm).at(0.6)
    small.elastic_ranking = ranking  # stale: fitted on the dense shapes
    with pytest.raises(ConfigError, match="other shapes"):
        cut(small, 0.5)
    with pytest.raises(ConfigError):
        ElasticRanking(budget_min=0.7, budget_max=0.2)
    cfg = ElasticRanking(budget_min=0.2, steps=5)
    assert METHODS.from_dict(to_dict(cfg)) == cfg


def test_elastic_checkpoint_export_and_encoder(tmp_path):
    src = save_tiny_checkpoint("llama", tmp_path / "dense")
    lm = prunelab.load(str(src))
    report = prunelab.prune(lm, ElasticRanking(steps=3), _calib(), batch_size=2)
    assert report["elastic_checkpoint"] and report["units"] == 4 * (2 + 48)
    prunelab.save(lm, tmp_path / "elastic")
    saved = json.loads((tmp_path / "elastic" / "elastic.json").read_text())
    man = json.loads((tmp_path / "elastic" / "manifest.json").read_text())
    assert man["operations"][-1]["ranking"]["blocks"] == saved["blocks"]
    export(str(tmp_path / "elastic"), 0.6, tmp_path / "small")
    small = prunelab.load(str(tmp_path / "small"), trust_remote_code=True)
    mem = elastic(prunelab.load(str(tmp_path / "elastic"))).at(0.6)
    ids = tiny_tokens(2, 10, seed=9)
    torch.testing.assert_close(_logits(small, ids), _logits(mem, ids), rtol=1e-5, atol=1e-5)
    assert small.model.num_parameters() < lm.model.num_parameters()
    export(str(tmp_path / "elastic"), 0.5, tmp_path / "plain", allocation="uniform")
    plain = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert plain["loads_with"] == "plain transformers (no remote code)"
    assert plain["elastic_export"]["keep"] == 0.5
    assert not (tmp_path / "plain" / "elastic.json").exists()
    # an encoder: the 1 - cos objective, then a cut
    enc = wrap(tiny_model("bert"), char_tokenizer())
    enc.elastic_ranking = fit_ranking(enc, tiny_tokens(2, 8), steps=2, batch_size=2)
    assert elastic(enc).at(0.5).adapter.ffn_width(0) < 48


def test_width_score_fits_a_ranking_when_none_is_found(tmp_path):
    lm = wrap(tiny_model("qwen2"), char_tokenizer())
    cfg = Width(unit="ffn", score=ElasticScore(steps=3), ratio=0.25, allocation="global",
                round_to=1)
    report = prunelab.prune(lm, cfg, _calib(), batch_size=2)
    assert sum(lm.adapter.ffn_width(i) for i in range(4)) == 4 * 48 - 48
    assert report["removed_params"] > 0
    # a model pruned after its ranking was fitted writes no stale elastic.json
    lm.elastic_ranking = {"format": "prunelab-elastic/1", "blocks": [{}] * 4,
                          "heads_per_block": [2] * 4, "ffn_per_block": [48] * 4}
    prunelab.save(lm, tmp_path / "pruned")
    assert not (tmp_path / "pruned" / "elastic.json").exists()


def test_uncached_references_give_the_same_ranking():
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(4, 16, seed=7)
    a = fit_ranking(lm, ids, steps=4, batch_size=2)
    b = fit_ranking(lm, ids, steps=4, batch_size=2, cache_bytes=0)
    assert a["blocks"] == b["blocks"]
