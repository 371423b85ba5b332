"""Depth pruning: selection invariants, closed-form recovery, checkpoints, sweep."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.lstsq import NormalEquations
from prunelab.models.bridges import LinearBridge, fit_bridge
from prunelab.models.loading import wrap
from prunelab.pruning import (
    METHODS,
    RECOVERIES,
    STRATEGIES,
    Beam,
    Blend,
    Depth,
    Ghost,
    Lra,
    depth_from_cli,
)
from prunelab.pruning.depth import selection as sel
from prunelab.registry import to_dict
from prunelab.workflow.sweep import parse_range, sweep_depth

from tiny_models import char_tokenizer, tiny_config, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def pruned(arch="llama", **cfg):
    lm = wrap(tiny_model(arch), char_tokenizer(), spec=f"tiny-{arch}")
    report = prunelab.prune(lm, Depth(**cfg), CALIB, batch_size=2)
    return lm, report


# ---------------------------------------------------------------- pure maths
def test_ghost_fit_recovers_a_linear_map():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64)
    xs = [torch.randn(3, 10, 6, generator=g, dtype=torch.float64) for _ in range(2)]
    fit = fit_bridge(xs, [x @ a for x in xs], "ghost", ridge=0.0)[0]
    torch.testing.assert_close(fit["weight"], a)


def test_lra_fit_recovers_affine_map_and_full_rank_equals_full():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 5, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64)
    xs = [torch.randn(2, 20, 5, generator=g, dtype=torch.float64)]
    ys = [xs[0] @ a + b]
    full = fit_bridge(xs, ys, "lra", ridge=0.0)[0]
    torch.testing.assert_close(full["weight"], a)
    torch.testing.assert_close(full["bias"], b)
    low = fit_bridge(xs, ys, "lra", rank=5, ridge=0.0)[0]
    torch.testing.assert_close(torch.eye(5, dtype=torch.float64) + low["down"] @ low["up"], a)
    one = fit_bridge(xs, ys, "lra", rank=1, ridge=0.0)[0]
    assert one["down"].shape == (5, 1) and one["up"].shape == (1, 5)


def test_token_aware_bridge_uses_first_map_at_position_zero():
    bridge = LinearBridge(2, token_aware=True)
    with torch.no_grad():
        bridge.weight.copy_(2 * torch.eye(2))
        bridge.first_weight.copy_(-torch.eye(2))
    x = torch.ones(1, 3, 2)
    first = torch.tensor([[True, False, False]])
    assert bridge(x, first)[0].tolist() == [[-1, -1], [2, 2], [2, 2]]


def test_normal_equations_ridge_solution():
    eq = NormalEquations()
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    eq.update(x, torch.tensor([[3.0], [4.0]]))
    torch.testing.assert_close(eq.solve(0.0), torch.tensor([[3.0], [2.0]], dtype=torch.float64))


# ---------------------------------------------------------------- selection
@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=4, max_size=30), st.data())
def test_no_adjacent_never_adjacent(values, data):
    n = data.draw(st.integers(1, (len(values) + 1) // 2))
    try:
        chosen = sel.no_adjacent(values, n)
    except ConfigError:
        return  # greedy may get stuck; it must then say so, never return adjacent blocks
    assert len(chosen) == n and all(b - a > 1 for a, b in zip(chosen, chosen[1:], strict=False))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=3, max_size=30), st.data())
def test_span_is_contiguous_and_optimal(values, data):
    n = data.draw(st.integers(1, len(values) - 1))
    span = sel.best_span(values, n)
    assert span == list(range(span[0], span[0] + n))
    best = min(sum(values[s:s + n]) for s in range(len(values) - n + 1))
    assert sum(values[b] for b in span) == pytest.approx(best)


def test_baselines_and_blend():
    assert sel.random_blocks(30, 6, seed=3) == sel.random_blocks(30, 6, seed=3)
    assert sel.random_blocks(30, 6, seed=3) != sel.random_blocks(30, 6, seed=4)
    assert sel.last_n(30, 3) == [26, 27, 28]
    assert sel.one_shot([0.3, 0.1, None, 0.2], 2) == [1, 3]
    # ranks a: 2,0,1,3 ; b: 0,3,1,2 -> averages 1,1.5,1,2.5
    assert sel.blend([0.5, 0.1, 0.2, 0.9], [0.0, 0.8, 0.3, 0.4], 2) == [0, 2]
    assert sel.contiguous_spans([7, 3, 4]) == [(3, 5), (7, 8)]
    assert sel.span_from_scores([{"layers": [2, 4], "value": 0.1},
                                 {"layers": [0, 2], "value": 0.3}], 2) == [2, 3]
    with pytest.raises(ConfigError, match="cannot remove"):
        sel.one_shot([0.1, 0.2], 2)


def test_depth_config_validation():
    with pytest.raises(ConfigError, match="exactly one"):
        Depth()
    with pytest.raises(ConfigError, match="recovery"):
        Depth(remove=1, recovery="magic")
    with pytest.raises(ConfigError, match="rank"):
        depth_from_cli(remove=1, recovery="ghost", rank=4)
    with pytest.raises(ConfigError, match="unknown probe"):
        Depth(remove=1, probe="nope")
    with pytest.raises(ConfigError, match="strategy"):
        Depth(remove=1, strategy="greedy")


def test_names_and_typed_configs_are_one_config_and_round_trip():
    typed = Depth(remove=3, select=Beam(width=3, seeds=12, score="kl"),
                  recovery=Ghost(token_aware=False))
    assert Depth(remove=3, strategy="beam", recovery="ghost") == typed
    assert Depth(remove=3, select="beam", recovery="ghost") == typed
    assert to_dict(typed)["select"] == {"name": "beam", "width": 3, "seeds": 12,
                                        "score": "kl"}
    assert to_dict(typed)["recovery"] == {"name": "ghost", "token_aware": False,
                                          "ridge": 1e-6}
    for cfg in (typed, Depth(remove=2), Depth(blocks=(3, 1), recovery=Lra(rank=8)),
                Depth(target_params=0.7, select=Blend(probe="interchange"), seed=4),
                Depth(remove=1, probe="interchange", from_probe="p/interchange.json")):
        again = METHODS.from_dict(json.loads(json.dumps(to_dict(cfg))))
        assert again == cfg and type(again.recovery) is type(cfg.recovery)
    assert Depth(blocks=[3, 1]).blocks == (3, 1)
    with pytest.raises(ConfigError, match="'rnk'.*valid options: token_aware, ridge, rank"):
        METHODS.from_dict({"name": "depth", "remove": 1, "recovery": {"name": "lra",
                                                                      "rnk": 2}})
    assert STRATEGIES.names() == ["one-shot", "no-adjacent", "span", "iterative", "beam",
                                  "sleb", "blend", "last-n", "random", "validation"]
    assert RECOVERIES.names() == ["none", "foldable", "boundary", "ghost", "lra"]


def test_depth_from_cli_maps_flat_options_and_refuses_foreign_ones():
    cfg = depth_from_cli(remove=3, strategy="beam", beam_width=2, beam_seeds=5,
                         beam_score="perplexity", recovery="lra", rank=8, token_aware=True,
                         blend_probe=None, window=1, seed=0, blocks=())
    assert cfg == Depth(remove=3, select=Beam(width=2, seeds=5, score="perplexity"),
                        recovery=Lra(rank=8, token_aware=True))
    assert depth_from_cli(remove=2, strategy="blend", blend_probe="interchange").select == \
        Blend(probe="interchange")
    assert depth_from_cli(remove=2, token_aware=False, rank=None) == Depth(remove=2)
    for flat, message in (
            ({"strategy": "one-shot", "beam_width": 3}, "--beam-width applies to --strategy "
                                                        "beam only"),
            ({"beam_seeds": 4}, "--beam-seeds applies to --strategy beam only"),
            ({"recovery": "ghost", "rank": 4}, "--rank applies to --recovery lra only"),
            ({"recovery": "foldable", "token_aware": True}, "--token-aware applies to "
                                                            "--recovery ghost or lra only"),
            ({"recovery": "none", "ridge": 0.1}, "--ridge applies to --recovery foldable or "
                                                 "boundary or ghost or lra only"),
            ({"windw": 2}, "no option 'windw'")):
        with pytest.raises(ConfigError, match=message):
            depth_from_cli(remove=1, **flat)


def test_conflicting_depth_options_are_errors():
    for kwargs in ({"blocks": (1,), "remove": 2}, {"blocks": (1,), "target_params": 0.5},
                   {"remove": 1, "target_params": 0.5}):
        with pytest.raises(ConfigError, match="exactly one of remove"):
            Depth(**kwargs)
    with pytest.raises(ConfigError, match="--blocks.*--strategy"):
        Depth(blocks=(1,), strategy="beam")
    with pytest.raises(ConfigError, match="--blocks.*--from-probe"):
        Depth(blocks=(1,), from_probe="x.json")
    with pytest.raises(ConfigError, match="not both"):
        Depth(remove=1, strategy="beam", select="span")
    for make in (lambda: Beam(width=0), lambda: Beam(score="nll"), lambda: Lra(rank=0),
                 lambda: Blend(probe="nope"), lambda: Ghost(ridge=float("nan"))):
        with pytest.raises(ConfigError):
            make()


def test_a_strategy_and_a_recovery_registered_from_outside(tmp_path):
    """A selection strategy and a recovery written in this file run through prunelab.prune
    and the manifest rebuilds the config."""
    from dataclasses import dataclass

    from prunelab.pruning import Recovery, Strategy
    from prunelab.pruning.depth.recoveries.base import cut_error

    @STRATEGIES.register("first-n")
    @dataclass(frozen=True)
    class FirstN(Strategy):
        offset: int = 1

        def choose(self, job):
            return list(range(self.offset, self.offset + job.n)), {"strategy": "first-n"}

    @RECOVERIES.register("measure-only")
    @dataclass(frozen=True)
    class MeasureOnly(Recovery):
        def at_block(self, runner, index, inputs, targets):
            err = cut_error(runner.run_block(index, inputs), targets)
            return {"error_before": err, "error_after": err}

    try:
        cfg = Depth(remove=2, select=FirstN(offset=1), recovery="measure-only")
        lm, rep = pruned(**{"remove": 2, "select": FirstN(offset=1),
                            "recovery": "measure-only"})
        assert rep["removed_blocks"] == [1, 2] and rep["selection"] == {"strategy": "first-n"}
        (cut,) = rep["cuts"]
        assert cut["span"] == [1, 3] and cut["error_before"] == cut["error_after"] > 0
        assert rep["calib_kl_after_recovery"] == rep["calib_kl_before_recovery"]
        out = prunelab.save(lm, tmp_path / "ckpt")
        man = json.loads((out / "manifest.json").read_text())
        assert METHODS.from_dict(man["operations"][-1]["config"]) == cfg
    finally:
        STRATEGIES.unregister("first-n")
        RECOVERIES.unregister("measure-only")


def test_target_params_fraction_gives_block_count():
    lm, rep = pruned(target_params=0.8, recovery="none")
    per_block = 7744  # one tiny llama block
    total = rep["size_before"]["params"]
    n = len(rep["removed_blocks"])
    assert total - n * per_block <= 0.8 * total < total - (n - 1) * per_block


@pytest.mark.parametrize("strategy", ["one-shot", "iterative", "beam", "blend", "span",
                                      "last-n", "random", "no-adjacent"])
def test_every_strategy_runs(strategy):
    probe = "interchange" if strategy == "no-adjacent" else "block-influence"
    select = Beam(seeds=3) if strategy == "beam" else strategy
    lm, rep = pruned(remove=2, select=select, probe=probe)
    assert len(rep["removed_blocks"]) == 2 and lm.adapter.num_blocks == 2
    if strategy == "span":
        a, b = rep["removed_blocks"]
        assert b == a + 1


# ---------------------------------------------------------------- surgery and recovery
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_prune_equals_manually_built_shorter_model(arch):
    lm, rep = pruned(arch, blocks=(1,), recovery="none")
    cfg = tiny_config(arch)
    cfg.num_hidden_layers = 3
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [t for i, t in enumerate(cfg.layer_types) if i != 1]
    manual = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    dense = tiny_model(arch).state_dict()
    prefix = "transformer.h." if arch == "gpt2" else "model.layers."
    state = {}
    for k, v in dense.items():
        if k.startswith(prefix):
            idx, rest = k[len(prefix):].split(".", 1)
            if int(idx) == 1:
                continue
            k = f"{prefix}{int(idx) - (int(idx) > 1)}.{rest}"
        state[k] = v
    manual.load_state_dict(state, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(lm.model(input_ids=IDS).logits, manual(input_ids=IDS).logits,
                                   rtol=0, atol=1e-6)
    assert rep["removed_blocks"] == [1] and rep["kept_blocks"] == [0, 2, 3]


CASES = [("llama", "foldable"), ("llama", "boundary"), ("llama", "ghost"), ("llama", "lra"),
         ("llama", Lra(rank=4)), ("llama", Ghost(token_aware=True)), ("gpt2", "foldable"),
         ("opt", "boundary"), ("gpt_neox", "foldable"), ("gemma3_text", "ghost"),
         ("qwen3", "boundary")]


@pytest.mark.parametrize(("arch", "recovery"), CASES, ids=str)
def test_recovery_reduces_error_at_the_cut(arch, recovery):
    lm, rep = pruned(arch, blocks=(1, 2), recovery=recovery)
    (cut,) = rep["cuts"]
    assert cut["span"] == [1, 3]
    assert cut["error_after"] < 0.9 * cut["error_before"]
    assert rep["calib_kl_after_recovery"] < rep["calib_kl_before_recovery"]


def test_recovery_at_block_zero_and_refusals():
    lm, rep = pruned(blocks=(0,), recovery="ghost")
    assert rep["cuts"][0]["after"] == "embeddings"
    assert rep["cuts"][0]["error_after"] < rep["cuts"][0]["error_before"]
    with pytest.raises(UnsupportedOperationError, match="kept block before"):
        pruned(blocks=(0,), recovery="foldable")
    with pytest.raises(UnsupportedOperationError, match="ghost or lra"):
        pruned("gemma3_text", blocks=(2,), recovery="boundary")


@pytest.mark.parametrize("recovery", ["foldable", "boundary"])
def test_vanilla_recoveries_reload_with_plain_transformers(recovery, tmp_path):
    lm, rep = pruned(blocks=(1, 3), recovery=recovery)
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(again).__name__ == "LlamaForCausalLM" and again.config.num_hidden_layers == 2
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, lm.model(input_ids=IDS).logits,
                                   rtol=0, atol=0)
    man = json.loads((out / "manifest.json").read_text())
    assert man["operations"][-1]["removed_blocks"] == [1, 3]
    assert man["loads_with"].startswith("plain")


@pytest.mark.parametrize(("arch", "recovery"),
                         [("llama", "ghost"), ("llama", Lra(rank=3, token_aware=True)),
                          ("gemma3_text", "lra"), ("gpt2", Ghost(token_aware=True))], ids=str)
def test_bridged_checkpoints_reload_with_remote_code(arch, recovery, tmp_path):
    lm, rep = pruned(arch, blocks=(0, 2), recovery=recovery)
    assert rep["needs_remote_code"]
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                    attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS).logits, lm.model(input_ids=IDS).logits,
                                   rtol=0, atol=0)
    man = json.loads((out / "manifest.json").read_text())
    assert man["remote_code"]["trust_remote_code"] and len(man["remote_code"]["bridges"]) == 2
    with pytest.raises(Exception, match="trust_remote_code|custom code"):
        tf.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)
    # prunelab itself loads it back (family from the prefixed model_type)
    back = prunelab.load(str(out), trust_remote_code=True)
    assert back.adapter.num_blocks == 2


# ---------------------------------------------------------------- sweep
def test_sweep_is_resumable(tmp_path, monkeypatch):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    test_ids = tiny_tokens(2, 12, seed=9)
    points = sweep_depth(lm, ["block-influence", "last-n"], [1, 2], ["none", "ghost"], IDS,
                         test_ids, tmp_path, batch_size=2)
    assert len(points) == 8
    for name in ("curve.csv", "curve.md", "curve.png", "points.json", "dense.json"):
        assert (tmp_path / name).is_file()
    assert all(p["test_perplexity"] > 1 and p["test_kl"] >= 0 for p in points)
    assert lm.adapter.num_blocks == 4  # the dense model is never modified

    def boom(*a, **k):
        raise AssertionError("a finished point was redone")

    import sys

    monkeypatch.setattr(sys.modules["prunelab.workflow.sweep"], "_run_point", boom)
    again = sweep_depth(lm, ["block-influence", "last-n"], [1, 2], ["none", "ghost"], IDS,
                        test_ids, tmp_path, batch_size=2)
    assert again == points
    assert parse_range("remove-blocks:1..3") == [1, 2, 3]
    assert parse_range("remove-blocks:4,2") == [2, 4]
    for bad in ("x", "1..3", "keep-params:0.8", "remove-blocks:0..2", "remove-blocks:3..1"):
        with pytest.raises(ConfigError):
            parse_range(bad)


def test_dense_model_unchanged_by_sweep(tmp_path):
    model = tiny_model("llama")
    before = copy.deepcopy(model.state_dict())
    lm = wrap(model, char_tokenizer())
    sweep_depth(lm, ["random"], [1], ["lra"], IDS, tiny_tokens(2, 12), tmp_path, batch_size=2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
