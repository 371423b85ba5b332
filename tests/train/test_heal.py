"""Healing: the loss goes down, the structure survives, resume equals an uninterrupted
run, early stopping keeps the best state, the losses are what they say, errors are one
line."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import prunelab
from prunelab.errors import ConfigError, PrunelabError, ResumeMismatchError
from prunelab.heal import HealConfig, eval_nll, heal, kept_positions
from prunelab.models.bridges import LinearBridge, attach_bridge
from prunelab.models.loading import wrap
from prunelab.train.lora import zero_count
from prunelab.train.losses import kd_loss

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

FAST = dict(eval_every=0, patience=0, quiet=True, batch_size=2)


def _shapes(model) -> dict:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _no_peft(model) -> bool:
    return not any("lora" in n for n, _ in model.named_parameters()) and \
        not any(type(m).__module__.startswith("peft") for m in model.modules())


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_heal_lowers_the_training_loss_on_a_fixed_batch(arch):
    lm = wrap(tiny_model(arch))
    batch = tiny_tokens(2, 16, seed=1)
    before = eval_nll(lm, batch, 2)
    lm, rec = heal(lm, None, batch, None, HealConfig(steps=25, lr=1e-2, **FAST))
    after = eval_nll(lm, batch, 2)
    assert after < before - 0.3, (before, after)
    assert _no_peft(lm.model)
    assert rec["steps"] == 25 and rec["tokens"] == 25 * 2 * 16
    assert lm.history[-1]["operation"] == "heal"


def _sparsify(model, frac=0.5):
    ad = prunelab.get_adapter(model)
    with torch.no_grad():
        for i in range(ad.num_blocks):
            for lin in ad.linears(i).values():
                w = lin.weight
                k = int(w.numel() * frac)
                thr = w.abs().flatten().kthvalue(k).values
                w.mul_(w.abs() > thr)


@pytest.mark.parametrize("full", [False, True])
def test_sparse_zero_pattern_and_shapes_survive_a_merge(full):
    model = tiny_model("llama")
    _sparsify(model)
    lm = wrap(model)
    zeros = {n: (p == 0).clone() for n, p in model.named_parameters() if "proj" in n}
    count, shapes = zero_count(model, lm.adapter), _shapes(model)
    assert count > 0
    ev = tiny_tokens(2, 16, seed=3)
    lm, rec = heal(lm, None, tiny_tokens(4, 16, seed=1), ev,
                   HealConfig(steps=12, lr=1e-2, full=full, eval_every=4, patience=0,
                              quiet=True, batch_size=2))
    assert zero_count(model, lm.adapter) == count == rec["zeros_after"] == rec["zeros_before"]
    for n, p in model.named_parameters():
        if n in zeros:
            assert torch.equal(p == 0, zeros[n]), n
    assert _shapes(model) == shapes and _no_peft(model)
    # what was trained (masked forward) is what was merged: the final evaluation of the
    # merged model equals the best evaluation made during training
    best = min(e["nll"] for e in rec["held_out"]["history"])
    assert rec["held_out"]["after"]["nll"] == pytest.approx(best, abs=2e-5)


def test_width_and_depth_pruned_shapes_are_unchanged():
    lm = wrap(tiny_model("qwen2"))
    lm.adapter.slice_ffn(1, list(range(0, 48, 2)))
    lm.adapter.slice_kv_groups(2, [1])
    lm.adapter.delete_blocks([3])
    shapes = _shapes(lm.model)
    lm, _ = heal(lm, None, tiny_tokens(4, 12), None, HealConfig(steps=4, **FAST))
    assert _shapes(lm.model) == shapes and lm.adapter.num_blocks == 3


@pytest.mark.parametrize("train_bridges", [False, True])
def test_bridges_stay_and_train_only_when_asked(tmp_path, train_bridges):
    lm = wrap(tiny_model("llama"), char_tokenizer())
    lm.adapter.delete_blocks([2])
    bridge = LinearBridge(32, rank=4, bias=True)
    with torch.no_grad():
        bridge.down.normal_(0, 0.1)
        bridge.up.normal_(0, 0.1)
    attach_bridge(lm.adapter.block(1), bridge)
    lm.history.append({"operation": "prune-depth", "removed_blocks": [2]})
    start = {n: p.detach().clone() for n, p in bridge.named_parameters()}
    flags = {n: p.requires_grad for n, p in lm.model.named_parameters()}
    lm, _ = heal(lm, None, tiny_tokens(4, 12), None,
                 HealConfig(steps=5, lr=1e-2, train_bridges=train_bridges, **FAST))
    assert lm.adapter.block(1).prunelab_bridge is bridge
    moved = any(not torch.equal(p, start[n]) for n, p in bridge.named_parameters())
    assert moved == train_bridges
    assert flags == {n: p.requires_grad for n, p in lm.model.named_parameters()}
    out = prunelab.save(lm, tmp_path / "healed")
    man = json.loads((out / "manifest.json").read_text())
    assert [op["operation"] for op in man["operations"]] == ["prune-depth", "heal"]
    assert man["operations"][-1]["healing"]["steps"] == 5


def _run(tmp_path, stop_after=None, seed=0):
    lm = wrap(tiny_model("llama"))
    cfg = HealConfig(steps=12, lr=5e-3, eval_every=4, patience=5, quiet=True, batch_size=2,
                     seed=seed)
    cb = None if stop_after is None else (lambda info: info["step"] >= stop_after)
    return heal(lm, None, tiny_tokens(6, 12, seed=1), tiny_tokens(2, 12, seed=2), cfg,
                out_dir=tmp_path, callback=cb)


def test_resume_equals_an_uninterrupted_run(tmp_path):
    ref, ref_rec = _run(tmp_path / "a")
    part, part_rec = _run(tmp_path / "b", stop_after=7)
    assert not part_rec["completed"] and part_rec["steps"] == 7
    done, rec = _run(tmp_path / "b")
    assert rec["resumed_from_step"] == 7 and rec["steps"] == 12
    ref_sd, sd = ref.model.state_dict(), done.model.state_dict()
    for n in ref_sd:
        torch.testing.assert_close(sd[n], ref_sd[n], atol=1e-6, rtol=0)
    assert rec["held_out"]["history"] == ref_rec["held_out"]["history"]
    # another seed does not resume from that folder
    with pytest.raises(ResumeMismatchError, match="config \\(seed"):
        _run(tmp_path / "b", seed=1)


def test_early_stopping_keeps_the_best_state():
    lm = wrap(tiny_model("llama"))
    start = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    ev = tiny_tokens(2, 12, seed=2)
    cfg = HealConfig(steps=40, lr=3.0, max_grad_norm=0.0, eval_every=2, patience=2,
                     quiet=True, batch_size=2)
    lm, rec = heal(lm, None, tiny_tokens(4, 12, seed=1), ev, cfg)
    hist = rec["held_out"]["history"]
    assert rec["early_stopped"] and rec["steps"] < 40
    best = min(hist, key=lambda e: e["nll"])
    assert rec["best_step"] == best["step"]
    assert rec["held_out"]["after"]["nll"] == pytest.approx(best["nll"], abs=2e-5)
    assert rec["held_out"]["after"]["nll"] <= rec["held_out"]["before"]["nll"] + 2e-5
    if best["step"] == 0:  # nothing helped: the weights are exactly the start
        assert all(torch.equal(p, start[n]) for n, p in lm.model.named_parameters())


def test_kd_is_temperature_scaled_kl():
    z_t = torch.tensor([[[2.0, 0.0, -1.0]]])
    z_s = torch.tensor([[[0.0, 1.0, 0.0]]])
    t = 2.0
    p = torch.softmax(z_t / t, -1)
    q = torch.softmax(z_s / t, -1)
    want = float((p * (p.log() - q.log())).sum()) * t * t
    assert float(kd_loss(z_s, z_t, t)) == pytest.approx(want, rel=1e-6)
    assert float(kd_loss(z_t, z_t, 3.0)) == pytest.approx(0.0, abs=1e-7)


def test_kept_positions_compose_depth_records():
    ops = [{"operation": "prune-depth", "removed_blocks": [1]},
           {"operation": "prune-width"},
           {"operation": "prune-depth", "removed_blocks": [0]}]
    assert kept_positions(ops, 2) == [2, 3]
    assert kept_positions([], 3) == [0, 1, 2]
    with pytest.raises(ConfigError, match=r"removes blocks \[5\] of 2"):
        kept_positions([{"operation": "prune-depth", "removed_blocks": [5]}], 1)


def test_hidden_loss_matches_inputs_of_kept_blocks_to_their_original_positions():
    teacher = wrap(tiny_model("llama"))
    student = wrap(copy.deepcopy(teacher.model))
    student.adapter.delete_blocks([1])
    manifest = {"operations": [{"operation": "prune-depth", "removed_blocks": [1]}]}
    ids = tiny_tokens(2, 12, seed=4)
    from prunelab.train.loop import HealRun

    run = HealRun(student, teacher, ids, None, HealConfig(loss="hidden", **FAST), None,
                  manifest["operations"])
    assert run.positions == [0, 2, 3]
    _, terms = run.loss(ids)
    with torch.no_grad():
        hs = student.model(input_ids=ids, output_hidden_states=True).hidden_states
        ht = teacher.model(input_ids=ids, output_hidden_states=True).hidden_states

    def nmse(a, b):
        return float((a - b).pow(2).mean() / b.pow(2).mean())
    # student block j's input hs[j] <-> teacher's input of block positions[j]; last: normed
    want = (nmse(hs[1], ht[2]) + nmse(hs[2], ht[3]) + nmse(hs[-1], ht[-1])) / 3
    assert terms["hidden"] == pytest.approx(want, rel=1e-5)
    # without the depth record the blocks cannot be matched
    with pytest.raises(ConfigError, match="give the student's manifest"):
        heal(wrap(copy.deepcopy(student.model)), teacher, ids, None,
             HealConfig(loss="hidden", steps=1, **FAST))
    lm, rec = heal(student, teacher, ids, None, HealConfig(loss="mix", steps=3, **FAST),
                   manifest=manifest)
    assert rec["weights"] == {"ce": 1.0, "kd": 1.0, "hidden": 1.0}
    assert [op["operation"] for op in lm.history] == ["prune-depth", "heal"]


def test_learning_rate_schedule():
    cfg = HealConfig(steps=10, lr=1.0, warmup=0.2, final_lr_ratio=0.1)
    lrs = [cfg.lr_at(s, 10) for s in range(10)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[2] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert lrs[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    assert HealConfig(tokens=1000, batch_size=4).total_steps(100) == 3
    assert HealConfig().peak_lr == 2e-4 and HealConfig(full=True).peak_lr == 2e-5


def test_config_round_trips_and_rejects_bad_values():
    cfg = HealConfig(loss="mix", kd_weight=0.5, tokens=1000, prune="rep-lie", ratio=0.3)
    assert HealConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    bad = [dict(loss="mse"), dict(lr=float("nan")), dict(steps=0), dict(steps=3, tokens=9),
           dict(temperature=float("inf")), dict(lora_rank=0), dict(prune="magic"),
           dict(unit="rows"), dict(loss="mix", ce_weight=0, kd_weight=0, hidden_weight=0),
           dict(prune="rep-lie", full=True), dict(flow_measure="x"), dict(ratio=0.99)]
    for kwargs in bad:
        with pytest.raises(ConfigError) as err:
            HealConfig(**kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no option 'rnak'"):
        HealConfig.from_dict({"rnak": 2})


def test_user_errors_are_one_line():
    lm = wrap(tiny_model("llama"))
    ids = tiny_tokens(2, 12)
    other = tiny_model("llama")
    other.resize_token_embeddings(140)
    cases = [
        (dict(teacher=None, cfg=HealConfig(loss="kd", **FAST)), "needs a teacher"),
        (dict(teacher=None, cfg=HealConfig(patience=2, eval_every=1, quiet=True)),
         "needs evaluation data"),
        (dict(teacher=None, cfg=HealConfig(steps=5, prune="cascadeflow", prune_every=5,
                                           **FAST)), "need more than 5 steps"),
        (dict(teacher=wrap(other), cfg=HealConfig(loss="kd", **FAST)),
         "vocabulary"),
    ]
    for case, message in cases:
        with pytest.raises(PrunelabError, match=message) as err:
            heal(lm, case["teacher"], ids, None, case["cfg"])
        assert "\n" not in str(err.value)
        assert _no_peft(lm.model)
    with pytest.raises(PrunelabError, match="encoder"):
        heal(wrap(tiny_model("bert")), None, ids, None, HealConfig(**FAST))


def test_api_heal_reads_the_pruned_checkpoint_manifest_and_saves(tmp_path):
    from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

    dense_dir = save_tiny_checkpoint("llama", tmp_path / "dense")
    text = tmp_path / "text.txt"
    text.write_text(SAMPLE_TEXT * 4)
    lm = prunelab.load(str(dense_dir))
    prunelab.prune(lm, prunelab.Depth(blocks=(1,)), f"text:{text}", seqlen=16, samples=4,
                   batch_size=2)
    pruned_dir = prunelab.save(lm, tmp_path / "pruned")
    healed, rec = prunelab.api.heal(str(pruned_dir), teacher=str(dense_dir),
                                    data=f"text:{text}", eval_data=f"text:{text}",
                                    loss="hidden", steps=3, seqlen=16, eval_every=0,
                                    patience=0, quiet=True, batch_size=2, eval_samples=2)
    assert rec["steps"] == 3 and rec["data"]["train"]["seqlen"] == 16
    assert rec["held_out"]["after"]["nll"] < rec["held_out"]["before"]["nll"] + 1.0
    out = prunelab.save(healed, tmp_path / "healed", extra={"healing": rec})
    man = json.loads((out / "manifest.json").read_text())
    assert [op["operation"] for op in man["operations"]] == ["prune-depth", "heal"]
    assert man["healing"]["loss"] == "hidden" and man["loads_with"].startswith("plain")
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.config.num_hidden_layers == 3


def test_without_periodic_evaluation_the_last_state_is_kept():
    """``eval_every=0`` with held-out data: measured before and after, never "restored" to
    the start (the held-out set is only reported, there is no best state to pick)."""
    lm = wrap(tiny_model("llama"))
    start = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    batch = tiny_tokens(2, 16, seed=1)
    lm, rec = heal(lm, None, batch, tiny_tokens(2, 12, seed=2),
                   HealConfig(steps=4, lr=1e-2, eval_every=0, patience=0, quiet=True,
                              batch_size=2))
    changed = sum(not torch.equal(p, start[n]) for n, p in lm.model.named_parameters())
    assert changed > 0
    assert rec["held_out"]["after"]["nll"] != rec["held_out"]["before"]["nll"]


def test_the_last_step_is_evaluated_when_the_period_does_not_reach_it():
    """3 steps with ``eval_every=25``: the final state is evaluated and kept, not discarded
    for the step-0 state (the only one evaluated before the fix)."""
    lm = wrap(tiny_model("llama"))
    batch = tiny_tokens(2, 16, seed=1)
    lm, rec = heal(lm, None, batch, batch, HealConfig(steps=3, lr=1e-2, eval_every=25,
                                                      patience=3, quiet=True, batch_size=2))
    assert [e["step"] for e in rec["held_out"]["history"]] == [0, 3]
    assert rec["best_step"] == 3
    assert rec["held_out"]["after"]["nll"] < rec["held_out"]["before"]["nll"]


def test_a_teacher_for_a_loss_that_does_not_use_it_is_refused(tmp_path):
    from prunelab.workflow.stages import _build_heal

    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    lm = wrap(tiny_model("llama"), char_tokenizer())
    with pytest.raises(ConfigError, match="--teacher is used by --loss kd, hidden and mix"):
        prunelab.api.heal(lm, lm, data=f"text:{text}", eval_data=None, steps=1, seqlen=16,
                      eval_every=0, patience=0, quiet=True)
    with pytest.raises(ConfigError, match="teacher: dense is used by loss kd"):
        _build_heal({"teacher": "dense", "loss": "ce", "steps": 1})
    assert _build_heal({"loss": "ce", "steps": 1}).teacher == "dense"  # the default: unused
