"""Per-layer slicing with a width per block: the physical cut equals the full-width model
with the dropped directions zeroed, checkpoints reload with identical logits, the parameter
count is the predicted one, and the allocations respect their budget / energy."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.custom import custom_modules
from prunelab.models.loading import wrap
from prunelab.pruning.factor import slicing
from prunelab.pruning.factor.slicing import SliceGPT, params_at
from prunelab.pruning.factor.widths import (
    allocate_for_budget,
    allocate_for_energy,
    block_spectra,
    params_for_widths,
)

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 16, seed=1)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")
TEST = tiny_tokens(2, 12, seed=5)
WIDTHS = [28, 20, 24, 16, 24]  # 4 blocks, then the final norm / head (hidden size 32)


def _lm(arch: str):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


@torch.no_grad()
def _logits(model, ids=TEST) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def _forced(monkeypatch, widths, seen: dict | None = None):
    """Slice with ``widths``; with ``seen``, keep the logits of the full-width model (the
    dropped directions zeroed) just before the physical cut."""
    monkeypatch.setattr(slicing, "_block_widths", lambda *a, **k: list(widths))
    if seen is not None:
        real = slicing._finish

        def finish(lm, d, ws, *rest):
            seen["before_cut"] = _logits(lm.model)
            real(lm, d, ws, *rest)
        monkeypatch.setattr(slicing, "_finish", finish)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gemma", "gemma3_text"])
def test_the_physical_cut_equals_the_zeroed_full_width_model(arch, monkeypatch):
    lm = _lm(arch)
    for m in lm.model.modules():  # the norms' eps would differ between width d and w
        for attr in ("variance_epsilon", "eps"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    seen: dict = {}
    _forced(monkeypatch, WIDTHS, seen)
    rep = prunelab.prune(lm, SliceGPT(ratio=0.25, multiple=4, widths="spectrum"), CALIB,
                         batch_size=2)
    assert rep["block_widths"] == WIDTHS and rep["path"] == "remote code"
    torch.testing.assert_close(_logits(lm.model), seen["before_cut"], rtol=1e-5, atol=1e-5)
    ad = lm.adapter
    for i, w in enumerate(WIDTHS[:-1]):  # every reader of block i reads w columns
        assert all(m.in_features == w for p, m in ad.linears(i).items()
                   if p.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "qkv_proj",
                                           "gate_proj", "up_proj", "gate_up_proj"))
    assert ad.head().in_features == WIDTHS[-1]
    assert ad.embeddings().weight.shape[1] == WIDTHS[0]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_non_uniform_checkpoint_reloads_with_identical_logits(arch, monkeypatch, tmp_path):
    lm = _lm(arch)
    _forced(monkeypatch, WIDTHS)
    predicted = params_for_widths(_lm(arch), WIDTHS)
    rep = prunelab.prune(lm, SliceGPT(ratio=0.25, multiple=4, widths="spectrum"), CALIB,
                         batch_size=2)
    assert rep["params_after"] == predicted
    kinds = {m.prunelab_kind for _, m in custom_modules(lm.model)}
    assert kinds == {"residual_shortcut", "stream_shapes"}
    ref = _logits(lm.model)
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    torch.testing.assert_close(_logits(again), ref, rtol=0, atol=1e-6)
    assert sum(p.numel() for p in again.parameters()) == predicted


def test_uniform_widths_count_as_params_at():
    lm = _lm("llama")
    for w in (16, 24, 32):
        assert params_for_widths(lm, [w] * 5) == params_at(lm, w, "per-layer")


def test_spectrum_widths_stay_within_the_uniform_budget_and_use_it():
    lm = _lm("llama")
    rep = prunelab.prune(lm, SliceGPT(ratio=0.25, multiple=4, widths="spectrum"), CALIB,
                         batch_size=2)
    budget = params_at(_lm("llama"), 24, "per-layer")
    assert rep["params_after"] <= budget
    widths = rep["block_widths"]
    assert all(w % 4 == 0 and 4 <= w <= 32 for w in widths)
    # no block could take 4 more directions without breaking the budget
    fresh = _lm("llama")
    for g in range(len(widths)):
        if widths[g] < 32:
            trial = list(widths)
            trial[g] += 4
            assert params_for_widths(fresh, trial) > budget


def test_greedy_allocation_follows_the_energy_per_parameter():
    """Two groups with the same cost: the flatter spectrum gets the directions."""
    lm = _lm("llama")
    n = 32
    steep = torch.tensor([0.9] + [0.1 / (n - 1)] * (n - 1), dtype=torch.float64)
    flat = torch.full((n,), 1.0 / n, dtype=torch.float64)
    spectra = [steep, flat, steep, flat, flat]
    budget = params_for_widths(lm, [8, 16, 8, 16, 16])
    widths = allocate_for_budget(lm, spectra, budget, 4)
    assert widths[1] > widths[0] and widths[3] > widths[2]
    assert params_for_widths(lm, widths) <= budget


def test_energy_widths_hold_the_share_and_grow_with_it():
    g = torch.diag(torch.tensor([8.0, 4.0, 2.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    spectra = block_spectra([g, g, g])  # one block and the final boundary
    assert [float(x) for x in spectra[0][:5]] == [0.5, 0.25, 0.125, 0.0625, 0.0625]
    assert allocate_for_energy(spectra, 0.75, 1) == [2, 2]
    assert allocate_for_energy(spectra, 0.8, 1) == [3, 3]
    assert allocate_for_energy(spectra, 0.8, 4) == [4, 4]
    lm = _lm("llama")
    rep = prunelab.prune(lm, SliceGPT(multiple=4, widths="energy", energy=0.6), CALIB,
                         batch_size=2)
    low = rep["block_widths"]
    rep = prunelab.prune(_lm("llama"), SliceGPT(multiple=4, widths="energy", energy=0.99),
                         CALIB, batch_size=2)
    assert all(a <= b for a, b in zip(low, rep["block_widths"], strict=True))
    assert low != rep["block_widths"]


def test_width_options_are_checked_in_one_line():
    for kw, text in ((dict(widths="bogus"), "widths must be one of"),
                     (dict(widths="spectrum", rotation="global"), "needs rotation per-layer"),
                     (dict(widths="energy", target_params=0.8), "drop target_params"),
                     (dict(widths="energy", energy=0.0), "energy must be > 0"),
                     (dict(widths="energy", energy=float("nan")), "energy")):
        with pytest.raises(ConfigError) as err:
            SliceGPT(**kw)
        assert text in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("weights,kept_first", [("trace", False), ("raw", True)])
def test_global_rotation_weighs_boundaries_by_their_trace(weights, kept_first, monkeypatch):
    """One boundary with a huge norm along e0, the other eight along e1 (and some e2): the
    raw sum keeps e0 for a one-direction slice, trace weights keep e1."""
    big = torch.zeros(32, 32, dtype=torch.float64)
    big[0, 0], big[3, 3] = 1e6, 1.0
    small = torch.zeros(32, 32, dtype=torch.float64)
    small[1, 1], small[2, 2] = 1.0, 0.5
    grams = [big] + [small.clone() for _ in range(8)]
    monkeypatch.setattr(slicing, "boundary_grams", lambda *a, **k: grams)
    # a one-direction slice: the tiny config (4 heads) would round it up to 4, which keeps
    # every direction this case puts energy in; the weighing is what is tested here
    monkeypatch.setattr(slicing, "config_refuses", lambda lm, width: "")
    lm = _lm("llama")
    rep = prunelab.prune(lm, SliceGPT(rotation="global", ratio=31 / 32, multiple=1,
                                      damping=0.0, global_weights=weights), CALIB,
                         batch_size=2)
    assert rep["d_kept"] == 1
    first, rest = rep["kept_energy"][0], rep["kept_energy"][1:]
    if kept_first:
        assert first == pytest.approx(1.0, abs=1e-5) and max(rest) < 1e-9
    else:
        assert first < 1e-9 and min(rest) == pytest.approx(1 / 1.5, abs=1e-9)
