"""Head attribution probes (issue 19, part 3): dla, head-ablation, stable-rank, induction,
the head correlations of the summary and the stable-rank width score, each checked against
an independent computation on tiny models."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers as tf
from torch import nn

from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.divergence import kl_from_logits, kl_from_logits_float64
from prunelab.models.adapters import get_adapter
from prunelab.models.loading import wrap
from prunelab.probes import ProbeResult, make_config, run_probes
from prunelab.probes.attribution import norm_map
from prunelab.probes.head_summary import (
    ablation_kl_result,
    head_correlations,
    head_summary_lines,
    head_values,
)
from prunelab.probes.head_weights import stable_rank
from prunelab.probes.heads import (
    attention_weights,
    induction_scores,
    repeat_positions,
    repeated_sequences,
)
from prunelab.probes.plots import head_array, plot_result
from prunelab.probes.summary import write_summary
from prunelab.pruning.width import Width
from prunelab.pruning.width.execute import prune_width

from tiny_models import tiny_config, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)


def heads_of(result: ProbeResult) -> dict[tuple[int, int], dict]:
    return {(s["layers"][0], s["head"]): s for s in result.scores if "head" in s}


# ---------------------------------------------------------------- dla
def manual_dla(model, ids):
    """DLA of llama written out plainly with forward hooks: per-head, MLP and embedding
    mean contributions and the mean logit of the correct next token."""
    ad = get_adapter(model)
    seen = {}
    hooks = [ad.embeddings().register_forward_hook(lambda m, a, o: seen.__setitem__("emb", o)),
             ad.final_norm().register_forward_pre_hook(
                 lambda m, a: seen.__setitem__("x", a[0]))]
    for i in range(ad.num_blocks):
        hooks.append(ad.attn_projections(i)["o"].register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(("o", i), a[0])))
        hooks.append(ad.mlp(i).register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(("mlp", i), o)))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    for h in hooks:
        h.remove()
    y = ids[:, 1:]
    x = seen["x"][:, :-1].double()
    norm = ad.final_norm()
    rms = (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    gain = norm.weight.detach().double()
    u = model.lm_head.weight.detach().double()[y] * gain / rms  # [B, T-1, d]
    geo = ad.head_geometry(0)
    out = {"emb": float((seen["emb"][:, :-1].double() * u).sum(-1).mean()),
           "logit": float(logits.double()[:, :-1].gather(-1, y[..., None]).mean())}
    for i in range(ad.num_blocks):
        w = ad.attn_projections(i)["o"].weight.detach().double()
        o_in = seen[("o", i)][:, :-1].double()
        for h in range(geo.num_heads):
            sl = slice(h * geo.head_dim, (h + 1) * geo.head_dim)
            out[(i, h)] = float(((o_in[..., sl] @ w[:, sl].t()) * u).sum(-1).mean())
        out[("mlp", i)] = float((seen[("mlp", i)][:, :-1].double() * u).sum(-1).mean())
    return out


def test_dla_equals_a_hand_written_attribution_and_sums_to_the_logit():
    model = tiny_model("llama")
    res = run_probes(wrap(model), ["dla"], IDS, batch_size=2)["dla"]
    ref = manual_dla(model, IDS)
    heads = heads_of(res)
    assert len(heads) == 4 * 4 and res.kind == "head"
    for (i, h), s in heads.items():
        assert s["value"] == pytest.approx(ref[(i, h)], rel=1e-6, abs=1e-9)
    mlp = {s["layers"][0]: s["value"] for s in res.scores if s.get("sublayer") == "mlp"}
    for i in range(4):
        assert mlp[i] == pytest.approx(ref[("mlp", i)], rel=1e-5, abs=1e-8)
    assert res.meta["embedding"] == pytest.approx(ref["emb"], rel=1e-6)
    # embedding + every head + MLP (llama: no biases) = the model's mean logit, exactly
    total = ref["emb"] + sum(ref[(i, h)] for i, h in heads) + sum(mlp.values())
    assert total == pytest.approx(ref["logit"], rel=1e-6, abs=1e-8)
    assert res.meta["sum_of_terms"] == pytest.approx(ref["logit"], rel=1e-6, abs=1e-8)
    assert res.meta["max_abs_error"] < 1e-6 and res.meta["positions"] == 4 * 11
    assert res.meta["constant"] == 0.0
    # the per-block view sums the heads; attention = heads + o_proj bias (none here)
    attn = {s["layers"][0]: s["value"] for s in res.scores if s.get("sublayer") == "attention"}
    assert res.layer_values() == pytest.approx(
        [sum(ref[(i, h)] for h in range(4)) for i in range(4)], rel=1e-6)
    assert attn[2] == pytest.approx(res.layer_values()[2], rel=1e-9)


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt2", "gpt_neox", "opt", "phi3", "qwen2"])
def test_dla_terms_sum_to_the_logit_with_biases_and_post_norms(arch):
    """Gemma 3 (post-attention norm), GPT-2 (Conv1D, biases, LayerNorm), GPT-NeoX (parallel
    residual), OPT (biases), Phi-3 (fused qkv), Qwen2 (qkv biases): every position's terms
    add up to the model's logit before soft-capping."""
    model = tiny_model(arch)
    res = run_probes(wrap(model), ["dla"], IDS, batch_size=2)["dla"]
    with torch.no_grad():
        hidden = model.base_model(input_ids=IDS, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden).double()  # pre soft-capping
    mean_logit = float(logits[:, :-1].gather(-1, IDS[:, 1:, None]).mean())
    assert res.meta["logit"] == pytest.approx(mean_logit, rel=1e-5, abs=1e-8)
    assert res.meta["max_abs_error"] < 1e-5
    parts = sum(s["value"] for s in res.scores if "sublayer" in s)
    assert res.meta["embedding"] + res.meta["constant"] + parts == pytest.approx(
        mean_logit, rel=1e-5, abs=1e-8)
    attn = [s for s in res.scores if s.get("sublayer") == "attention"]
    sums = res.layer_values()
    for s in attn:  # attention = its heads + the o_proj bias term
        assert s["value"] == pytest.approx(sums[s["layers"][0]] + s["bias"], rel=1e-6,
                                           abs=1e-10)
    if arch in ("gpt2", "opt"):
        assert any(abs(s["bias"]) > 0 for s in attn) and res.meta["constant"] != 0


def test_norm_map_reproduces_layer_and_rms_norms_and_refuses_others():
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    ln = nn.LayerNorm(6)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    gemma = tf.models.gemma3.modeling_gemma3.Gemma3RMSNorm(6, eps=1e-6)
    with torch.no_grad():
        gemma.weight.normal_()  # applied as 1 + w
    for norm in (ln, gemma):
        nm = norm_map(norm, 6)
        assert torch.allclose(nm(x), norm(x).double(), atol=1e-6)
    assert norm_map(gemma, 6).gain == pytest.approx((1 + gemma.weight.double()).tolist(),
                                                    rel=1e-6)

    class Scaled(nn.Module):  # has an eps, but is no RMSNorm
        eps = 1e-6

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(6))

        def forward(self, h):
            return h * self.weight

    with pytest.raises(UnsupportedOperationError, match="linearise"):
        norm_map(Scaled(), 6)


def test_dla_refuses_encoders():
    with pytest.raises(UnsupportedOperationError, match="dla needs a causal LM head"):
        run_probes(wrap(tiny_model("bert")), ["dla"], IDS, batch_size=2)


# ---------------------------------------------------------------- head-ablation
def forward_logits(model, ids, pre_hook=None, module=None):
    handle = module.register_forward_pre_hook(pre_hook) if pre_hook is not None else None
    try:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits
    finally:
        if handle is not None:
            handle.remove()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_head_ablation_equals_a_full_forward_with_the_head_zeroed(arch):
    model = tiny_model(arch)
    before = copy.deepcopy(model.state_dict())
    res = run_probes(wrap(model), ["head-ablation"], IDS, batch_size=2)["head-ablation"]
    for k, v in model.state_dict().items():  # weights restored exactly
        assert torch.equal(v, before[k]), k
    dense = forward_logits(model, IDS)
    ad = get_adapter(model)
    hd = ad.head_geometry(0).head_dim
    heads = heads_of(res)
    assert len(heads) == 16
    for i, h in [(0, 1), (2, 3), (3, 0)]:
        manual = copy.deepcopy(model)
        o = get_adapter(manual).attn_projections(i)["o"]
        with torch.no_grad():
            if arch == "gpt2":  # Conv1D: weight [in, out]
                o.weight[h * hd:(h + 1) * hd] = 0
            else:
                o.weight[:, h * hd:(h + 1) * hd] = 0
        got = forward_logits(manual, IDS)
        s = heads[(i, h)]
        assert s["value"] == pytest.approx(float(kl_from_logits(dense, got).double().mean()),
                                           rel=1e-4, abs=1e-9)
        assert s["value_last_position"] == pytest.approx(
            float(kl_from_logits_float64(dense[:, -1], got[:, -1]).mean()), rel=1e-4, abs=1e-9)
        assert s["value"] > 0


def test_mean_ablation_replaces_the_head_input_by_its_calibration_mean():
    model = tiny_model("llama")  # o_proj without bias: a temporary one carries the mean
    res = run_probes(wrap(model), ["head-ablation"], IDS, batch_size=2,
                     ablation="mean")["head-ablation"]
    ad = get_adapter(model)
    assert all(ad.attn_projections(i)["o"].bias is None for i in range(4))
    dense = forward_logits(model, IDS)
    i, h, hd = 1, 2, 8
    o = ad.attn_projections(i)["o"]
    seen = []
    forward_logits(model, IDS, lambda m, a: seen.append(a[0]), o)
    mean = seen[0][..., h * hd:(h + 1) * hd].double().reshape(-1, hd).mean(0)

    def replace(_m, args):
        x = args[0].clone()
        x[..., h * hd:(h + 1) * hd] = mean.to(x.dtype)
        return (x,)

    got = forward_logits(model, IDS, replace, o)
    value = heads_of(res)[(i, h)]["value"]
    assert value == pytest.approx(float(kl_from_logits(dense, got).double().mean()), rel=1e-4)
    zero = run_probes(wrap(model), ["head-ablation"], IDS, batch_size=2)["head-ablation"]
    assert value != pytest.approx(heads_of(zero)[(i, h)]["value"], rel=1e-3)
    with pytest.raises(ConfigError, match="ablation"):
        make_config("head-ablation", ablation="half")


def test_ablation_kl_width_score_is_zero_head_ablation():
    lm = wrap(tiny_model("qwen2"))
    res = run_probes(lm, ["head-ablation"], IDS, batch_size=2)["head-ablation"]
    akl = ablation_kl_result(lm, IDS, batch_size=2)
    a, b = head_values(res), head_values(akl)
    assert a.keys() == b.keys() and len(a) == 16
    for k in a:  # the probe runs on float32 cached boundaries, the width score end to end:
        # a KL of ~1e-3 between two float32 paths agrees to ~1e-4 relative (1.06e-4 seen)
        assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-10)
    rho = head_correlations({"head-ablation": res, "ablation-kl": akl})[0]
    assert rho["spearman"] == pytest.approx(1.0) and rho["n"] == 16


# ---------------------------------------------------------------- stable-rank
def svd_stable_rank(m: torch.Tensor) -> float:
    s = torch.linalg.svd(m.double()).S
    return float((s ** 2).sum() / s[0] ** 2)


def split_weights(model, arch: str, i: int):
    """(W_q, W_k, W_v, W_o) as [out, in], read directly from the modules."""
    blk = get_adapter(model).block(i)
    if arch == "gpt2":  # Conv1D c_attn: [d, 3d] = [q | k | v] columns
        w = blk.attn.c_attn.weight.t()
        d = w.shape[1]
        return w[:d], w[d:2 * d], w[2 * d:], blk.attn.c_proj.weight.t()
    if arch == "phi3":  # qkv_proj rows: all queries, then the keys, then the values
        w, nq, nkv = blk.self_attn.qkv_proj.weight, 4 * 8, 2 * 8
        return w[:nq], w[nq:nq + nkv], w[nq + nkv:], blk.self_attn.o_proj.weight
    a = blk.self_attn
    return a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt2"])
def test_stable_rank_equals_a_direct_svd(arch):
    model = tiny_model(arch)
    res = run_probes(wrap(model), ["stable-rank"], IDS, batch_size=2)["stable-rank"]
    assert res.meta["cache_block_evaluations"] == 0.0 and res.meta["block_evaluations"] == 0
    geo = get_adapter(model).head_geometry(0)
    hd, gs = geo.head_dim, geo.group_size
    heads = heads_of(res)
    for i in range(4):
        wq, wk, wv, wo = (w.detach().double() for w in split_weights(model, arch, i))
        for h in range(geo.num_heads):
            g = h // gs
            qk = wq[h * hd:(h + 1) * hd].t() @ wk[g * hd:(g + 1) * hd]  # d x d
            ov = wv[g * hd:(g + 1) * hd].t() @ wo[:, h * hd:(h + 1) * hd].t()
            s = heads[(i, h)]
            assert s["qk"] == pytest.approx(svd_stable_rank(qk), rel=1e-9)
            assert s["ov"] == pytest.approx(svd_stable_rank(ov), rel=1e-9)
            assert s["value"] == pytest.approx(math.sqrt(s["qk"] * s["ov"]), rel=1e-12)
            assert s["kv_head"] == g and 1.0 <= s["qk"] <= hd


def test_stable_rank_hand_made():
    assert stable_rank(torch.diag(torch.tensor([3.0, 4.0]))) == pytest.approx(25 / 16)
    assert stable_rank(torch.outer(torch.arange(1.0, 4.0), torch.ones(5))) == pytest.approx(1)
    assert stable_rank(torch.eye(4)) == pytest.approx(4.0)
    assert stable_rank(torch.zeros(3, 3)) == 0.0


@pytest.mark.parametrize("heads", ["query", "groups"])
def test_width_stable_rank_removes_the_lowest_heads(heads):
    model = tiny_model("llama")
    sr = head_values(run_probes(wrap(model), ["stable-rank"], IDS,
                                batch_size=2)["stable-rank"])
    lm = wrap(model)
    rep = prune_width(lm, Width(unit="heads", heads=heads, score="stable-rank", ratio=0.5),
                      IDS, batch_size=2)
    assert rep["score"] == "stable-rank" and rep["block_evaluations"] == 0.0  # weight-only
    for blk in rep["blocks"]:
        i = blk["block"]
        if heads == "query":  # every KV group keeps its higher-scored query head
            want = [[int(sr[(i, 2 * g + 1)] > sr[(i, 2 * g)])] for g in range(2)]
            assert blk["kept_query_heads"] == want
        else:  # the KV group with the higher mean of its query heads' scores
            means = [(sr[(i, 2 * g)] + sr[(i, 2 * g + 1)]) / 2 for g in range(2)]
            assert blk["kept_groups"] == [int(means[1] > means[0])]
    assert lm.adapter.head_geometry(0).num_heads == 2


# ---------------------------------------------------------------- induction
def test_repeated_sequences_are_seeded_halves():
    a = repeated_sequences(50, 7, 3, seed=4, bos=1)
    assert a.shape == (3, 15) and (a[:, 0] == 1).all()
    assert torch.equal(a[:, 1:8], a[:, 8:])
    assert all(len(set(row[1:8].tolist())) == 7 for row in a)  # distinct within a half
    assert torch.equal(a, repeated_sequences(50, 7, 3, seed=4, bos=1))
    assert not torch.equal(a, repeated_sequences(50, 7, 3, seed=5, bos=1))
    assert repeated_sequences(5, 9, 2, seed=0).shape == (2, 18)  # repeats allowed


def test_induction_scores_hand_made():
    length, offset, t = 4, 1, 9
    attn = torch.zeros(2, 3, t, t)
    for q in range(offset + length, offset + 2 * length):
        attn[:, 0, q, q - length + 1] = 1.0  # induction head
        attn[:, 1, q, q - length] = 1.0  # duplicate-token head
        attn[:, 2, q, q] = 1.0  # attends to itself
    ind, dup = induction_scores(attn, length, offset)
    assert ind.tolist() == [1.0, 0.0, 0.0] and dup.tolist() == [0.0, 1.0, 0.0]
    attn[0, 0] = 0  # half the batch loses it
    assert induction_scores(attn, length, offset)[0][0] == 0.5
    assert repeat_positions(length, offset).tolist() == [5, 6, 7]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "phi3"])
def test_attention_weights_equal_the_eager_models_attentions(arch):
    eager = tiny_model(arch)
    torch.manual_seed(0)
    sdpa = tf.AutoModelForCausalLM.from_config(tiny_config(arch),
                                               attn_implementation="sdpa").eval()
    sdpa.load_state_dict(eager.state_dict())
    ids = tiny_tokens(2, 10)
    got = attention_weights(wrap(sdpa), ids)
    assert sdpa.config._attn_implementation == "sdpa"  # switched back
    with torch.no_grad():
        want = eager(input_ids=ids, use_cache=False, output_attentions=True).attentions
    assert len(got) == 4
    for g, w in zip(got, want, strict=True):
        assert g.shape == (2, 4, 10, 10)
        assert torch.allclose(g, w, atol=1e-6)
        assert torch.allclose(g.sum(-1), torch.ones(2, 4, 10), atol=1e-5)


def test_induction_probe_scores_and_ablation_match_a_manual_run():
    model = tiny_model("llama")
    cfg = dict(length=6, sequences=3, top_k=2, seed=1)
    res = run_probes(wrap(model), ["induction"], IDS, batch_size=2, **cfg)["induction"]
    assert res.meta["cache_block_evaluations"] == 0.0
    ids = repeated_sequences(131, 6, 3, seed=1, bos=1)  # LlamaConfig's bos_token_id
    assert res.meta["sequences"]["bos"] == 1 and ids.shape == (3, 13)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_attentions=True)
    heads = heads_of(res)
    for i, a in enumerate(out.attentions):
        ind, dup = induction_scores(a, 6, offset=1)
        for h in range(4):
            assert heads[(i, h)]["value"] == pytest.approx(float(ind[h]), rel=1e-5)
            assert heads[(i, h)]["duplicate"] == pytest.approx(float(dup[h]), rel=1e-5)
    ranked = sorted(heads, key=lambda k: (-heads[k]["value"], k))
    effect = res.meta["ablation"]
    assert [tuple(x) for x in effect["top"]["heads"]] == ranked[:2]
    assert not {tuple(x) for x in effect["random"]["heads"]} & set(ranked[:2])
    pos = repeat_positions(6, offset=1)
    for name in ("top", "random"):
        manual = copy.deepcopy(model)
        for i, h in effect[name]["heads"]:
            with torch.no_grad():
                get_adapter(manual).attn_projections(i)["o"].weight[:, h * 8:(h + 1) * 8] = 0
        with torch.no_grad():
            got = manual(input_ids=ids, use_cache=False).logits
        kl = kl_from_logits_float64(out.logits[:, pos], got[:, pos]).mean()
        assert effect[name]["kl"] == pytest.approx(float(kl), rel=1e-4)
        acc = (got[:, pos].argmax(-1) == ids[:, pos + 1]).double().mean()
        assert effect[name]["accuracy_ablated"] == pytest.approx(float(acc))
    dense_acc = (out.logits[:, pos].argmax(-1) == ids[:, pos + 1]).double().mean()
    assert effect["top"]["accuracy_dense"] == pytest.approx(float(dense_acc))


def test_induction_options_validate_and_encoders_are_refused():
    with pytest.raises(ConfigError, match="length"):
        make_config("induction", length=1)
    with pytest.raises(ConfigError, match="2 x length 100"):
        run_probes(wrap(tiny_model("llama")), ["induction"], IDS, length=100)
    with pytest.raises(UnsupportedOperationError, match="induction needs a causal LM"):
        run_probes(wrap(tiny_model("bert")), ["induction"], IDS)


# ---------------------------------------------------------------- summary and plots
def head_result(probe: str, values: list[list[float]], lower: bool = True) -> ProbeResult:
    scores = [{"layers": [i], "head": h, "value": v}
              for i, row in enumerate(values) for h, v in enumerate(row)]
    return ProbeResult(probe, {}, scores, kind="head", lower_is_removable=lower,
                       num_blocks=len(values))


def test_head_correlations_and_summary_hand_made(tmp_path):
    a = head_result("stable-rank", [[1.0, 2.0], [3.0, 4.0]])
    b = head_result("head-ablation", [[10.0, 20.0], [30.0, 40.0]])
    c = head_result("induction", [[4.0, 3.0], [2.0, 1.0]])
    flipped = head_result("dla", [[1.0, 2.0], [3.0, 4.0]], lower=False)
    corr = {(x["a"], x["b"]): x["spearman"] for x in head_correlations(
        {"sr": a, "ha": b, "ind": c, "dla": flipped})}
    assert corr[("sr", "ha")] == pytest.approx(1.0)
    assert corr[("sr", "ind")] == pytest.approx(-1.0)
    assert corr[("sr", "dla")] == pytest.approx(-1.0)  # oriented: high = removable
    few = head_result("x", [[1.0, 2.0]])
    assert head_correlations({"sr": a, "few": few}) == []
    assert b.layer_values() == [30.0, 70.0] and flipped.layer_values() == [-3.0, -7.0]
    text = write_summary({"sr": a, "ha": b})
    assert "## Attention heads" in text and "| sr | ha | 4 | 1 |" in text
    assert "| sr | 0.0 (1), 0.1 (2), 1.0 (3), 1.1 (4) |" in text
    assert head_summary_lines({}) == []
    assert "Attention heads" not in write_summary({})
    assert head_array(a).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    plot_result(a, tmp_path / "a.png")
    dla = head_result("dla", [[1.0, -2.0]])
    dla.scores += [{"layers": [0], "sublayer": "attention", "value": -1.0},
                   {"layers": [0], "sublayer": "mlp", "value": 0.5}]
    plot_result(dla, tmp_path / "dla.png")
    for name in ("a.png", "dla.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_head_probes_write_outputs_and_summary(tmp_path):
    lm = wrap(tiny_model("llama"))
    res = run_probes(lm, ["dla", "stable-rank", "head-ablation"], IDS, batch_size=2,
                     out_dir=tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "### Head-score agreement (Spearman)" in text
    assert "| dla | stable-rank | 16 |" in text
    for name in res:
        back = ProbeResult.load(tmp_path / f"{name}.json")
        assert back.kind == "head" and back.scores == res[name].scores
        assert (tmp_path / f"{name}.csv").read_text().startswith("layers,")
