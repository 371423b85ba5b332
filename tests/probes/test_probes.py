"""Redundancy probes: exact small cases, invariants, every architecture, outputs, resume."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from prunelab.errors import ConfigError, OutputExistsError, UnsupportedOperationError
from prunelab.eval.divergence import kl_from_logits, kl_from_logits_float64, token_nll
from prunelab.models.adapters import get_adapter
from prunelab.models.loading import wrap
from prunelab.probes import (
    ProbeContext,
    ProbeResult,
    make_config,
    options_for,
    probe_names,
    run_probes,
)
from prunelab.probes.contraction import contraction_ratio
from prunelab.probes.interval import best_interval_pairs
from prunelab.probes.similarity import block_influence, linear_cka
from prunelab.probes.swap import interchange_order, replacement_order, select_pairs
from prunelab.probes.weights import weight_redundancy

from tiny_models import ARCHS, tiny_model, tiny_tokens


def test_block_influence_hand_computed():
    h_in = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    h_out = torch.tensor([[2.0, 0.0], [1.0, 0.0]])  # cos = 1 and 0
    assert block_influence(h_in, h_out) == pytest.approx(0.5)
    assert block_influence(h_in, h_out, angular=True) == pytest.approx(0.25)


def test_cka_identity_rotation_and_scale_invariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g, dtype=torch.float64)
    y = torch.randn(200, 6, generator=g, dtype=torch.float64) + x
    q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
    assert linear_cka(x, 3.0 * x @ q) == pytest.approx(1.0, abs=1e-12)
    base = linear_cka(x, y)
    assert 0 < base < 1
    assert linear_cka(x, 0.5 * y @ q) == pytest.approx(base, abs=1e-12)


def test_kl_float64_hand_computed():
    ref = torch.log(torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64))
    other = torch.log(torch.tensor([[0.25, 0.75, 0.0]], dtype=torch.float64))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_from_logits_float64(ref, other).item() == pytest.approx(expected, rel=1e-12)
    assert kl_from_logits_float64(ref, ref).item() == 0.0


def test_float64_kl_agrees_with_float32_and_clamps_zero_probabilities():
    g = torch.Generator().manual_seed(0)
    ref, other = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    kl64 = kl_from_logits_float64(ref, other)
    assert kl64.dtype == torch.float64 and kl64.shape == (2, 5)
    assert torch.allclose(kl64, kl_from_logits(ref, other).double(), rtol=1e-5, atol=1e-7)
    # q = 0 where p > 0: clamped to 1e-40 instead of an infinite KL
    p0 = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    q0 = torch.tensor([[0.0, float("-inf")]], dtype=torch.float64)
    assert kl_from_logits_float64(p0, q0).item() == pytest.approx(
        0.5 * math.log(0.5 / 1.0) + 0.5 * math.log(0.5 / 1e-40), rel=1e-12)


def test_context_nll_and_divergence_use_the_shared_measures(llama_ctx):
    lm, ctx = llama_ctx
    ids = ctx.input_ids
    with torch.no_grad():
        dense = lm.model(input_ids=ids, use_cache=False).logits
    full = ctx.run_stack(0, range(ctx.num_blocks))
    assert ctx.nll(full) == pytest.approx(token_nll(dense, ids).double().mean().item(),
                                          rel=1e-6)
    without_1 = copy.deepcopy(lm.model)
    get_adapter(without_1).delete_blocks([1])
    with torch.no_grad():
        logits = without_1(input_ids=ids, use_cache=False).logits
    last, allpos = ctx.divergence(ctx.run_stack(1, range(2, ctx.num_blocks)))
    assert last == pytest.approx(kl_from_logits_float64(dense[:, -1], logits[:, -1]).mean()
                                 .item(), rel=1e-4, abs=1e-9)
    assert allpos == pytest.approx(kl_from_logits(dense, logits).mean().item(), rel=1e-4,
                                   abs=1e-9)


def test_reference_logits_are_kept_from_their_third_use(llama_ctx):
    """One or two divergence calls (depth pruning before and after recovery) hold no
    reference logits; later calls keep and reuse them; the same float on every call."""
    _lm, ctx = llama_ctx
    ctx._ref_cache.clear()
    ctx._ref_uses.clear()
    ctx._ref_bytes = 0
    stack = ctx.run_stack(1, range(2, ctx.num_blocks))
    values = [ctx.divergence(stack), ctx.divergence(stack)]
    assert ctx._ref_cache == {} and ctx._ref_bytes == 0
    values.append(ctx.divergence(stack))
    batches = len(ctx.runner.batches)
    assert sorted(ctx._ref_cache) == list(range(batches)) and ctx._ref_bytes > 0
    values.append(ctx.divergence(stack))
    assert values[0] == values[1] == values[2] == values[3]


def test_contraction_ratio_hand_computed():
    eps = torch.tensor([[3.0, 4.0]])
    assert contraction_ratio(torch.zeros(1, 2), torch.tensor([[0.0, 10.0]]), eps).item() == 2.0


def test_orders_and_pair_selection():
    assert interchange_order(6, 1, 3) == [3, 2, 1, 4, 5]
    assert interchange_order(6, 2, 2) == [2, 3, 4, 5]
    assert replacement_order(6, 1, 4) == [4, 2, 3, 4, 5]
    assert select_pairs(4, 1, ()) == [(0, 1), (1, 2), (2, 3)]
    assert len(select_pairs(5, None, ())) == 10
    assert select_pairs(5, None, [(3, 1), (1, 3)]) == [(1, 3)]
    with pytest.raises(ConfigError):
        select_pairs(4, None, [(2, 2)])


def test_interval_pairs_search_hand_made():
    costs = {(0, 1): 0.5, (1, 2): 0.1, (2, 3): 0.2, (3, 4): 0.05, (1, 3): 0.25}
    best = {b["removed_blocks"]: b for b in best_interval_pairs(costs, 4)}
    assert best[2]["intervals"] == [[1, 2], [3, 4]]  # 0.15; touching pairs are excluded
    assert best[2]["predicted_cost"] == pytest.approx(0.15)
    assert 3 not in best  # (1,3) touches both (0,1) and (3,4): no disjoint pair of 3 blocks


def test_weight_redundancy_hand_made():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])
    sim, scale, value = weight_redundancy([a, a, b], [a, a, b])
    assert sim[0, 1].item() == pytest.approx(1.0) and sim[0, 2].item() == pytest.approx(0.0)
    # norms 1, 1, 2 -> mean 4/3 -> scales 0.75, 0.75, 1.5
    assert scale.tolist() == pytest.approx([0.75, 0.75, 1.5])
    assert value.tolist() == pytest.approx([0.0, 0.0, 1.5])


@pytest.fixture(scope="module")
def llama_ctx():
    lm = wrap(tiny_model("llama"))
    return lm, ProbeContext(lm, tiny_tokens(4, 12), batch_size=2)


def test_swap_of_a_block_with_itself_is_zero(llama_ctx):
    _, ctx = llama_ctx
    n = ctx.num_blocks
    for i in range(n):
        for order in (interchange_order(n, i, i), replacement_order(n, i, i)):
            last, allpos = ctx.divergence(ctx.run_stack(i, order))
            assert last == 0.0 and abs(allpos) < 1e-7


def manual_last_kl(model, ids, dense_logits):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return kl_from_logits_float64(dense_logits[:, -1], logits[:, -1]).mean().item()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_interchange_equals_manually_reordered_model(arch):
    model = tiny_model(arch)
    ids = tiny_tokens(4, 16)
    with torch.no_grad():
        dense = model(input_ids=ids, use_cache=False).logits
    res = run_probes(wrap(model), ["interchange"], ids, batch_size=2, pairs=[(0, 2), (1, 3)])
    for i, j in [(0, 2), (1, 3)]:
        manual = copy.deepcopy(model)
        order = list(range(4))
        order[i], order[j] = j, i
        get_adapter(manual).reorder_blocks(order)
        got = next(s for s in res["interchange"].scores if s["layers"] == [i, j])
        assert got["value"] == pytest.approx(manual_last_kl(manual, ids, dense), rel=1e-4,
                                             abs=1e-9)
        assert got["value"] > 0


def identity_block_model(arch="llama", block=1):
    model = tiny_model(arch)
    ad = get_adapter(model)
    with torch.no_grad():
        ad.attn_projections(block)["o"].weight.zero_()
        ad.mlp_projections(block)["down"].weight.zero_()
    return model


def test_identity_block_rho_one_and_leave_one_out_zero():
    lm = wrap(identity_block_model())
    res = run_probes(lm, ["contraction", "leave-one-out", "block-influence"],
                     tiny_tokens(4, 12), batch_size=2)
    rho = res["contraction"].scores[1]
    assert rho["rho"] == pytest.approx(1.0, abs=1e-5) and rho["value"] < 1e-5  # float32
    assert res["leave-one-out"].scores[1]["value"] == 0.0
    assert res["block-influence"].scores[1]["value"] == pytest.approx(0.0, abs=1e-12)
    assert res["contraction"].ranking()[0] == 1 and res["leave-one-out"].ranking()[0] == 1
    assert all(s["value"] > 0 for i, s in enumerate(res["leave-one-out"].scores) if i != 1)


DECODER_ONLY = ("dla", "induction", "gradient-flow")  # next-token logit / LM loss


@pytest.mark.parametrize("arch", ARCHS)
def test_every_probe_runs_on_every_architecture(arch):
    lm = wrap(tiny_model(arch))
    names = [n for n in probe_names() if not (lm.is_encoder and n in DECODER_ONLY)]
    short = dict(length=4, sequences=2) if "induction" in names else {}
    res = run_probes(lm, names, tiny_tokens(4, 12), batch_size=2, window=1, span=2,
                     max_length=2, **short)
    assert set(res) == set(names) and len(names) >= len(probe_names()) - len(DECODER_ONLY)
    for name in set(probe_names()) - set(names):
        with pytest.raises(UnsupportedOperationError) as err:  # one line, no traceback
            run_probes(lm, [name], tiny_tokens(4, 12), batch_size=2)
        assert "\n" not in str(err.value)
    for name, r in res.items():
        assert r.scores, name
        for s in r.scores:
            assert math.isfinite(s["value"]), (name, s)
        if name in ("interchange", "replacement", "leave-one-out", "interval"):
            assert all(s["value"] >= 0 for s in r.scores)
    assert len(res["interchange"].scores) == 3
    assert res["interchange"].meta["block_evaluations"] == 4 + 3 + 2
    assert res["replacement"].meta["block_evaluations"] == (4 + 3) + (3 + 2) + (2 + 1)
    assert res["weight-redundancy"].meta["cache_block_evaluations"] == 0.0


def test_configs_validate():
    with pytest.raises(ConfigError, match="window"):
        make_config("interchange", window=0)
    with pytest.raises(ConfigError, match="scale"):
        make_config("contraction", scale=-1.0)
    with pytest.raises(ConfigError, match="unknown probe"):
        make_config("nope")
    with pytest.raises(ConfigError, match=r"'windw'; valid options: window, pairs"):
        make_config("interchange", windw=1)  # once silently all pairs
    with pytest.raises(ConfigError, match="'span'"):
        make_config("interchange", window=2, span=3)
    # routing (depth pruning's fixed options) keeps only what the probe takes
    assert options_for("interchange", window=2, span=3, seed=None) == {"window": 2}
    assert make_config("contraction", **options_for("contraction", window=1, seed=4)).seed == 4


def test_outputs_resume_and_overwrite(tmp_path):
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(4, 12)
    out = tmp_path / "probes"
    full = run_probes(lm, ["interchange", "replacement", "block-influence"], ids,
                      batch_size=2, out_dir=out, window=1)
    for name in ("interchange", "replacement", "block-influence"):
        d = json.loads((out / f"{name}.json").read_text())
        assert d["probe"] == name and d["scores"] and "block_evaluations" in d
        assert (out / f"{name}.csv").read_text().startswith("layers,")
        assert (out / f"{name}.png").stat().st_size > 1000
    assert (out / "swap_heatmaps.png").is_file() and (out / "summary.md").is_file()
    with pytest.raises(OutputExistsError):
        run_probes(lm, ["interchange"], ids, batch_size=2, out_dir=out, window=1)
    # resume: a partial file with one pair done (marked by a sentinel value) is reused
    cfg = full["interchange"].config
    sentinel = {"layers": [0, 1], "value": 123.0, "value_all_positions": 1.0, "class": "x"}
    # (the partial carries the run's fingerprint, which the finished result records)
    partial = {"config": cfg, "fingerprint": full["interchange"].meta["fingerprint"],
               "scores": [sentinel]}
    (out / "interchange.partial.json").write_text(json.dumps(partial))
    again = run_probes(lm, ["interchange"], ids, batch_size=2, out_dir=out, window=1,
                       overwrite=True)["interchange"]
    assert again.scores[0]["value"] == 123.0
    assert again.scores[1:] == full["interchange"].scores[1:]
    assert again.meta["block_evaluations"] == 3 + 2
    assert not (out / "interchange.partial.json").exists()
    loaded = ProbeResult.load(out / "interchange.json")
    assert loaded.ranking() == again.ranking()
    frame = loaded.to_frame()
    assert len(frame) == 3 and list(frame["layers"]) == [(0, 1), (1, 2), (2, 3)]
    fig = loaded.plot(tmp_path / "again.png")
    assert fig.axes and (tmp_path / "again.png").stat().st_size > 1000
