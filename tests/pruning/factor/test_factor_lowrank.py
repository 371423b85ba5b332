"""SVD-LLM whitened low-rank factorization (prunelab.pruning.factor.lowrank): the maths
(truncation loss identity, whitening beats plain SVD, refit optimality), rank budgets,
the model run on the tiny-model matrix, checkpoints and errors."""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.errors import ConfigError
from prunelab.models.custom import LowRankLinear
from prunelab.models.linear import weight_out_in
from prunelab.models.loading import wrap
from prunelab.pruning import pruner_for
from prunelab.pruning.base import METHODS
from prunelab.pruning.factor import factorized_modules
from prunelab.pruning.factor.grams import collect_grams, whitened_spectra, whitening
from prunelab.pruning.factor.lowrank import (
    SvdLlm,
    factorize_model,
    refit_second,
    spectrum_ranks,
    uniform_rank,
    whitened_error,
    whitened_factors,
)

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

ARCHS = ["llama", "gpt2", "phi3", "gemma3_text"]
IDS = tiny_tokens(4, 16, seed=5)


def _lm(arch):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


def _logits(lm, ids=IDS):
    with torch.no_grad():
        return lm.model(input_ids=ids, use_cache=False).logits


def _run(lm, cfg, ids=IDS):
    pruner = pruner_for(cfg)
    pruner.precheck(lm, cfg)
    return pruner.run(lm, cfg, ids, batch_size=2).to_dict()


def _linears(lm):
    """{full path: module} of every adapter linear."""
    names = {id(m): n for n, m in lm.model.named_modules()}
    return {names[id(m)]: m for i in range(lm.adapter.num_blocks)
            for m in lm.adapter.linears(i).values()}


def _problem(seed=0, m=12, n=20, t=60):
    """A random weight and anisotropic inputs (a few dominant directions)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, n, generator=g, dtype=torch.float64)
    scales = torch.logspace(1, -2, n, dtype=torch.float64)
    x = torch.randn(t, n, generator=g, dtype=torch.float64) * scales
    x = x @ torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    return w, x


# ---------------------------------------------------------------------- the maths
@pytest.mark.parametrize("tokens,damping", [(60, 0.01), (60, 0.0), (5, 0.0)])
def test_truncation_loss_is_the_whitened_error_at_every_rank(tokens, damping):
    w, x = _problem(t=tokens)
    gram = x.T @ x / tokens
    white = whitening(gram, damping)
    # 5 tokens, no damping: a singular Gram, so the eigen square root stands in
    assert white.cholesky == (tokens > 5)
    torch.testing.assert_close(white.s @ white.s.T, gram + white.damping * torch.eye(20),
                               rtol=1e-9, atol=1e-9 * float(gram.diagonal().max()))
    for k in range(1, 13):
        fac = whitened_factors(w, gram, k, damping)
        assert fac.rank == k and fac.first.shape == (k, 20) and fac.second.shape == (12, k)
        err = whitened_error(fac.second @ fac.first, w, fac.white)
        assert err == pytest.approx(fac.loss, rel=1e-8, abs=1e-10 * fac.energy)
        assert fac.loss == pytest.approx(float(fac.sigma[k:].square().sum()))
    assert whitened_factors(w, gram, 12, damping).loss == 0.0  # full rank: nothing dropped


def test_full_rank_factors_reproduce_the_weight():
    w, x = _problem()
    fac = whitened_factors(w, x.T @ x / 60, 12, 0.01)
    torch.testing.assert_close(fac.second @ fac.first, w, rtol=0, atol=1e-10)


def test_whitened_error_beats_plain_svd_at_every_rank():
    w, x = _problem(seed=1)
    gram = x.T @ x / 60
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    strict = 0
    for k in range(1, 12):
        fac = whitened_factors(w, gram, k, 0.01)
        plain = whitened_error(u[:, :k] * s[:k] @ vh[:k], w, fac.white)
        assert fac.loss <= plain * (1 + 1e-12)
        strict += fac.loss < 0.9 * plain
    assert strict >= 8  # on anisotropic inputs whitening matters, not just ties


def test_refit_is_the_least_squares_second_factor():
    w, xp = _problem(seed=2)
    g = torch.Generator().manual_seed(3)
    xd = xp + 0.3 * torch.randn(xp.shape, generator=g, dtype=torch.float64)
    gram, cross = xp.T @ xp / 60, xp.T @ xd / 60
    target = xd @ w.T

    def err(a, b):
        return float((xp @ a.T @ b.T - target).square().sum())

    for k in (2, 5, 9):
        fac = whitened_factors(w, gram, k, 0.01)
        b = refit_second(fac.first, w, gram, cross)
        best = err(fac.first, b)
        assert best <= err(fac.first, fac.second)
        for _ in range(5):  # a minimum: any other second factor does worse
            assert best <= err(fac.first, b + 1e-3 * torch.randn(b.shape, generator=g,
                                                                   dtype=torch.float64))
    # same stream, no damping, full rank: the refit reproduces the weight
    fac = whitened_factors(w, gram, 12, 0.0)
    torch.testing.assert_close(refit_second(fac.first, w, gram, gram) @ fac.first, w,
                               rtol=0, atol=1e-8)


# ---------------------------------------------------------------------- budgets
def test_uniform_rank_is_the_floor_formula():
    assert uniform_rank(48, 32, 0.5) == 9  # floor(0.5 * 1536 / 80) = floor(9.6)
    assert uniform_rank(32, 32, 0.8) == 12  # floor(12.8)
    assert uniform_rank(16, 32, 0.75) == 8  # floor(8.0): exact, no rounding down
    assert uniform_rank(4, 4, 0.1) == 1  # floor(0.2) -> at least rank 1
    assert uniform_rank(100, 100, 0.1) == 5  # exact: 0.1 * 10000 / 200 is 5, not 4.999
    # ratio 0.9 keeps exactly 1/10: 5, where float arithmetic (1 - 0.9 = 0.0999..98) gives 4
    assert math.floor((1 - 0.9) * 100 * 100 / 200) == 4
    assert SvdLlm(ratio=0.9).uniform_ranks({"a": (100, 100)}, 1000) == {"a": 5}


def test_spectrum_ranks_greedy_by_energy_per_parameter():
    shapes = {"a": (8, 8), "b": (8, 8), "c": (2, 4)}  # c: rank 1 costs 6 < 8 -> (8-1)//6 = 1
    spectra = {"a": torch.tensor([4.0, 3.0, 2.0, 1.0]), "b": torch.tensor([4.0, 2.5, 2.2, 0.0]),
               "c": torch.tensor([9.0, 8.0])}
    base = 16 + 16 + 6
    assert spectrum_ranks(spectra, shapes, base) == {"a": 1, "b": 1, "c": 1}
    assert spectrum_ranks(spectra, shapes, base + 31) == {"a": 2, "b": 1, "c": 1}
    assert spectrum_ranks(spectra, shapes, base + 32) == {"a": 2, "b": 2, "c": 1}
    assert spectrum_ranks(spectra, shapes, base + 48) == {"a": 2, "b": 3, "c": 1}
    # never past the largest saving rank: (64 - 1) // 16 = 3
    assert spectrum_ranks(spectra, shapes, 10_000) == {"a": 3, "b": 3, "c": 1}
    shapes["d"] = (1, 1)  # no rank saves: left out (stays dense)
    spectra["d"] = torch.tensor([1.0])
    assert "d" not in spectrum_ranks(spectra, shapes, base)


def test_uniform_ratio_gives_the_exact_ranks():
    lm = _lm("llama")
    rep = _run(lm, SvdLlm(ratio=0.3))
    # tiny llama: q/o 32x32, k/v 16x32, gate/up 48x32, down 32x48; floor(0.7 m n / (m + n))
    want = {"q_proj": 11, "k_proj": 7, "v_proj": 7, "o_proj": 11, "gate_proj": 13,
            "up_proj": 13, "down_proj": 13}
    assert len(rep["linears"]) == 28
    for row in rep["linears"]:
        m, n = row["shape"]
        assert row["rank"] == want[row["module"].rsplit(".", 1)[1]]
        assert row["rank"] == math.floor(Fraction(7, 10) * m * n / (m + n))
        assert row["params_after"] == row["rank"] * (m + n)
    assert rep["linear_params_after"] == 4 * (2 * 11 * 64 + 2 * 7 * 48 + 3 * 13 * 80)
    assert rep["removed_fraction"] >= 0.3 and rep["dense_linears"] == []
    assert rep["params_before"] - rep["params_after"] == \
        rep["linear_params_before"] - rep["linear_params_after"]


@pytest.mark.parametrize("arch", ["llama", "phi3"])
@pytest.mark.parametrize("budget", [{"ratio": 0.4}, {"target_params": 0.8}])
def test_spectrum_allocation_meets_the_budget_within_one_rank_step(arch, budget):
    lm = _lm(arch)
    rep = _run(lm, SvdLlm(allocation="spectrum", **budget))
    steps = [sum(r["shape"]) for r in rep["linears"]]
    assert rep["linear_params_after"] <= rep["linear_budget"]
    assert rep["linear_budget"] - rep["linear_params_after"] < max(steps)
    if "ratio" in budget:
        assert rep["linear_budget"] == math.floor(Fraction(6, 10) * rep["linear_params_before"])
    else:
        assert rep["kept_params"] <= 0.8
    ranks = {r["rank"] for r in rep["linears"]}
    assert len(ranks) > 1  # not uniform


@pytest.mark.parametrize("allocation", ["uniform", "spectrum"])
def test_target_params_is_the_whole_models_kept_fraction(allocation):
    lm = _lm("gpt2")
    rep = _run(lm, SvdLlm(target_params=0.7, allocation=allocation))
    slack = sum(sum(r["shape"]) for r in rep["linears"])  # one rank step per linear
    assert rep["kept_params"] <= 0.7
    assert rep["kept_params"] > 0.7 - slack / rep["params_before"]


# ---------------------------------------------------------------------- the model run
@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_reproduces_weights_and_logits(arch):
    lm = _lm(arch)
    ref = _logits(lm)
    dense = {p: weight_out_in(m).detach().clone() for p, m in _linears(lm).items()}
    ranks = {p: min(w.shape) for p, w in dense.items()}
    rows = factorize_model(lm, IDS, ranks, batch_size=2, only_if_smaller=False)
    assert all(r["factorized"] and r["truncation_loss"] == 0.0 for r in rows)
    for path, w in dense.items():
        mod = lm.model.get_submodule(path)
        assert isinstance(mod, LowRankLinear) and mod.rank == min(w.shape)
        torch.testing.assert_close(mod.dense_weight(), w, rtol=0, atol=2e-6)
    torch.testing.assert_close(_logits(lm), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_only_saving_factorizations_replace_a_linear(arch):
    lm = _lm(arch)
    ranks = {p: min(weight_out_in(m).shape) for p, m in _linears(lm).items()}
    ref = _logits(lm)
    rows = factorize_model(lm, IDS, ranks, batch_size=2)  # full rank never saves
    assert rows and not any(r["factorized"] for r in rows)
    assert factorized_modules(lm.model) == []
    torch.testing.assert_close(_logits(lm), ref, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_reload_with_remote_code_gives_identical_logits(arch, tmp_path):
    lm = _lm(arch)
    rep = _run(lm, SvdLlm(ratio=0.3, allocation="spectrum"))
    ref = _logits(lm)
    listed = factorized_modules(lm.model)  # what `prunelab info` shows
    rows = {r["module"]: r for r in rep["linears"]}
    assert sorted(e["module"] for e in listed) == sorted(rows)
    for e in listed:
        r = rows[e["module"]]
        assert e["kind"] == "low_rank_linear"
        assert (e["out_features"], e["in_features"], e["rank"]) == (*r["shape"], r["rank"])
    assert rep["factorized_modules"] == len(listed) and rep["needs_remote_code"]
    assert rep["flops_per_token_after"] < rep["flops_per_token_before"]
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    with torch.no_grad():
        got = again(input_ids=IDS, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_prune_api_records_the_run_in_the_manifest(tmp_path):
    import json

    from prunelab.data import TokenBatches

    calib = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0,
                         mode="calib", total_windows=4, sha256="0")
    lm = _lm("qwen3")
    cfg = SvdLlm(target_params=0.85, allocation="spectrum", refit=True, targets=("mlp.*",))
    rep = prunelab.prune(lm, cfg, calib, batch_size=2)
    assert rep["operation"] == "prune-factor" and rep["method"] == "svd-llm"
    assert rep["size_after"]["params"] == rep["params_after"] <= 0.85 * rep["params_before"]
    man = json.loads((prunelab.save(lm, tmp_path / "ckpt") / "manifest.json").read_text())
    op = man["operations"][-1]
    assert METHODS.from_dict(op["config"]) == cfg
    assert op["removed_fraction"] == rep["removed_fraction"]
    assert len(man["remote_code"]["modules"]) == 12


def test_factorization_runs_on_the_compressed_stream_and_refit_lowers_each_error():
    lm = _lm("llama")
    dense = copy.deepcopy(lm.model)
    rep = _run(lm, SvdLlm(ratio=0.5, refit=True))
    paths = [r["module"] for r in rep["linears"]]
    xp, xd = _inputs(lm.model, paths), _inputs(dense, paths)
    improved = 0
    for row in rep["linears"]:
        path, k = row["module"], row["rank"]
        mod, w = lm.model.get_submodule(path), weight_out_in(dense.get_submodule(path))
        w = w.detach().double()
        gram = xp[path].T @ xp[path] / xp[path].shape[0]
        fac = whitened_factors(w, gram, k, 0.01)  # from the compressed stream's inputs
        a, b = mod.first.weight.detach().double(), mod.second.weight.detach().double()
        torch.testing.assert_close(a.abs().sum(0), fac.first.abs().sum(0), rtol=1e-3,
                                   atol=1e-4)  # same first factor (up to signs)
        target = xd[path] @ w.T

        def err(a_, b_, target=target, x=xp[path]):
            return float((x @ a_.T @ b_.T - target).square().sum())

        refit, svd = err(a, b), err(fac.first, fac.second)
        assert refit <= svd * (1 + 1e-5)
        improved += refit < svd * 0.999
    assert improved >= len(paths) // 2


def _inputs(model, paths):
    """{path: [tokens, d_in] float64 inputs} of modules in ``model`` on ``IDS``."""
    seen = {}
    hooks = [model.get_submodule(p).register_forward_pre_hook(
        lambda _m, args, p=p: seen.__setitem__(p, args[0].reshape(-1, args[0].shape[-1])
                                               .double())) for p in paths]
    try:
        with torch.no_grad():
            model(input_ids=IDS, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_targets_and_ignore_choose_the_linears():
    lm = _lm("llama")
    rep = _run(lm, SvdLlm(ratio=0.3, targets=("mlp.*",), ignore=("*.3.mlp.down_proj",)))
    got = [r["module"] for r in rep["linears"]]
    assert len(got) == 11 and all(".mlp." in p for p in got)
    assert "model.layers.3.mlp.down_proj" not in got
    assert isinstance(lm.model.get_submodule("model.layers.3.mlp.up_proj"), LowRankLinear)
    assert not isinstance(lm.model.get_submodule("model.layers.3.mlp.down_proj"),
                          LowRankLinear)


def test_a_second_run_factorizes_what_is_left():
    lm = _lm("gpt2")
    first = _run(lm, SvdLlm(ratio=0.3, targets=("mlp.*",)))
    mlp = {e["module"]: e["rank"] for e in factorized_modules(lm.model)}
    second = _run(lm, SvdLlm(ratio=0.3))  # the factorized MLP linears are left as they are
    assert len(first["linears"]) == len(second["linears"]) == 8
    assert not any(".mlp." in r["module"] for r in second["linears"])
    now = {e["module"]: e["rank"] for e in factorized_modules(lm.model)}
    assert len(now) == 16 and all(now[p] == k for p, k in mlp.items())
    assert second["params_before"] == first["params_after"]


def test_collect_grams_are_the_dense_input_grams():
    lm = _lm("phi3")
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    grams = collect_grams(lm, IDS, batch_size=3)
    assert all(g.dtype == torch.float64 for g in grams.values())
    paths = list(_linears(lm))
    assert sorted(grams) == sorted(paths)
    xs = _inputs(lm.model, paths)
    for p in paths:
        torch.testing.assert_close(grams[p], xs[p].T @ xs[p] / xs[p].shape[0],
                                   rtol=1e-5, atol=1e-6)
    llama = _lm("llama")
    only = ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    some = collect_grams(llama, IDS, batch_size=2, modules=only)
    assert sorted(some) == sorted(only) and some[only[0]] is some[only[1]]  # shared input
    assert all(torch.equal(v, lm.model.state_dict()[k]) for k, v in before.items())


def test_whitened_spectra_of_the_dense_model():
    lm = _lm("gpt2")  # Conv1D: weights read through weight_out_in
    grams = collect_grams(lm, IDS, batch_size=2)
    names = {"transformer.h.2.attn.c_attn": (2, "attn.c_attn"),
             "transformer.h.1.mlp.c_proj": (1, "mlp.c_proj")}
    spectra = whitened_spectra(lm, IDS, names, batch_size=2, damping=0.05)
    assert sorted(spectra) == sorted(names)
    for name in names:
        w = weight_out_in(lm.model.get_submodule(name)).detach().double()
        assert w.shape == ((96, 32) if "c_attn" in name else (32, 48))
        g = grams[name]
        lam = 0.05 * float(g.diagonal().mean())
        s = torch.linalg.cholesky(g + lam * torch.eye(g.shape[0], dtype=g.dtype))
        torch.testing.assert_close(spectra[name], torch.linalg.svdvals(w @ s), rtol=1e-5,
                                   atol=1e-8)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,match", [
    ({"ratio": 0.0}, r"ratio must be in \(0, 1\)"),
    ({"ratio": 1.0}, r"ratio must be in \(0, 1\)"),
    ({"ratio": 1.5}, r"ratio must be in \[0.0, 1.0\]"),
    ({"ratio": float("nan")}, "ratio"),
    ({"ratio": 0.2, "target_params": 0.8}, "not both"),
    ({"allocation": "greedy"}, "allocation must be uniform or spectrum"),
    ({"damping": -1.0}, "damping"),
])
def test_bad_options_raise_one_line(kwargs, match):
    with pytest.raises(ConfigError, match=match) as err:
        SvdLlm(**kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs,match", [
    ({"target_params": 0.05}, "target_params 0.05 is unreachable: even rank 1"),
    ({"ratio": 0.99}, "ratio 0.99 is unreachable"),
    ({"target_params": 1.0}, "nothing to factorize"),
    ({"targets": ("nothing.*",)}, "selected no linear"),
])
def test_unreachable_budgets_fail_before_any_data(kwargs, match):
    lm = _lm("llama")
    cfg = SvdLlm(**kwargs)
    with pytest.raises(ConfigError, match=match) as err:
        pruner_for(cfg).precheck(lm, cfg)
    assert "\n" not in str(err.value)
    assert factorized_modules(lm.model) == []


def test_uniform_ranks_refuse_a_rank_one_floor_over_the_budget():
    shapes = {"a": (100, 100), "b": (2, 40)}  # b: floor(0.1 * 80 / 42) = 0 -> rank 1
    cfg = SvdLlm(ratio=0.9)
    budget = math.floor(0.1 * 10_080)
    with pytest.raises(ConfigError, match=r"unreachable with uniform ranks .*1042 > 1008"):
        cfg.uniform_ranks(shapes, budget)
    # a's rounding down (floor(1980 / 199) = 9: 1791 of 1980) leaves room for b's floor
    shapes["a"] = (99, 100)
    assert SvdLlm(ratio=0.8).uniform_ranks(shapes, 1996) == {"a": 9, "b": 1}


def test_registered_with_defaults():
    assert METHODS.get("svd-llm") is SvdLlm
    cfg = SvdLlm()
    assert (cfg.ratio, cfg.allocation, cfg.damping, cfg.refit) == (0.2, "uniform", 0.01, False)
    assert SvdLlm(target_params=0.8).ratio is None
