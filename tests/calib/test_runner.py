"""Block-by-block runner: equals a full forward, passes each block its own arguments."""

from __future__ import annotations

import copy

import pytest
import torch

from prunelab.calib.gradients import taylor_terms
from prunelab.calib.runner import BlockRunner, StateStore
from prunelab.calib.stats import Gram, SumSquares
from prunelab.errors import UnsupportedOperationError
from prunelab.models.adapters import get_adapter
from prunelab.models.linear import set_weight_out_in, weight_out_in
from prunelab.models.loading import wrap

from tiny_models import ALL_ARCHS, char_tokenizer, tiny_model, tiny_tokens


def reference_states(model, ids):
    ad = get_adapter(model)
    with torch.no_grad():
        return ad.base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states


def runner_states(model, ids, batch_size=2, **kw):
    ad = get_adapter(model)
    runner = BlockRunner(model, ids, batch_size=batch_size, **kw)
    store = StateStore("memory")
    last = runner.run(states=store)
    states = [torch.cat(store.get(i)) for i in range(ad.num_blocks)]
    final = torch.cat(last)
    norm = ad.final_norm()
    with torch.no_grad():
        states.append(norm(final) if norm is not None else final)
    return states, runner


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_runner_equals_output_hidden_states(arch):
    model = tiny_model(arch)
    ids = tiny_tokens(4, 12)
    ref = reference_states(model, ids)
    got, runner = runner_states(model, ids)
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert runner.block_evals == 2 * 4 and runner.passes == 1.0


def test_gemma3_blocks_get_their_own_masks():
    """Sliding-window blocks get the sliding mask: running the full-attention block 2
    with block 0's (sliding) arguments gives a different output."""
    model = tiny_model("gemma3_text")
    ids = tiny_tokens(2, 16)  # longer than the sliding window (6)
    runner = BlockRunner(model, ids, batch_size=2)
    store = StateStore("memory")
    runner.run(states=store)
    h2 = store.get(2)
    own = runner.run_block(2, h2)
    wrong = runner.run_block(2, h2, args_from=0)
    torch.testing.assert_close(own[0], store.get(3)[0])
    assert (own[0] - wrong[0]).abs().max() > 1e-4


def test_gemma3_runner_after_deletion_matches_full_model():
    model = tiny_model("gemma3_text")
    ids = tiny_tokens(2, 16)
    get_adapter(model).delete_blocks([1])
    ref = reference_states(model, ids)
    got, _ = runner_states(model, ids)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_collect_feeds_linear_inputs_and_stops_early():
    model = tiny_model("llama")
    ids = tiny_tokens(4, 12)
    ad = get_adapter(model)
    runner = BlockRunner(model, ids, batch_size=3)
    runner.capture()
    hidden = runner.inputs
    q = ad.attn_projections(0)["q"]
    accs = runner.collect(0, hidden, {"q": q}, lambda name: [SumSquares(), Gram()])
    ss, gram = accs["q"]
    with torch.no_grad():
        x = ad.block(0).input_layernorm(torch.cat(hidden)).reshape(-1, 32).double()
    torch.testing.assert_close(ss.sum_sq, (x * x).sum(0))
    torch.testing.assert_close(gram.xtx, x.t() @ x)
    assert ss.tokens == 48 and ss.rows == 4
    # stop_early changes cost, never results
    down = ad.mlp_projections(0)["down"]
    full = runner.collect(0, hidden, {"q": q, "down": down}, lambda n: SumSquares(),
                          stop_early=False)
    early = runner.collect(0, hidden, {"q": q, "down": down}, lambda n: SumSquares())
    for name in ("q", "down"):
        torch.testing.assert_close(full[name][0].sum_sq, early[name][0].sum_sq)
    # no hook survives
    assert not q._forward_pre_hooks and not down._forward_pre_hooks


class _Counting(SumSquares):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def update(self, x):
        self.log.append(id(self))
        super().update(x)


def test_collect_share_updates_one_set_per_shared_input():
    model = tiny_model("llama")
    ad = get_adapter(model)
    runner = BlockRunner(model, tiny_tokens(4, 12), batch_size=2)
    runner.capture()
    targets = ad.linears(1)
    log: list[int] = []
    shared = runner.collect(1, runner.inputs, targets, lambda n: [_Counting(log)],
                            share=True, stop_early=False)
    alone = runner.collect(1, runner.inputs, targets, lambda n: [SumSquares()])
    attn, mlp = ad.spec.attn_proj, ad.spec.mlp_proj
    # q/k/v read one tensor, gate/up another: 4 distinct inputs, each updated once a batch
    assert shared[attn["q"]][0] is shared[attn["k"]][0] is shared[attn["v"]][0]
    assert shared[mlp["gate"]][0] is shared[mlp["up"]][0]
    assert shared[attn["o"]][0] is not shared[attn["q"]][0]
    assert len({id(a[0]) for a in shared.values()}) == 4 and len(log) == 4 * 2
    assert shared[attn["q"]] is not shared[attn["k"]]  # each name owns its list
    for name in targets:
        torch.testing.assert_close(shared[name][0].sum_sq, alone[name][0].sum_sq,
                                   rtol=0, atol=0)


def test_hooks_removed_when_accumulator_fails():
    model = tiny_model("llama")
    runner = BlockRunner(model, tiny_tokens(2, 8), batch_size=2)
    runner.capture()
    q = get_adapter(model).attn_projections(0)["q"]

    class Boom(SumSquares):
        def update(self, x):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        runner.collect(0, runner.inputs, {"q": q}, lambda n: Boom())
    assert not q._forward_pre_hooks


@pytest.mark.parametrize("propagate", ["dense", "modified"])
def test_propagate_dense_or_modified(propagate):
    model = tiny_model("llama")
    ids = tiny_tokens(2, 12)
    modified = copy.deepcopy(model)
    with torch.no_grad():
        get_adapter(modified).mlp_projections(1)["down"].weight.zero_()
    expected_model = model if propagate == "dense" else modified
    expected = reference_states(expected_model, ids)[-1]

    def on_block(i, inputs):
        if i == 1:
            with torch.no_grad():
                get_adapter(model).mlp_projections(1)["down"].weight.zero_()

    runner = BlockRunner(model, ids, batch_size=2)
    last = torch.cat(runner.run(on_block=on_block, propagate=propagate))
    with torch.no_grad():
        got = get_adapter(model).final_norm()(last)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert runner.block_evals == 4  # one batch x four blocks, either way


def test_disk_store_and_offload_give_same_states():
    model = tiny_model("qwen3")
    ids = tiny_tokens(4, 10)
    mem, _ = runner_states(model, ids)
    runner = BlockRunner(model, ids, batch_size=2, offload=True, device="cpu")
    store = StateStore("disk")
    try:
        runner.run(states=store)
        assert store.boundaries() == list(range(5))
        for i in range(4):
            torch.testing.assert_close(torch.cat(store.get(i)), mem[i])
    finally:
        store.close()
    assert not store._dir.exists()


def test_offload_moves_each_block_once_per_turn_even_when_on_block_collects():
    """``run`` holds block i on the device while ``on_block`` works (its statistics
    passes and the method's maths); nested ``collect`` / ``run_block`` do not send it back
    to the CPU in between. Moves are counted on the CPU by wrapping ``Module.to``."""
    model = tiny_model("llama")
    ad = get_adapter(model)
    runner = BlockRunner(model, tiny_tokens(4, 10), batch_size=2, offload=True, device="cpu")
    runner.capture()
    moves: list[tuple[int, str]] = []
    for i in range(ad.num_blocks):
        blk = ad.block(i)
        real = blk.to

        def to(*args, _i=i, _real=real, **kwargs):
            moves.append((_i, "back" if isinstance(args[0], str) else "device"))
            return _real(*args, **kwargs)

        blk.to = to
    seen = []

    def on_block(i, inputs):
        q = ad.attn_projections(i)["q"]
        runner.collect(i, inputs, {"q": q}, lambda n: SumSquares())
        runner.run_block(i, inputs)
        seen.append(i in {j for j, _ in moves} and id(ad.block(i)) in runner._held)

    runner.run(on_block=on_block)
    assert all(seen) and not runner._held
    for i in range(ad.num_blocks):
        mine = [d for j, d in moves if j == i]
        # on_block's turn (collect and run_block nested inside), then the run_block that
        # propagates: every entry sends it to the device (a no-op for what is there), only
        # the two outermost exits bring it back
        assert mine == ["device", "device", "device", "back", "device", "back"], (i, mine)


# ---------------------------------------------------------------- sequential mode
def _containers(ad, i):
    return [m for m in (ad.attention(i), ad.mlp(i)) if m is not None]


def _change(group, accs):
    """A change that depends on every bit of the statistics: a Wanda-style half mask from
    the input norms (Sun et al. 2023) plus a small Gram-dependent term."""
    for name, m in group.items():
        ss, gram = accs[name]
        w = weight_out_in(m).detach()
        score = w.abs() * ss.sum_sq.sqrt().to(w.dtype)
        keep = score >= score.median(dim=1, keepdim=True).values
        g = gram.xtx.to(w.dtype)
        set_weight_out_in(m, w * keep + 1e-3 * (w @ g) / g.trace())


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "gpt_neox", "opt", "bert",
                                  "phi3"])
def test_sequential_equals_group_by_group_full_passes(arch):
    """What ``sequential`` promises: the same weights and outputs, bit for bit, as
    changing the block group by group with a plain full pass per group (unshared
    statistics), at (groups + 1) partial passes."""
    ref, new = tiny_model(arch), tiny_model(arch)
    ids = tiny_tokens(6, 12)
    r_ref, r_new = BlockRunner(ref, ids, batch_size=4), BlockRunner(new, ids, batch_size=4)
    h_ref, h_new = r_ref.capture(), r_new.capture()
    ad_ref, ad_new = get_adapter(ref), get_adapter(new)

    def make(_name):
        return [SumSquares(), Gram()]

    for i in range(ad_new.num_blocks):
        for group in ad_ref.linear_groups(i):
            _change(group, r_ref.collect(i, h_ref, group, make, stop_early=False))
        groups = ad_new.linear_groups(i)
        before = r_new.block_evals
        outs = r_new.sequential(i, h_new, groups, make,
                                lambda g, accs, _gs=groups: _change(_gs[g], accs),
                                containers=_containers(ad_new, i))
        assert r_new.block_evals - before == (len(groups) + 1) * len(r_new.batches)
        for path, m in ad_ref.linears(i).items():
            assert torch.equal(weight_out_in(ad_new.linears(i)[path]), weight_out_in(m)), path
        h_ref = r_ref.run_block(i, h_ref)
        for a, b, c in zip(outs, r_new.run_block(i, h_new), h_ref, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
        h_new = outs
    for blk in ad_new.blocks():  # no hook or replaced forward survives
        assert all(not m._forward_hooks and not m._forward_pre_hooks
                   and "forward" not in m.__dict__ for m in blk.modules())


def test_sequential_without_statistics_is_one_pass():
    model = tiny_model("llama")
    ad = get_adapter(model)
    runner = BlockRunner(model, tiny_tokens(4, 10), batch_size=2)
    hidden = runner.capture()
    seen = []
    outs = runner.sequential(0, hidden, ad.linear_groups(0), None,
                             lambda g, accs: seen.append((g, accs)),
                             containers=_containers(ad, 0))
    assert seen == [(0, {}), (1, {}), (2, {}), (3, {})] and runner.block_evals == 2
    for a, b in zip(outs, runner.run_block(0, hidden), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- Taylor terms
def _taylor_reference(model, ids, modules, batch_size):
    """The whole model's autograd: one forward and backward per batch, the gradient at
    each linear's output read by a full backward hook."""
    saved, terms = {}, {}

    def fwd(name):
        return lambda _m, inputs, _out: saved.__setitem__(name, inputs[0].detach())

    def bwd(name):
        def hook(_m, _gin, gout):
            x = saved.pop(name).reshape(-1, saved_dim[name]).double()
            g = gout[0].reshape(-1, gout[0].shape[-1]).double()
            t = (x * g.pow(2).sum(-1, keepdim=True)).t() @ x
            terms[name] = t if name not in terms else terms[name] + t
        return hook

    saved_dim = {n: weight_out_in(m).shape[1] for n, m in modules.items()}
    handles = [h for n, m in modules.items() for h in (m.register_forward_hook(fwd(n)),
                                                      m.register_full_backward_hook(bwd(n)))]
    try:
        for batch in ids.split(batch_size):
            logits = model(input_ids=batch, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            (-logp.gather(-1, batch[:, 1:, None]).sum()).backward()
    finally:
        for h in handles:
            h.remove()
    return terms


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt2", "gpt_neox", "phi3"])
def test_taylor_terms_equal_whole_model_autograd(arch):
    """Block-by-block backward sweep == the whole model's autograd (gemma2: soft-capped
    logits and post-norms; gpt_neox: parallel residual; gpt2: Conv1D)."""
    ids = tiny_tokens(6, 12)
    lm = wrap(tiny_model(arch), char_tokenizer(), spec=arch)
    ad = lm.adapter
    mods = {f"{i}:{p}": m for i in (0, 2) for p, m in ad.linears(i).items()}
    got = taylor_terms(lm, ids, mods, batch_size=4)
    assert all(p.grad is None for p in lm.model.parameters())  # no parameter gradients
    ref_model = tiny_model(arch)
    rad = get_adapter(ref_model)
    ref = _taylor_reference(ref_model, ids, {f"{i}:{p}": m for i in (0, 2)
                                             for p, m in rad.linears(i).items()}, 4)
    assert list(got) == list(mods)
    for name in mods:
        assert got[name].dtype == torch.float64 and got[name].shape == ref[name].shape
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=0)


def test_taylor_terms_offload_keeps_the_model_on_the_cpu():
    """With an offloading model only single blocks, the final norm and the head move
    (never the whole model), and the terms are the same."""
    ids = tiny_tokens(4, 10)
    plain = wrap(tiny_model("llama"), char_tokenizer(), spec="p")
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="o")
    lm.offload_to = torch.device("cpu")
    ad = lm.adapter
    moved = []
    for name, module in [("model", lm.model), *((f"block{i}", ad.block(i)) for i in range(4)),
                         ("head", ad.head()), ("norm", ad.final_norm())]:
        def to(*args, _n=name, _real=module.to, **kwargs):
            moved.append(_n)
            return _real(*args, **kwargs)
        module.to = to
    mods = {f"{i}:{p}": m for i in range(4) for p, m in ad.linears(i).items()}
    got = taylor_terms(lm, ids, mods, batch_size=2)
    want = taylor_terms(plain, ids, {f"{i}:{p}": m for i in range(4)
                                     for p, m in plain.adapter.linears(i).items()},
                        batch_size=2)
    assert "model" not in moved and {"head", "norm"} <= set(moved)
    assert all(moved.count(f"block{i}") == 4 for i in range(4))  # forward and backward turn
    for name in mods:
        assert torch.equal(got[name], want[name])


def test_taylor_terms_need_a_head_and_block_modules():
    bert = wrap(tiny_model("bert"), char_tokenizer(), spec="b")
    with pytest.raises(UnsupportedOperationError, match="no LM head"):
        taylor_terms(bert, tiny_tokens(2, 8), {})
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="l")
    with pytest.raises(ValueError, match="head not inside a block"):
        taylor_terms(lm, tiny_tokens(2, 8), {"head": lm.adapter.head()})


def test_low_precision_linears_round_only_the_matmuls():
    from prunelab.calib.runner import low_precision_linears

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    exact = lin(x)
    with low_precision_linears(torch.nn.Sequential(lin), torch.bfloat16):
        got = lin(x)
        assert lin.weight.dtype == torch.float32  # the weights keep their dtype
    want = torch.nn.functional.linear(x.bfloat16(), lin.weight.bfloat16(),
                                      lin.bias.bfloat16()).float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.equal(got, exact)  # bfloat16 rounding shows
    assert torch.equal(lin(x), exact) and "forward" not in lin.__dict__  # restored
    with low_precision_linears(torch.nn.Sequential(lin), None):  # float32: untouched
        assert torch.equal(lin(x), exact)


def test_bfloat16_calibration_keeps_float32_statistics_and_weights():
    """Wanda with bfloat16 matmuls: the first block's q/k/v see exactly the float32
    inputs (embeddings and a float32 norm), so their statistics and masks are those of the
    float32 run; later inputs pass bfloat16 matmuls and stay close. Weights stay float32."""
    import prunelab
    from prunelab import Wanda
    calib = _calib8()
    runs = {}
    for dtype in ("float32", "bfloat16"):
        lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
        rep = prunelab.prune(lm, Wanda(sparsity=0.5), calib, batch_size=4, calib_dtype=dtype)
        runs[dtype] = (lm, rep)
        assert lm.calib_dtype is None  # set for the call only
    (a, _), (b, rep) = runs["float32"], runs["bfloat16"]
    assert b.history[-1]["calib_dtype"] == "bfloat16" and "calib_dtype" not in a.history[-1]
    wa, wb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(p.dtype == torch.float32 for p in wb.values())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(wa[q] == 0, wb[q] == 0)
    masks = [(wa[n] == 0) == (wb[n] == 0) for n in wa if n.endswith("proj.weight")]
    agree = torch.cat([m.flatten() for m in masks]).float().mean().item()
    assert 0.95 < agree <= 1.0, agree


def test_calib_dtype_is_checked_in_one_line():
    from prunelab.errors import ConfigError
    from prunelab.models.loading import resolve_calib_dtype

    assert resolve_calib_dtype("bfloat16") is torch.bfloat16
    assert resolve_calib_dtype("float32") is None
    with pytest.raises(ConfigError, match="--calib-dtype must be float32 or bfloat16"):
        resolve_calib_dtype("float16")


def test_low_precision_linears_leave_replaced_forwards_alone():
    """The sequential runner replaces some linears' forwards (replay, placeholders): the
    bfloat16 context must neither override nor remove them."""
    from prunelab.calib.runner import low_precision_linears

    lin = torch.nn.Linear(4, 4)
    lin.forward = lambda x: torch.full((x.shape[0], 4), 7.0)
    with low_precision_linears(torch.nn.Sequential(lin), torch.bfloat16):
        assert torch.equal(lin(torch.zeros(2, 4)), torch.full((2, 4), 7.0))
    assert torch.equal(lin(torch.zeros(2, 4)), torch.full((2, 4), 7.0))


def test_bfloat16_sparsegpt_runs_its_sequential_replay():
    """SparseGPT's sequential runner with bfloat16 matmuls: weights stay float32, and the
    first block's q mask is that of the float32 run; its update is close (the Gram is
    that of the bfloat16-rounded inputs, products exact, sums in float32)."""
    import prunelab
    from prunelab import SparseGPT
    calib = _calib8()
    got = {}
    for dtype in ("float32", "bfloat16"):
        lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
        rep = prunelab.prune(lm, SparseGPT(sparsity=0.5), calib, batch_size=4,
                             calib_dtype=dtype)
        got[dtype] = (lm, rep)
    (a, _), (b, _) = got["float32"], got["bfloat16"]
    assert all(p.dtype == torch.float32 for p in b.model.parameters())
    wa, wb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(wa[q] == 0, wb[q] == 0)  # same float32 inputs, same first mask
    assert (wa[q] - wb[q]).abs().max() < 1e-2 * wa[q].abs().max()


def _calib8():
    from prunelab.data import TokenBatches

    return TokenBatches(input_ids=tiny_tokens(8, 16), spec="tiny", seqlen=16, samples=8,
                        seed=0, mode="calib", total_windows=8, sha256="0")


def test_low_precision_cache_converts_a_weight_once_until_it_changes():
    """bfloat16 calibration converts each weight once per block, not once per batch: the
    cached copy is reused while the weight is unchanged, made again after an in-place
    change (a pruning step), and dropped when another block runs; an input read by
    several linears is converted once."""
    from prunelab.calib.runner import LowPrecisionCache, low_precision_linears

    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2)
    block = torch.nn.ModuleList([a, b])
    cache = LowPrecisionCache().for_block(block)
    x = torch.randn(5, 4)
    with low_precision_linears(block, torch.bfloat16, cache):
        ya = a(x)
        xb = cache.last[2]
        b(x)
        assert cache.last[2] is xb  # the shared input converted once
    first = cache.weights[id(a)][3]
    with low_precision_linears(block, torch.bfloat16, cache):
        torch.testing.assert_close(a(x), ya, rtol=0, atol=0)
    assert cache.weights[id(a)][3] is first and cache.last is None
    with torch.no_grad():
        set_weight_out_in(a, torch.zeros(3, 4))
    with low_precision_linears(block, torch.bfloat16, cache):
        assert torch.equal(a(x), a.bias.bfloat16().float().expand(5, 3))
    assert cache.weights[id(a)][3] is not first
    assert cache.for_block(torch.nn.Linear(1, 1)).weights == {}


def test_shared_grams_equal_per_matrix_grams():
    """q/k/v and gate/up read one tensor each: with ``share=True`` one ``X^T X`` per
    distinct input (4 per block, not 7), equal to each matrix's own Gram."""
    model = tiny_model("llama")
    ad = get_adapter(model)
    runner = BlockRunner(model, tiny_tokens(4, 12), batch_size=2)
    runner.capture()
    targets = ad.linears(1)
    shared = runner.collect(1, runner.inputs, targets, lambda n: [Gram(torch.float32)],
                            share=True, stop_early=False)
    alone = runner.collect(1, runner.inputs, targets, lambda n: [Gram(torch.float32)])
    assert len({id(a[0]) for a in shared.values()}) == 4 < len(targets) == 7
    for name in targets:
        torch.testing.assert_close(shared[name][0].xtx, alone[name][0].xtx, rtol=0, atol=0)
