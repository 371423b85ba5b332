"""CascadeFlow: accumulated block gradient norms equal a hand computation on a two-block
model; the gradient-flow probe leaves the weights alone and drives depth pruning; blocks
are removed during healing; the fan-in profile's correlations."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from prunelab.errors import UnsupportedOperationError
from prunelab.heal import FlowAccumulator, HealConfig, fan_in_profile, heal
from prunelab.models.loading import wrap
from prunelab.probes import run_probes
from prunelab.pruning import Depth
from prunelab.pruning.depth.surgery import run_depth
from prunelab.train.lora import Trainables, lora_factors

from tiny_models import tiny_config, tiny_model, tiny_tokens


def _two_blocks():
    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 2
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _ce(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def _hand(model, ids_list, a_factors, scale):
    """Per block: sum over batches of ||dL/dtheta|| of the LoRA matrices at B = 0
    (dL/dA = s B^T G = 0, dL/dB = s G A^T, G the full weight gradient) and of
    ||dL/dh|| at the block's output."""
    ad = wrap(model).adapter
    params, resid = [0.0, 0.0], [0.0, 0.0]
    for ids in ids_list:
        outs = []
        hooks = [ad.block(i).register_forward_hook(
            lambda m, a, o, _outs=outs: _outs.append(o[0] if isinstance(o, tuple) else o))
            for i in range(2)]
        weights = {(i, n): lin.weight for i in range(2) for n, lin in ad.linears(i).items()}
        loss = _ce(model, ids)
        for h in hooks:
            h.remove()
        grads = torch.autograd.grad(loss, list(weights.values()) + outs)
        gw = dict(zip(weights, grads[:len(weights)], strict=True))
        for i in range(2):
            sq = sum(float((scale * gw[(i, n)].double() @ a_factors[(i, n)].t()).pow(2).sum())
                     for n in ad.linears(i))
            params[i] += sq ** 0.5
            resid[i] += float(grads[len(weights) + i].double().norm())
    return params, resid


@pytest.mark.parametrize("measure", ["params", "residual"])
def test_accumulation_equals_a_hand_computation_on_two_blocks(measure):
    model = _two_blocks()
    train = tiny_tokens(6, 12, seed=7)
    # lr 1e-30: the weights stay as they are to float precision (lr 0 is refused)
    cfg = HealConfig(steps=3, lr=1e-30, batch_size=2, seed=3, eval_every=0, patience=0,
                     quiet=True)
    # the LoRA factors A the run will draw (same seed), and the batches of its 3 steps
    probe = wrap(copy.deepcopy(model))
    tr = Trainables(probe, 8, 16.0, False, False, seed=3)
    a = {}
    for path, layer in tr.lora_layers().items():
        i = int(path.split(".layers.")[1].split(".")[0])
        name = path.split(f".layers.{i}.")[1]
        a[(i, name)] = lora_factors(layer)[0].detach().double()
    tr.merge(keep=False)
    from prunelab.train.state import DataOrder

    order = DataOrder(6, 2, 3)
    batches = [train[order.indices(t)] for t in range(3)]
    want_params, want_resid = _hand(copy.deepcopy(model), batches, a, 2.0)
    acc = FlowAccumulator(measure)
    heal(wrap(model), None, train, None, cfg, observers=[acc])
    want = want_params if measure == "params" else want_resid
    assert acc.steps == 3
    assert acc.sums == pytest.approx(want, rel=1e-5)
    assert acc.values() == pytest.approx([w / 3 for w in want], rel=1e-5)


def test_gradient_flow_probe_reads_gradients_only_and_drives_depth_pruning():
    lm = wrap(tiny_model("llama"))
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    ids = tiny_tokens(4, 12, seed=1)
    res = run_probes(lm, ["gradient-flow"], ids, batch_size=2, steps=3)["gradient-flow"]
    assert all(torch.equal(p, before[n]) for n, p in lm.model.named_parameters())
    assert res.kind == "layer" and res.num_blocks == 4 and res.meta["training"]["steps"] == 3
    values = res.layer_values()
    assert all(v > 0 for v in values)
    report = run_depth(lm, Depth(remove=1, probe="gradient-flow"), ids, batch_size=2)
    assert report.removed_blocks == [min(range(4), key=lambda i: values[i])]
    with pytest.raises(UnsupportedOperationError, match="encoder"):
        run_probes(wrap(tiny_model("bert")), ["gradient-flow"], ids, steps=1)


def test_cascadeflow_removes_blocks_while_healing():
    lm = wrap(tiny_model("llama"))
    lm.history.append({"operation": "prune-depth", "removed_blocks": [0]})
    lm.adapter.delete_blocks([0])  # original blocks 1, 2, 3 remain
    cfg = HealConfig(steps=8, lr=5e-3, prune="cascadeflow", remove=2, prune_every=3,
                     eval_every=0, patience=0, quiet=True, batch_size=2)
    lm, rec = heal(lm, None, tiny_tokens(6, 12, seed=1), None, cfg)
    events = rec["prune"]["events"]
    assert lm.adapter.num_blocks == 1 and [e["step"] for e in events] == [3, 6]
    removed = sorted(e["original"] for e in events)
    assert set(removed) < {1, 2, 3}
    op = lm.history[-2]
    assert op["operation"] == "prune-depth" and op["method"] == "cascadeflow"
    from prunelab.heal import kept_positions

    assert kept_positions(lm.history, 1) == sorted({1, 2, 3} - set(removed))


def test_fan_in_profile_correlations():
    out = fan_in_profile([3.0, 2.0, 1.0, 0.5], {"block-influence": [0.1, 0.2, 0.3, 0.4],
                                                 "partial": [None, 1.0, 2.0, 3.0]})
    assert out["spearman_depth"] == pytest.approx(-1.0)
    assert out["spearman"]["block-influence"] == pytest.approx(-1.0)
    assert out["spearman"]["partial"] == pytest.approx(-1.0)
    assert fan_in_profile([1.0, 3.0, 2.0])["spearman_depth"] == pytest.approx(0.5)


def test_fan_in_from_probe_results():
    from prunelab.probes import ProbeResult
    from prunelab.probes.cascadeflow import fan_in_from_results, fan_in_markdown

    def layer(name, vals):
        return ProbeResult(name, {}, [{"layers": [i], "value": v} for i, v in
                                      enumerate(vals)], kind="layer", num_blocks=len(vals))

    results = {"gradient-flow": layer("gradient-flow", [4.0, 3.0, 2.0]),
               "block-influence": layer("block-influence", [0.3, 0.2, 0.1]),
               "cka": layer("cka", [1.0, 2.0, 3.0])}
    prof = fan_in_from_results(results)
    assert prof["spearman"] == {"block-influence": pytest.approx(1.0)}
    assert prof["spearman_depth"] == pytest.approx(-1.0)
    text = fan_in_markdown(results)
    assert "Spearman with depth: -1.00" in text and "block-influence: +1.00" in text
    assert fan_in_from_results({"cka": results["cka"]}) is None
