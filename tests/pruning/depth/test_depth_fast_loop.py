"""The fast path of SLEB with recovery in the loop (:mod:`prunelab.pruning.depth.fast_loop`)
against the straightforward path: the same blocks, the same scores at every step, fewer
block evaluations; and a status line per step."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from prunelab import log
from prunelab.models.loading import wrap
from prunelab.probes import ProbeContext
from prunelab.pruning import Depth
from prunelab.pruning.depth.config import select
from prunelab.pruning.depth.fast_loop import nll_fused
from prunelab.pruning.depth.strategies import Sleb

from tiny_models import char_tokenizer, tiny_config, tiny_tokens

IDS = tiny_tokens(8, 12, seed=1)


def _lm(arch: str, blocks: int = 7, seed: int = 0):
    """A random ``arch`` model with ``blocks`` blocks (tiny_models' recipe, deeper)."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.num_hidden_layers = blocks
    if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
        cfg.layer_types = [cfg.layer_types[i % len(cfg.layer_types)] for i in range(blocks)]
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return wrap(model.eval(), char_tokenizer(), spec="tiny")


def _search(lm, fast: bool, monkeypatch, **kw):
    from prunelab.pruning.depth.strategies import sleb

    monkeypatch.setattr(sleb, "FAST_IN_LOOP", fast)
    cfg = Depth(select=Sleb(score=kw.pop("score", "nll")), recovery_in_loop=True, **kw)
    ctx = ProbeContext(lm, IDS, batch_size=2)
    removed, how = select(lm, cfg, ctx, cfg.remove)
    return removed, how


CASES = [("llama", "foldable", 0.25, "nll"), ("llama", "ghost", 0.25, "nll"),
         ("llama", "foldable", 0.0, "nll"), ("llama", "lra", 0.5, "kl"),
         ("llama", "boundary", 0.25, "nll"), ("gpt2", "foldable", 0.25, "nll"),
         ("gemma3_text", "ghost", 0.25, "nll"), ("gemma3_text", "foldable", 0.25, "kl")]


@pytest.mark.parametrize("arch,recovery,holdout,score", CASES)
def test_fast_path_chooses_the_same_blocks_with_the_same_scores(arch, recovery, holdout,
                                                               score, monkeypatch):
    lm = _lm(arch)
    kw = dict(remove=5, recovery=recovery, recovery_holdout=holdout, score=score)
    slow, how_s = _search(lm, False, monkeypatch, **dict(kw))
    fast, how_f = _search(lm, True, monkeypatch, **dict(kw))
    assert fast == slow
    assert how_f["repaired_cuts"] == how_s["repaired_cuts"]
    assert len(how_f["steps"]) == len(how_s["steps"]) == 5
    for a, b in zip(how_f["steps"], how_s["steps"], strict=True):
        assert a["removed"] == b["removed"]
        assert a["score"] == pytest.approx(b["score"], rel=1e-6, abs=1e-9)
        assert a["score_without_recovery"] == pytest.approx(b["score_without_recovery"],
                                                            rel=1e-6, abs=1e-9)
    # the work saved: the fit's statistics pass, block k's raw run, per-candidate taps
    assert how_f["block_evaluations"] < how_s["block_evaluations"]


def test_the_repair_helps_somewhere_in_the_compared_searches(monkeypatch):
    """Guard for the comparison above: the repaired branch is exercised (some step's
    score is below its score without repair), so the fast fits are the ones compared."""
    lm = _lm("llama")
    _, how = _search(lm, True, monkeypatch, remove=5, recovery="foldable",
                     recovery_holdout=0.25)
    assert any(s["score"] < s["score_without_recovery"] for s in how["steps"])
    _, how = _search(lm, True, monkeypatch, remove=5, recovery="ghost", recovery_holdout=0.25)
    assert any(s["score"] < s["score_without_recovery"] for s in how["steps"])


def test_fused_nll_equals_the_contexts_nll():
    lm = _lm("llama")
    ctx = ProbeContext(lm, IDS, batch_size=3)
    h = [x + 0.1 * torch.randn_like(x) for x in ctx.boundary(ctx.num_blocks)]
    assert nll_fused(ctx, h) == pytest.approx(ctx.nll(h), rel=1e-7)
    assert nll_fused(ctx, ctx.boundary(ctx.num_blocks)) == \
        pytest.approx(ctx.nll(ctx.boundary(ctx.num_blocks)), rel=1e-7)


def test_every_step_prints_a_status_line_unless_quiet(monkeypatch, capsys):
    lm = _lm("llama")
    try:
        log.set_quiet(False)
        _, how = _search(lm, True, monkeypatch, remove=3, recovery="foldable",
                         recovery_holdout=0.25)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("sleb step ")]
        assert [ln.split(":")[0] for ln in lines] == ["sleb step 1/3", "sleb step 2/3",
                                                      "sleb step 3/3"]
        for ln, st in zip(lines, how["steps"], strict=True):
            assert f"removed block {st['removed']}," in ln
            assert f"nll {st['score']:.4f}" in ln
        log.set_quiet(True)
        _search(lm, True, monkeypatch, remove=3, recovery="foldable", recovery_holdout=0.25)
        assert "sleb step" not in capsys.readouterr().err
    finally:
        log.set_quiet(False)


@pytest.mark.parametrize("recovery,in_loop,granularity", [
    ("foldable", True, "block"), ("ghost", True, "block"), ("none", False, "block"),
    ("ghost", True, "sublayer")])
def test_workers_give_the_serial_choice_scores_and_costs(recovery, in_loop, granularity,
                                                         monkeypatch):
    """Candidates scored in 3 processes (forked): the same steps, scores, repaired cuts
    and block evaluations as one process (the taps gathered in the workers come back)."""
    from prunelab.pruning.depth.strategies import sleb

    monkeypatch.setattr(sleb, "FAST_IN_LOOP", True)
    lm = _lm("llama")
    out = []
    for workers in (1, 3):
        cfg = Depth(select=Sleb(score="nll", workers=workers), remove=4, recovery=recovery,
                    recovery_in_loop=in_loop, granularity=granularity,
                    **({"recovery_holdout": 0.25} if in_loop else {}))
        out.append(select(lm, cfg, ProbeContext(lm, IDS, batch_size=2), 4))
    (one, how1), (many, how3) = out
    assert many == one and how3["workers"] == 3 and "workers" not in how1
    assert how3.get("repaired_cuts") == how1.get("repaired_cuts")
    for a, b in zip(how3["steps"], how1["steps"], strict=True):
        assert a["removed"] == b["removed"]
        assert a["score"] == b["score"]
        assert a["score_without_recovery"] == b["score_without_recovery"]
    assert how3["block_evaluations"] == how1["block_evaluations"]


def test_workers_must_be_a_positive_integer():
    from prunelab.errors import ConfigError

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="sleb workers"):
            Sleb(workers=bad)
