"""Conformance of the depth and width pruners on the tiny-model matrix.

Every case runs through ``prunelab.prune``, meets its budget (depth: exactly ``remove``
blocks; width: the unit counts a uniform allocation implies, and at least the parameter
budget), saves with ``prunelab.save``, reloads (plain transformers, or
``trust_remote_code`` for bridges / per-block widths) with identical outputs, and the
manifest's last operation rebuilds the same config through ``METHODS.from_dict``.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data import TokenBatches
from prunelab.models.loading import wrap
from prunelab.pruning import (
    METHODS,
    Beam,
    Blend,
    Depth,
    Ghost,
    Iterative,
    LastN,
    Lra,
    NoAdjacent,
    OneShot,
    Random,
    Sleb,
    Span,
)
from prunelab.pruning.width import AblationKL, Putri, Width
from prunelab.pruning.width import scores as S
from prunelab.pruning.width.scoring import RepLie

from tiny_models import ARCHS, char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 12)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=12, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")
GQA = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")

# one (strategy x recovery) combination per family: every strategy and recovery is met
# (foldable / boundary only where the residual branches are additive and block 0 stays)
DEPTH = {
    "llama": Depth(remove=2, select=OneShot(), recovery=Lra(rank=4)),
    "mistral": Depth(remove=2, select=LastN(), recovery="foldable"),
    "qwen2": Depth(remove=2, select=Beam(width=2, seeds=3), recovery=Ghost(token_aware=True)),
    "qwen3": Depth(remove=2, select=Sleb(protect_ends=True), recovery="boundary"),
    "gemma": Depth(remove=2, select=Span(), recovery="none"),
    "gemma2": Depth(remove=2, select=Blend(probe="interchange"), recovery="ghost"),
    "gemma3_text": Depth(remove=2, probe="interchange", select=NoAdjacent(), recovery="lra"),
    "gpt2": Depth(remove=2, select=Random(), seed=5, recovery="ghost"),
    "gpt_neox": Depth(remove=2, select=Iterative(), recovery="none"),
    "opt": Depth(remove=1, select=LastN(), recovery="boundary"),
    "bert": Depth(remove=1, probe="leave-one-out", recovery=Ghost()),
    "phi3": Depth(remove=2, select=NoAdjacent(), probe="interchange", recovery="foldable"),
}

# width: heads (KV groups, or heads without GQA), FFN channels, and query heads on a few
# GQA families; scores, allocations and compensation vary along the families
_HEAD_SCORES = ["wanda-sp", "flap", "magnitude-profile", AblationKL(samples=2), Putri()]
_FFN_SCORES = ["flap", "wanda-sp", Putri(), "magnitude-profile", AblationKL(samples=2,
                                                                            channel_group=16)]


def _width_cases():
    cases = []
    for k, arch in enumerate(ARCHS):
        hs, fs = _HEAD_SCORES[k % 5], _FFN_SCORES[k % 5]
        if arch == "bert":  # no LM head: no loss-based score
            hs, fs = "wanda-sp", "flap"
        cases.append((arch, Width(
            unit="heads", score=hs, ratio=0.5, allocation="global" if k % 3 == 1 else
            "uniform", compensate=k % 2 == 0)))
        # global FFN widths are rounded per block to the nearest multiple of round_to,
        # which can land below the budget: round_to=1 here
        ffn_global = k % 3 == 2
        cases.append((arch, Width(
            unit="ffn", score=fs, ratio=0.3, allocation="global" if ffn_global else
            "uniform", round_to=1 if ffn_global else 8, compensate=k % 2 == 1)))
    for arch, score in (("qwen2", "wanda-sp"), ("gemma3_text", "magnitude-profile"),
                        ("mistral", AblationKL(samples=2))):
        cases.append((arch, Width(unit="heads", heads="query", score=score, ratio=0.5)))
    for arch, unit in (("phi3", "ffn"), ("llama", "heads")):  # REP-LIE (issue 16)
        cases.append((arch, Width(unit=unit, score=RepLie(steps=2), ratio=0.5 if unit ==
                                  "heads" else 0.3)))
    return cases


def _outputs(model, ids=IDS):
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _save_reload_rebuild(lm, rep, cfg, arch, tmp_path):
    out = prunelab.save(lm, tmp_path / "ckpt")
    remote = bool(rep["needs_remote_code"])
    auto = tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM
    again = auto.from_pretrained(out, trust_remote_code=remote,
                                 attn_implementation="eager").eval()
    torch.testing.assert_close(_outputs(again), _outputs(lm.model), rtol=0, atol=0)
    man = json.loads((out / "manifest.json").read_text())
    assert man["loads_with"].startswith("plain") != remote
    rebuilt = METHODS.from_dict(man["operations"][-1]["config"])
    assert rebuilt == cfg and type(rebuilt) is type(cfg)
    return man


@pytest.mark.parametrize("arch", ARCHS)
def test_depth_conformance(arch, tmp_path):
    cfg = DEPTH[arch]
    lm = wrap(tiny_model(arch), char_tokenizer(), spec=f"tiny-{arch}")
    rep = prunelab.prune(lm, cfg, CALIB, batch_size=2)
    removed = rep["removed_blocks"]
    assert len(removed) == cfg.remove == len(set(removed)) and lm.adapter.num_blocks == \
        4 - cfg.remove == rep["num_blocks_after"]
    assert rep["recovery"] == cfg.recovery_name
    assert rep["needs_remote_code"] == cfg.recovery.needs_remote_code
    if cfg.recovery.fits:
        assert rep["calib_kl_after_recovery"] < rep["calib_kl_before_recovery"]
    man = _save_reload_rebuild(lm, rep, cfg, arch, tmp_path)
    assert man["operations"][-1]["removed_blocks"] == removed


def _pool(ad, unit: str) -> int:
    """Parameters of the unit's projections over all blocks (the consumer's bias stays)."""
    total = 0
    for i in range(ad.num_blocks):
        proj = ad.attn_projections(i) if unit == "heads" else ad.mlp_projections(i)
        consumer = proj["o" if unit == "heads" else "down"]
        total += sum(p.numel() for m in proj.values() for p in m.parameters())
        total -= consumer.bias.numel() if getattr(consumer, "bias", None) is not None else 0
    return total


@pytest.mark.parametrize(("arch", "cfg"), _width_cases(), ids=lambda v: v if isinstance(
    v, str) else f"{v.unit}-{v.heads}-{v.score_name}-{v.allocation_name}")
def test_width_conformance(arch, cfg, tmp_path):
    lm = wrap(tiny_model(arch), char_tokenizer(), spec=f"tiny-{arch}")
    pool = _pool(lm.adapter, cfg.unit)
    if cfg.heads == "query":  # q rows and o columns of the query heads only
        pool = sum(2 * 32 * 8 * 4 + (8 * 4 if lm.adapter.attn_projections(i)["q"].bias
                                     is not None else 0) for i in range(4))
    rep = prunelab.prune(lm, cfg, CALIB, batch_size=2)
    assert rep["budget_params"] == round(cfg.ratio * pool)
    assert rep["removed_params"] >= rep["budget_params"]
    assert rep["removed_params"] == rep["size_before"]["params"] - rep["size_after"]["params"]
    if cfg.allocation.uniform:  # the unit counts a uniform allocation implies
        gqa = arch in GQA
        for b in rep["blocks"]:
            if cfg.unit == "ffn":
                assert b["ffn_after"] == S.round_width(48, 48 * 0.7, 8) == 32
            elif cfg.heads == "query":
                assert (b["heads_after"], b["kv_heads_after"]) == (2, 2)
            else:
                assert (b["heads_after"], b["kv_heads_after"]) == ((2, 1) if gqa else (2, 2))
    _save_reload_rebuild(lm, rep, cfg, arch, tmp_path)


def test_every_registered_piece_documents_its_options_for_the_cli():
    """Each registered strategy, recovery, width score and allocation has a one-line help
    (its docstring) and every field a help text in its metadata; the flat options of one
    registry never clash (one flag, one meaning)."""
    import dataclasses

    from prunelab.pruning import RECOVERIES, STRATEGIES
    from prunelab.pruning.options import flat_options
    from prunelab.pruning.width import WIDTH_ALLOCATIONS, WIDTH_SCORES

    for registry in (STRATEGIES, RECOVERIES, WIDTH_SCORES, WIDTH_ALLOCATIONS):
        for name in registry:
            cls = registry.get(name)
            assert cls.__doc__ and "\n" not in cls.__doc__.strip(), (name, cls.__doc__)
            for f in dataclasses.fields(cls):
                assert f.metadata.get("help"), (name, f.name)
        for flag, opt in flat_options(registry).items():
            assert opt.help and opt.owners, flag
    opts = flat_options(STRATEGIES)
    assert sorted(opts) == ["beam_score", "beam_seeds", "beam_width", "blend_probe",
                            "protect_ends", "sleb_resume", "sleb_score", "sleb_workers",
                            "val_metric", "val_options", "val_width"]
    assert (opts["beam_width"].default, opts["beam_width"].help) == (3, "beam: width")
    assert opts["blend_probe"].owners == {"blend": "probe"}
    assert flat_options(RECOVERIES)["token_aware"].owners == {"ghost": "token_aware",
                                                              "lra": "token_aware"}
    assert sorted(flat_options(WIDTH_SCORES)) == ["ablation_samples", "channel_group",
                                                  "elastic_ranking", "elastic_steps",
                                                  "lora_rank", "outlier_z", "putri_per_round",
                                                  "rep_lie_lr", "rep_lie_seed", "rep_lie_steps"]
