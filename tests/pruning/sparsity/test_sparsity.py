"""Sparsity methods end to end on tiny models of every architecture."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab import Magnitude, Owl, Pals, QKWanda, Ramp, Rose, SparseGPT, Wanda
from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import SumSquares
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.adapters import get_adapter
from prunelab.models.linear import weight_out_in
from prunelab.models.loading import wrap
from prunelab.pruning.base import METHODS as METHODS_REGISTRY
from prunelab.pruning.linears import branch_containers
from prunelab.pruning.sparsity.config import from_dict, to_dict
from prunelab.pruning.sparsity.execute import prune_block, prune_block_sequential, role_groups
from prunelab.pruning.sparsity.masks import unstructured_mask

from tiny_models import ARCHS, char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(6, 16)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=6, seed=0, mode="calib",
                     total_windows=6, sha256="0")


def run(arch, cfg):
    lm = wrap(tiny_model(arch), char_tokenizer(), spec=f"tiny-{arch}")
    return lm, prunelab.prune(lm, cfg, CALIB, batch_size=3)


def block_weights(lm):
    ad = lm.adapter
    return {(i, p): weight_out_in(m) for i in range(ad.num_blocks)
            for p, m in ad.linears(i).items()}


METHODS = [Magnitude(sparsity=0.5), Wanda(sparsity=0.5), SparseGPT(sparsity=0.5),
           Rose(sparsity=0.5), Wanda(pattern="2:4"), SparseGPT(pattern="2:4")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", METHODS,
                         ids=lambda c: f"{c.registry_name}-{c.pattern or c.sparsity}")
def test_methods_on_every_architecture(arch, cfg):
    lm, rep = run(arch, cfg)
    for (i, path), w in block_weights(lm).items():
        rows_zero = (w == 0).sum(1)
        if cfg.pattern:  # at most 2 of every 4 consecutive weights of a row are kept
            groups = (w != 0).reshape(w.shape[0], -1, 4).sum(-1)
            assert (groups <= 2).all(), (i, path)
        else:
            per_row = int(w.shape[1] * 0.5)
            assert (rows_zero >= per_row).all() and (rows_zero <= per_row + 1).all(), (i, path)
    assert rep["achieved_sparsity"] == pytest.approx(0.5, abs=0.02)
    head = lm.adapter.head()  # the LM head (bert: the embeddings) is never pruned
    outer = head.weight if head is not None else lm.model.get_input_embeddings().weight
    assert (outer != 0).float().mean() > 0.99


def test_allocations_keep_the_mean_and_vary_per_block():
    for alloc in (Owl(), Pals(), Ramp(span=0.1)):
        lm, rep = run("llama", Wanda(sparsity=0.5, allocation=alloc))
        s = rep["per_block_sparsity"]
        assert sum(s) / len(s) == pytest.approx(0.5, abs=1e-6)  # equal block sizes
        assert max(s) - min(s) > 0.01 and all(0 <= v < 1 for v in s)
        for layer in rep["layers"]:
            for frac in layer["linears"].values():
                assert frac == pytest.approx(layer["target"], abs=0.04)
    ramp = run("llama", Wanda(sparsity=0.5, allocation=Ramp(span=0.1)))[1]
    assert ramp["per_block_sparsity"] == sorted(ramp["per_block_sparsity"])


def test_targets_and_ignore_select_linears():
    lm, rep = run("llama", Wanda(sparsity=0.5, targets=("mlp.*",), ignore=("*down_proj",)))
    for (_block, path), w in block_weights(lm).items():
        zeros = float((w == 0).float().mean())
        if path in ("mlp.gate_proj", "mlp.up_proj"):
            assert zeros == pytest.approx(0.5, abs=0.02)
        else:
            assert zeros < 0.01, path
    with pytest.raises(ConfigError, match="selected no linear"):
        run("llama", Wanda(sparsity=0.5, targets=("nothing*",)))


def test_tied_head_and_embeddings_untouched():
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    emb = model.get_input_embeddings().weight.clone()
    lm = wrap(model, char_tokenizer())
    prunelab.prune(lm, Magnitude(sparsity=0.7), CALIB, batch_size=3)
    assert torch.equal(model.get_input_embeddings().weight, emb)


def test_sparsegpt_reconstructs_better_than_wanda_on_a_block():
    x_lm, _ = run("llama", Wanda(sparsity=0.6))
    s_lm, _ = run("llama", SparseGPT(sparsity=0.6))
    dense = wrap(tiny_model("llama"))
    with torch.no_grad():
        ref = dense.model(input_ids=IDS).logits
        err_w = (x_lm.model(input_ids=IDS).logits - ref).pow(2).mean()
        err_s = (s_lm.model(input_ids=IDS).logits - ref).pow(2).mean()
    assert err_s < err_w


def test_qk_wanda_shares_one_budget_and_refuses_fused_qkv():
    lm, rep = run("llama", QKWanda(sparsity=0.5))
    w = block_weights(lm)
    q, k = w[(0, "self_attn.q_proj")], w[(0, "self_attn.k_proj")]
    total_zero = int((q == 0).sum() + (k == 0).sum())
    assert total_zero == int((q.numel() + k.numel()) * 0.5)
    assert float((w[(0, "self_attn.v_proj")] == 0).float().mean()) == 0.0  # scope qk
    assert rep["achieved_sparsity"] == pytest.approx(0.5, abs=1e-3)  # over q and k only
    assert set(rep["layers"][0]["linears"]) == {"self_attn.q_proj", "self_attn.k_proj"}
    lm, rep = run("llama", QKWanda(sparsity=0.5, scope="block"))
    assert float((block_weights(lm)[(0, "mlp.down_proj")] == 0).float().mean()) == \
        pytest.approx(0.5, abs=0.02)
    with pytest.raises(UnsupportedOperationError, match="fuses"):
        run("gpt2", QKWanda(sparsity=0.5))


def _dense_forward_taps(model, taps: dict, what: str = "input") -> dict:
    """Plain forward hooks on the HF model (not the runner): ``{name: tensor}`` of each
    module's first input or its output over all of ``IDS`` in one batch (float64)."""
    seen, handles = {}, []
    for name, m in taps.items():
        def hook(_m, inputs, output, _n=name):
            seen[_n] = (inputs[0] if what == "input" else output).detach().double()
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=IDS)
    finally:
        for h in handles:
            h.remove()
    return seen


def _kept_lowest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Kept mask of a 1-D or 2-D (per row) ``scores`` pruning the ``k`` lowest, by a
    threshold at the k-th value (ties do not occur on random weights)."""
    kth = torch.kthvalue(scores, k, dim=-1, keepdim=True).values
    return scores > kth


def test_qk_wanda_causal_masks_equal_a_hand_computation():
    """Block by block on a dense model pruned by hand: the causal statistics ``A_q[j, c] =
    sum_t x_t[j]^2 sum_{s <= t} k_s[c]^2`` and ``A_k[j, c] = sum_s x_s[j]^2 sum_{t >= s}
    q_t[c]^2`` (from plain hooks, with an explicit causal mask), the scores, and q and k
    pruned under one budget give exactly the weights of ``QKWanda(variant="causal")``;
    the unmasked variant gives other masks."""
    from prunelab.pruning.sparsity.scores import qk_wanda_causal_scores

    lm, rep = run("llama", QKWanda(sparsity=0.5, variant="causal"))
    assert rep["config"]["variant"] == "causal"
    unmasked = block_weights(run("llama", QKWanda(sparsity=0.5))[0])
    ref = wrap(tiny_model("llama"), char_tokenizer(), spec="hand")
    tril = torch.ones(IDS.shape[1], IDS.shape[1], dtype=torch.float64).tril()  # [t, s]
    differs = False
    for i in range(ref.adapter.num_blocks):
        proj = ref.adapter.attn_projections(i)
        x = _dense_forward_taps(ref.model, {"q": proj["q"]})["q"]
        out = _dense_forward_taps(ref.model, {"q": proj["q"], "k": proj["k"]}, "output")
        a_q = torch.einsum("btj,ts,bsc->jc", x.square(), tril, out["k"].square())
        a_k = torch.einsum("bsj,ts,btc->jc", x.square(), tril, out["q"].square())
        geo = ref.adapter.head_geometry(i)
        wq, wk = weight_out_in(proj["q"]).detach(), weight_out_in(proj["k"]).detach()
        sq, sk = qk_wanda_causal_scores(wq, wk, a_q, a_k, geo.num_heads, geo.num_kv_heads,
                                        geo.head_dim)
        flat = torch.cat([sq.reshape(-1), sk.reshape(-1)])
        keep = _kept_lowest(flat, flat.numel() // 2)
        kq, kk = keep[:sq.numel()].reshape(sq.shape), keep[sq.numel():].reshape(sk.shape)
        with torch.no_grad():
            proj["q"].weight.mul_(kq)
            proj["k"].weight.mul_(kk)
        for path, kept in (("self_attn.q_proj", kq), ("self_attn.k_proj", kk)):
            got = weight_out_in(lm.adapter.linears(i)[path])
            assert torch.equal(got != 0, kept), (i, path)
            assert torch.equal(got, weight_out_in(ref.adapter.linears(i)[path])), (i, path)
            differs |= not torch.equal(got != 0, unmasked[(i, path)] != 0)
    assert differs
    with pytest.raises(ConfigError, match="variant"):
        QKWanda(variant="sliding")
    with pytest.raises(ConfigError, match="not pattern"):
        QKWanda(pattern="2:4")


def test_moonshot_taylor_term_equals_autograd_and_feeds_the_blend(monkeypatch):
    """The Taylor term the executor feeds (``T = X^T diag(||g_t||^2) X``, ``g_t`` the
    gradient of the summed next-token NLL w.r.t. the linear's output at token ``t``)
    equals one computed here with autograd; block 0's q_proj (calibrated on the dense
    block) is exactly SparseGPT on the blend of ``X^T X`` and that term."""
    from prunelab.calib import gradients
    from prunelab.pruning.sparsity import hessian_blend, sparsegpt_prune

    fed = {}
    real = gradients.taylor_terms
    monkeypatch.setattr(gradients, "taylor_terms",
                        lambda *a, **k: fed.update(real(*a, **k)) or dict(fed))
    lm, rep = run("llama", SparseGPT(sparsity=0.5, hessian_alpha=0.5))
    ref = tiny_model("llama")  # the same dense weights, with gradients
    ad = get_adapter(ref)
    mods = {f"{i}:{p}": m for i in range(ad.num_blocks) for p, m in ad.linears(i).items()}
    xs, ys = {}, {}

    def keep(name):
        def hook(_m, inputs, output):
            xs[name], ys[name] = inputs[0], output
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in mods.items()]
    logits = ref(input_ids=IDS).logits
    for h in handles:
        h.remove()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             IDS[:, 1:].reshape(-1), reduction="sum")
    grads = dict(zip(mods, torch.autograd.grad(loss, [ys[n] for n in mods]), strict=True))
    assert set(fed) == set(mods)
    for n in mods:
        x = xs[n].detach().double().reshape(-1, xs[n].shape[-1])
        g2 = grads[n].double().square().sum(-1).reshape(-1)
        hand = torch.einsum("ti,t,tj->ij", x, g2, x)
        torch.testing.assert_close(fed[n], hand, rtol=1e-6,
                                   atol=1e-9 * float(hand.abs().max()))
    q = "self_attn.q_proj"
    x = xs[f"0:{q}"].detach().double().reshape(-1, xs[f"0:{q}"].shape[-1])
    h = hessian_blend((x.t() @ x).float(), fed[f"0:{q}"], 0.5).float()
    want, _ = sparsegpt_prune(weight_out_in(ad.linears(0)[q]).detach(), h, 0.5)
    got = weight_out_in(lm.adapter.linears(0)[q])
    assert torch.equal(got == 0, want == 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert rep["achieved_sparsity"] == pytest.approx(0.5, abs=1e-9)


def test_rose_without_reordering_equals_sparsegpt():
    a = block_weights(run("llama", SparseGPT(sparsity=0.5))[0])
    b = block_weights(run("llama", Rose(sparsity=0.5, reorder=False))[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("propagate", ["dense", "modified"])
def test_propagate_modes_equal_hand_computed_wanda_masks(propagate):
    """``within_block="dense"`` Wanda, computed here with plain hooks on the HF model:
    ``propagate="dense"`` takes every block's norms ``||X_j||`` on the dense model;
    ``"modified"`` on a model whose earlier blocks are already pruned (block by block).
    Each row keeps all but its ``d_in / 2`` lowest ``|W_ij| ||X_j||``."""
    lm, _ = run("llama", Wanda(sparsity=0.5, within_block="dense", propagate=propagate))
    ref = wrap(tiny_model("llama"), char_tokenizer(), spec="hand")
    ad = ref.adapter
    dense_x = _dense_forward_taps(ref.model, {(i, p): m for i in range(ad.num_blocks)
                                              for p, m in ad.linears(i).items()})
    for i in range(ad.num_blocks):
        xs = dense_x if propagate == "dense" else _dense_forward_taps(ref.model, {
            (i, p): m for p, m in ad.linears(i).items()})
        for path, m in ad.linears(i).items():
            x = xs[(i, path)].reshape(-1, m.in_features)
            w = m.weight.detach()
            kept = _kept_lowest(w.double().abs() * x.square().sum(0).sqrt(), w.shape[1] // 2)
            with torch.no_grad():
                m.weight.mul_(kept)
            got = weight_out_in(lm.adapter.linears(i)[path])
            assert torch.equal(got != 0, kept), (i, path)
            assert torch.equal(got, m.weight), (i, path)
    a = block_weights(run("llama", SparseGPT(sparsity=0.5))[0])
    b = block_weights(run("llama", SparseGPT(sparsity=0.5, propagate=propagate))[0])
    assert torch.equal(a[(0, "mlp.down_proj")], b[(0, "mlp.down_proj")])  # block 0: same input
    assert torch.equal(a[(3, "mlp.down_proj")], b[(3, "mlp.down_proj")]) == \
        (propagate == "modified")


def test_wanda_propagates_by_target_unless_told():
    """Wanda's ``propagate="auto"``: dense outputs for a sparsity target, pruned outputs
    for an N:M pattern (the better of the two on SmolLM2 for each); an explicit value
    wins; the resolved value is what the config records and what the run does."""
    assert Wanda().propagate == "dense" and Wanda(sparsity=0.6).propagate == "dense"
    assert Wanda(pattern="2:4").propagate == "modified"
    assert Wanda(pattern="2:4", propagate="dense").propagate == "dense"
    assert Wanda(sparsity=0.5, propagate="modified").propagate == "modified"
    assert to_dict(Wanda(pattern="2:4"))["propagate"] == "modified"
    with pytest.raises(ConfigError, match="propagate must be"):
        SparseGPT(propagate="auto")
    with pytest.raises(ConfigError, match="propagate must be auto, modified or dense"):
        Wanda(propagate="autoo")
    auto = block_weights(run("llama", Wanda(pattern="2:4"))[0])
    told = {p: block_weights(run("llama", Wanda(pattern="2:4", propagate=p))[0])
            for p in ("modified", "dense")}
    assert all(torch.equal(auto[k], told["modified"][k]) for k in auto)
    assert not all(torch.equal(auto[k], told["dense"][k]) for k in auto)


def test_config_validation_and_round_trip():
    with pytest.raises(ConfigError, match="sparsity"):
        Wanda(sparsity=1.5)
    with pytest.raises(ConfigError):
        Wanda(pattern="4:2")
    with pytest.raises(ConfigError, match="uniform"):
        Wanda(pattern="2:4", allocation=Owl())
    assert Wanda(pattern="2:4").target_sparsity == 0.5  # recorded target of 2:4
    assert Wanda(pattern="1:4").target_sparsity == 0.75
    assert Wanda().sparsity == 0.5 and Wanda() == Wanda(sparsity=0.5)
    for both in (0.5, 0.6):  # a pattern fixes the sparsity: giving both is an error
        with pytest.raises(ConfigError, match="give sparsity or pattern, not both"):
            Wanda(sparsity=both, pattern="2:4")
    with pytest.raises(TypeError):
        Wanda(reorder=True)
    with pytest.raises(ConfigError, match="'reorder'.*valid options: sparsity, pattern"):
        METHODS_REGISTRY.make("wanda", reorder=True)
    assert Wanda(allocation="owl") == Wanda(allocation=Owl())  # names accepted
    for cfg in (Wanda(sparsity=0.3, allocation=Owl(m=4.0)), Rose(reorder=False),
                QKWanda(scope="block"), SparseGPT(pattern="4:8", hessian_alpha=0.2),
                Magnitude(sparsity=0.2, allocation=Ramp(increasing=False), targets=("mlp.*",))):
        d = json.loads(json.dumps(to_dict(cfg)))
        assert d["name"] == cfg.registry_name and "method" not in d
        assert from_dict(d) == cfg and METHODS_REGISTRY.from_dict(d) == cfg
    assert to_dict(Wanda(allocation=Owl(m=4.0)))["allocation"] == \
        {"name": "owl", "m": 4.0, "lam": 0.08}
    with pytest.raises(ConfigError, match="allocation 'owl' has no option 'delta'"):
        METHODS_REGISTRY.from_dict({"name": "wanda", "allocation": {"name": "owl", "delta": 1}})
    # manifests written before the registry: "method" key, sparsity beside the pattern
    old = {"sparsity": 0.5, "pattern": "2:4", "allocation": {"name": "uniform"},
           "group": "row", "targets": [], "ignore": [], "propagate": "modified",
           "within_block": "sequential", "blocksize": 64, "percdamp": 0.01,
           "hessian_alpha": 0.0, "method": "sparsegpt"}
    assert from_dict(old) == SparseGPT(pattern="2:4", blocksize=64, propagate="modified")


def test_checkpoint_reloads_with_plain_transformers(tmp_path):
    lm, rep = run("llama", SparseGPT(sparsity=0.5))
    out = prunelab.save(lm, tmp_path / "ckpt", extra={"report": rep})
    again = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, lm.model(input_ids=IDS).logits,
                                   rtol=0, atol=0)
    man = json.loads((out / "manifest.json").read_text())
    assert man["report"]["layers"][0]["linears"]["mlp.down_proj"] == pytest.approx(0.5, abs=0.02)



@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", [Wanda(sparsity=0.5, within_block="sequential",
                                       propagate="modified"),
                                 SparseGPT(sparsity=0.5), Magnitude(sparsity=0.5)],
                         ids=lambda c: c.registry_name)
def test_one_pass_block_equals_group_by_group_passes(arch, cfg):
    """The replaying one-pass executor prunes exactly like separate partial passes per
    group, and its outputs equal a plain run of the pruned block."""
    ref = wrap(tiny_model(arch), char_tokenizer(), spec="ref")
    new = wrap(tiny_model(arch), char_tokenizer(), spec="new")
    r_ref, r_new = BlockRunner(ref, IDS, batch_size=3), BlockRunner(new, IDS, batch_size=3)
    h_ref, h_new = r_ref.capture(), r_new.capture()
    for i in range(ref.adapter.num_blocks):
        prune_block(ref, r_ref, i, h_ref, cfg, 0.5)
        before = r_new.block_evals
        _, outs = prune_block_sequential(new, r_new, i, h_new, cfg, 0.5)
        stages = 1 if cfg.accumulators() is None else len(
            role_groups(new, i, new.adapter.linears(i))) + 1
        assert r_new.block_evals - before == stages * len(r_new.batches)
        for path, m in ref.adapter.linears(i).items():
            torch.testing.assert_close(weight_out_in(new.adapter.linears(i)[path]),
                                       weight_out_in(m), rtol=0, atol=0)
        for a, b in zip(outs, r_new.run_block(i, h_new), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        h_ref, h_new = r_ref.run_block(i, h_ref), outs


def test_one_pass_computes_each_pruned_linear_and_attention_sparingly():
    """On a llama block (2 batches) every linear computes exactly once per batch, with
    its pruned weights (in its own statistics stage it returns a placeholder; later its
    output, or its branch's, is replayed). The attention branch is entered twice per
    batch: the first entry stops at q's input, the second computes attention with o
    returning a placeholder that is then replaced by the pruned o's output."""
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="count")
    runner = BlockRunner(lm, IDS, batch_size=3)
    hidden = runner.capture()
    blk = lm.adapter.block(0)
    calls = {}
    for name, m in [*lm.adapter.linears(0).items(), ("self_attn", blk.self_attn)]:
        def counting(*a, _f=m.forward, _n=name, **k):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*a, **k)
        m.forward = counting
    updates = []

    class Count(SumSquares):
        def update(self, x):
            updates.append(x.shape)
            super().update(x)

    groups = role_groups(lm, 0, lm.adapter.linears(0))
    runner.sequential(0, hidden, groups, lambda n: Count(), lambda g, accs: None,
                      containers=branch_containers(lm, 0))
    nb = len(runner.batches)
    assert calls == {"self_attn": 2 * nb, **{p: nb for p in lm.adapter.linears(0)}}
    assert len(updates) == 4 * nb  # [q,k,v] once, o, [gate,up] once, down
    assert all(m.__dict__.get("forward") is not None for m in blk.modules()
               if m in lm.adapter.linears(0).values())  # instance forwards restored


def test_within_block_dense_calibrates_every_linear_on_the_dense_block():
    """``within_block="dense"``: o's Wanda statistics come from the dense attention, so
    its mask equals Wanda applied to norms collected on the unpruned block; the default
    sequential order gives o a different mask (its inputs come from pruned q/k/v)."""
    dense_lm = wrap(tiny_model("llama"), char_tokenizer(), spec="d")
    runner = BlockRunner(dense_lm, IDS, batch_size=3)
    o = dense_lm.adapter.attn_projections(0)["o"]
    norms = runner.collect(0, runner.capture(), {"o": o}, lambda n: SumSquares())["o"][0]
    w = weight_out_in(o).detach()
    score = w.abs() * norms.sum_sq.sqrt().to(w.dtype)
    expected = w * unstructured_mask(score, 0.5)
    got = {}
    for order in ("dense", "sequential"):
        lm, _ = run("llama", Wanda(sparsity=0.5, within_block=order))
        got[order] = weight_out_in(lm.adapter.attn_projections(0)["o"])
    torch.testing.assert_close(got["dense"], expected, rtol=0, atol=0)
    assert not torch.equal(got["sequential"] != 0, expected != 0)
    with pytest.raises(ConfigError, match="within-block"):
        Wanda(within_block="parallel")


def test_dense_order_with_dense_propagation_takes_one_pass_and_matches_two():
    """``within_block="dense", propagate="dense"``: one dense pass per block gives the
    statistics and the propagated outputs; the weights equal the two-pass route."""
    cfg = Wanda(sparsity=0.5, within_block="dense", propagate="dense")
    lm, rep = run("llama", cfg)
    assert rep["block_evaluations"] == lm.adapter.num_blocks  # one pass, no extra
    ref = wrap(tiny_model("llama"), char_tokenizer(), spec="ref")
    runner = BlockRunner(ref, IDS, batch_size=3)

    def on_block(i, inputs):
        prune_block(ref, runner, i, inputs, cfg, 0.5)

    runner.run(on_block=on_block, propagate="dense")
    for (i, path), w in block_weights(lm).items():
        torch.testing.assert_close(w, weight_out_in(ref.adapter.linears(i)[path]), rtol=0,
                                   atol=0)


@pytest.mark.parametrize("cfg", [SparseGPT(sparsity=0.5), SparseGPT(pattern="2:4"),
                                 SparseGPT(sparsity=0.5, group="layer")],
                         ids=["row", "2:4", "layer"])
def test_linears_sharing_a_gram_pruned_jointly_equal_separate_runs(cfg, monkeypatch):
    """q/k/v (and gate/up) share one Gram; SparseGPT prunes them as one row-stacked
    matrix. Every decision is per row, so the result equals pruning each linear on its own
    (up to float rounding; masks identical). ``group="layer"`` (not per row) keeps
    separate runs, with SparseGPT's joint choice over each column block."""
    from prunelab.calib.stats import Gram
    from prunelab.pruning.sparsity.execute import prune_linear, prune_linears

    model = tiny_model("llama")
    ad = get_adapter(model)
    runner = BlockRunner(model, IDS, batch_size=3)
    runner.capture()
    targets = ad.linears(0)
    accs = runner.collect(0, runner.inputs, targets, lambda n: [Gram(torch.float32)],
                          stop_early=False, share=True)
    attn = ad.spec.attn_proj
    assert accs[attn["q"]][0] is accs[attn["v"]][0]
    alone = {p: torch.nn.Linear(m.in_features, m.out_features, bias=False)
             for p, m in targets.items()}
    for p, m in targets.items():
        alone[p].weight.data.copy_(m.weight.data)
        prune_linear(alone[p], accs[p], cfg, 0.5)
    from prunelab.pruning.sparsity.methods import sparsegpt as methods

    sweeps = []
    real = methods.sparsegpt_prune
    monkeypatch.setattr(methods, "sparsegpt_prune",
                        lambda w, *a, **k: sweeps.append(w.shape[0]) or real(w, *a, **k))
    prune_linears(targets, accs, cfg, 0.5)
    # one sweep per distinct input (q/k/v, o, gate/up, down) unless decided per layer
    assert len(sweeps) == (len(targets) if cfg.group == "layer" else 4)
    for p, m in targets.items():
        assert torch.equal(m.weight == 0, alone[p].weight == 0), p
        torch.testing.assert_close(m.weight, alone[p].weight, rtol=1e-5, atol=1e-6)
        if cfg.group == "layer":  # the whole matrix at 50 %, rows may differ
            assert (m.weight == 0).float().mean() == pytest.approx(0.5, abs=0.02)
