"""Residual-stream slicing (SliceGPT per-layer, one global rotation): norm folding and
rotations are exact, slicing degrades monotonically, the global rotation is an ordinary
checkpoint, the others reload through remote code, budgets and refusals."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data.batches import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.custom import custom_modules
from prunelab.models.loading import wrap
from prunelab.pruning import METHODS
from prunelab.pruning.factor.folding import fold_norms, head_is_tied, stream_boundaries
from prunelab.pruning.factor.shortcuts import ResidualShortcut
from prunelab.pruning.factor.slicing import (
    SliceGPT,
    params_at,
    slice_stream,
    width_for_ratio,
)
from prunelab.pruning.factor.subspace import pca_basis

from tiny_models import bpe_tokenizer, char_tokenizer, tiny_model, tiny_tied_model, tiny_tokens

SLICEABLE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")
IDS = tiny_tokens(4, 16, seed=1)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")
TEST = tiny_tokens(2, 12, seed=5)


def _lm(arch: str):
    return wrap(tiny_model(arch), char_tokenizer(), spec="tiny")


@torch.no_grad()
def _logits(model, ids=TEST) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits


def _kl(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1),
                                            log_target=True, reduction="batchmean"))


@pytest.mark.parametrize("arch", SLICEABLE)
def test_norm_folding_keeps_the_logits_and_unties_the_head(arch):
    lm = _lm(arch)
    ref = _logits(lm.model)
    fold_norms(lm)
    torch.testing.assert_close(_logits(lm.model), ref, rtol=0, atol=1e-5)
    offset = arch.startswith("gemma")
    for norm in stream_boundaries(lm):  # weight-free: scale 1 (Gemma: 1 + 0)
        assert torch.equal(norm.weight, torch.full_like(norm.weight, 0.0 if offset else 1.0))
    head, emb = lm.adapter.head(), lm.adapter.embeddings()
    assert head.weight.data_ptr() != emb.weight.data_ptr()
    assert lm.model.config.tie_word_embeddings is False


@pytest.mark.parametrize("rotation", ["per-layer", "global"])
@pytest.mark.parametrize("arch", SLICEABLE)
def test_rotation_without_slicing_leaves_the_logits_unchanged(arch, rotation):
    lm = _lm(arch)
    ref = _logits(lm.model)
    emb = lm.adapter.embeddings().weight.detach().clone()
    rep = slice_stream(lm, SliceGPT(rotation=rotation, ratio=0.0), IDS, batch_size=2)
    assert rep["d"] == rep["d_kept"] == 32
    assert rep["kept_energy"] == pytest.approx([1.0] * 9, abs=1e-12)
    # the stream really was rotated (embedding rows changed), yet the logits did not
    assert (lm.adapter.embeddings().weight - emb).abs().max() > 1e-3
    torch.testing.assert_close(_logits(lm.model), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,rotation", [("llama", "per-layer"), ("llama", "global"),
                                           ("gemma2", "per-layer"), ("phi3", "global")])
def test_smaller_width_gives_larger_calibration_kl(arch, rotation):
    ref = _logits(_lm(arch).model, IDS)
    kls, energies = [], []
    for width in (32, 24, 16, 8):
        lm = _lm(arch)
        rep = slice_stream(lm, SliceGPT(rotation=rotation, ratio=1 - width / 32, multiple=4),
                           IDS, batch_size=2)
        assert rep["d_kept"] == width == lm.model.config.hidden_size
        kls.append(_kl(_logits(lm.model, IDS), ref))
        energies.append(sum(rep["kept_energy"]))
    assert kls[0] < 1e-6  # float32 noise only
    assert all(a < b for a, b in zip(kls, kls[1:], strict=False)), kls
    assert all(a > b for a, b in zip(energies, energies[1:], strict=False)), energies


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma"])
def test_global_rotation_is_a_plain_checkpoint(arch, tmp_path):
    lm = _lm(arch)
    cfg = SliceGPT(rotation="global", ratio=0.25, multiple=4)
    rep = prunelab.prune(lm, cfg, CALIB, batch_size=2)
    assert (rep["d"], rep["d_kept"], rep["path"]) == (32, 24, "plain")
    assert rep["needs_remote_code"] is False and custom_modules(lm.model) == []
    want = (32 / 24) ** 0.5 - (1.0 if arch == "gemma" else 0.0)
    for norm in stream_boundaries(lm):
        torch.testing.assert_close(norm.weight, torch.full((24,), want), rtol=0, atol=1e-7)
    ref = _logits(lm.model)
    out = prunelab.save(lm, tmp_path / "ckpt")
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == arch and "auto_map" not in saved
    man = json.loads((out / "manifest.json").read_text())
    assert METHODS.from_dict(man["operations"][-1]["config"]) == cfg
    assert man["operations"][-1]["d_kept"] == 24
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation=lm.model.config._attn_implementation).eval()
    assert again.config.hidden_size == 24 and again.config.head_dim == 8
    torch.testing.assert_close(_logits(again), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,rotation", [("llama", "per-layer"), ("phi3", "per-layer"),
                                           ("gemma2", "per-layer"),
                                           ("gemma3_text", "global")])
def test_remote_code_checkpoints_reload_with_identical_logits(arch, rotation, tmp_path):
    lm = _lm(arch)
    rep = prunelab.prune(lm, SliceGPT(rotation=rotation, ratio=0.25, multiple=4), CALIB,
                         batch_size=2)
    assert rep["path"] == "remote code" and rep["needs_remote_code"] is True
    mods = [m for _, m in custom_modules(lm.model)]
    assert all(isinstance(m, ResidualShortcut) for m in mods) and len(mods) == 8
    for m in mods:  # shortcut maps d' x d'; Gemma 2/3 also map the post-norm output d -> d'
        if rotation == "per-layer":
            assert tuple(m.shortcut.shape) == (24, 24)
        assert (m.out_map is not None) == arch.startswith("gemma")
        if m.out_map is not None:
            assert tuple(m.out_map.shape) == (32, 24)
    ref = _logits(lm.model)
    out = prunelab.save(lm, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    assert again.config.hidden_size == 24
    torch.testing.assert_close(_logits(again), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rotation", ["per-layer", "global"])
def test_target_params_picks_the_widest_width_within_budget(rotation):
    lm = _lm("llama")
    before = sum(p.numel() for p in lm.model.parameters())  # tied head counted once
    predicted = {w: params_at(lm, w, rotation) for w in (20, 24)}
    target = (predicted[20] + predicted[24]) / 2 / before  # between two widths
    rep = prunelab.prune(lm, SliceGPT(rotation=rotation, target_params=target, multiple=4),
                         CALIB, batch_size=2)
    assert rep["d_kept"] == 20
    assert rep["params_before"] == before
    assert rep["params_after"] == predicted[20]  # the count the search used is exact
    assert rep["kept_params"] <= target


def test_width_for_ratio_rounds_to_the_multiple():
    assert width_for_ratio(32, 0.25, 8) == 24
    assert width_for_ratio(576, 0.2, 8) == 464  # 460.8 -> 464
    assert width_for_ratio(576, 0.0, 8) == 576
    assert width_for_ratio(30, 0.0, 8) == 30
    assert width_for_ratio(32, 0.95, 8) == 8  # never below one multiple


def test_stream_boundaries_are_the_stream_reading_norms_in_order():
    lm = _lm("gemma2")
    blocks = lm.adapter.blocks()
    want = [m for b in blocks for m in (b.input_layernorm, b.pre_feedforward_layernorm)]
    assert stream_boundaries(lm) == want + [lm.adapter.final_norm()]
    lm = _lm("llama")
    blocks = lm.adapter.blocks()
    want = [m for b in blocks for m in (b.input_layernorm, b.post_attention_layernorm)]
    assert stream_boundaries(lm) == want + [lm.adapter.final_norm()]


def test_pca_basis_orders_by_decreasing_variance():
    cov = torch.diag(torch.tensor([1.0, 5.0, 3.0], dtype=torch.float64))
    q, vals = pca_basis(cov)
    assert vals.tolist() == [5.0, 3.0, 1.0]
    assert q.abs().argmax(0).tolist() == [1, 2, 0]


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt", "bert"])
def test_layernorm_and_encoder_families_are_refused_before_any_data(arch):
    lm = wrap(tiny_model(arch), char_tokenizer(), spec="tiny")
    with pytest.raises(UnsupportedOperationError) as err:
        prunelab.prune(lm, SliceGPT(), "text:/nonexistent/file.txt")
    assert "\n" not in str(err.value) and arch in str(err.value)


def test_config_errors_are_one_line():
    for kwargs in ({"rotation": "both"}, {"basis": "svd"}, {"ratio": 1.0},
                   {"multiple": 0}, {"damping": -1.0}):
        with pytest.raises(ConfigError):
            SliceGPT(**kwargs)
    assert METHODS.get("slicegpt") is SliceGPT
    lm = _lm("llama")
    with pytest.raises(ConfigError, match="below what slicing reaches"):
        prunelab.prune(lm, SliceGPT(target_params=0.01), "text:/nonexistent/file.txt")
    with pytest.raises(ConfigError, match="exceeds the hidden size"):
        prunelab.prune(lm, SliceGPT(multiple=64), "text:/nonexistent/file.txt")


@pytest.mark.parametrize("rotation", ["per-layer", "global"])
def test_sensitivity_with_isotropic_fisher_is_pca_slicing(rotation, monkeypatch):
    """The wiring: the Fisher at every stream boundary of the dense model goes to its own
    boundary (global: all of them); with F = I the sensitivity objective is PCA's, so the
    sliced model equals the PCA-sliced one."""
    from prunelab.pruning.factor import fisher as fisher_mod

    calls = []

    def output_fisher(lm, input_ids, modules, *, batch_size, samples=1, seed=0):
        calls.append(len(modules))
        return [torch.eye(32, dtype=torch.float64) for _ in modules]

    monkeypatch.setattr(fisher_mod, "output_fisher", output_fisher)
    ref = _lm("llama")
    slice_stream(ref, SliceGPT(ratio=0.25, rotation=rotation), IDS, batch_size=2)
    lm = _lm("llama")
    slice_stream(lm, SliceGPT(ratio=0.25, rotation=rotation, basis="sensitivity"), IDS,
                 batch_size=2)
    assert calls == [9]  # 2 boundaries per block + the final norm, one Fisher pass
    torch.testing.assert_close(_logits(lm.model), _logits(ref.model), rtol=1e-4, atol=1e-5)


def test_sensitivity_slicing_lowers_the_calibration_kl():
    """The real Fisher: at equal width the sensitivity-aware subspaces give a lower KL to
    the dense model on the calibration windows than PCA's (per-layer rotations)."""
    from prunelab.eval.divergence import kl_from_logits

    dense = _logits(_lm("llama").model)
    kls = {}
    for basis in ("pca", "sensitivity"):
        lm = _lm("llama")
        slice_stream(lm, SliceGPT(ratio=0.5, multiple=4, basis=basis, fisher_samples=4),
                     IDS, batch_size=2)
        kls[basis] = float(kl_from_logits(dense, _logits(lm.model)).mean())
    assert kls["sensitivity"] < kls["pca"], kls


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_per_layer_bases_come_from_the_already_sliced_stream(arch):
    """Each boundary's basis is the PCA of the stream with every earlier boundary already
    sliced: in the sliced model, the stream at every boundary has a diagonal covariance
    with decreasing variances (one global rotation does not)."""
    def stream_grams(lm):
        grams = {}

        def hook(k):
            def pre(_m, args):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                grams[k] = x.t() @ x
            return pre
        handles = [n.register_forward_pre_hook(hook(k))
                   for k, n in enumerate(stream_boundaries(lm))]
        _logits(lm.model, IDS)
        for h in handles:
            h.remove()
        return [grams[k] for k in range(len(handles))]

    for rotation, diagonal in (("per-layer", True), ("global", False)):
        lm = _lm(arch)
        slice_stream(lm, SliceGPT(rotation=rotation, ratio=0.25, multiple=4), IDS,
                     batch_size=2)
        offdiag = []
        for g in stream_grams(lm):
            diag = g.diagonal()
            offdiag.append(float((g - torch.diag(diag)).abs().max() / diag.max()))
            if diagonal:
                assert bool((diag[:-1] >= diag[1:] * (1 - 1e-6)).all())
        assert (max(offdiag) < 1e-4) == diagonal, offdiag


def test_pca_basis_is_the_shared_one():
    from prunelab.pruning.factor import slicing, subspace

    assert slicing.pca_basis is subspace.pca_basis


# ------------------------------------------------- a tied head kept tied; GGUF-only widths
def _tied_lm(arch: str = "llama", heads: int = 4, hidden: int = 32, final_scale=None,
             tokenizer=None):
    return wrap(tiny_tied_model(arch, heads, hidden, final_scale),
                tokenizer or char_tokenizer(), spec="tiny")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_keep_tied_rotation_without_slicing_is_exact_and_stays_tied(arch):
    lm = _tied_lm(arch)
    assert head_is_tied(lm)
    ref = _logits(lm.model)
    dense = sum(p.numel() for p in lm.model.parameters())
    rep = slice_stream(lm, SliceGPT(rotation="global", ratio=0.0, keep_tied=True), IDS,
                       batch_size=2)
    assert rep["tied_head"] is True and head_is_tied(lm)
    assert lm.model.config.tie_word_embeddings is True
    assert sum(p.numel() for p in lm.model.parameters()) == dense
    torch.testing.assert_close(_logits(lm.model), ref, rtol=0, atol=1e-5)
    # the final norm kept its per-channel scale (permuted into the turned basis)
    final = lm.adapter.final_norm().weight.detach()
    assert final.std() > 0.1


def test_keep_tied_slices_like_the_untied_head_when_the_final_scale_is_constant(tmp_path):
    """With a constant final scale ``c`` the untied head ``E diag(c) r`` is ``c (E r)``: the
    tied slice computes exactly the untied one's logits and stores one head fewer."""
    cfg = SliceGPT(rotation="global", ratio=0.25, multiple=4)
    untied, tied = _tied_lm(final_scale=1.7), _tied_lm(final_scale=1.7)
    slice_stream(untied, cfg, IDS, batch_size=2)
    want = params_at(_tied_lm(), 24, "global", keep_tied=True)
    rep = slice_stream(tied, SliceGPT(rotation="global", ratio=0.25, multiple=4,
                                      keep_tied=True), IDS, batch_size=2)
    assert not head_is_tied(untied) and head_is_tied(tied) and rep["tied_head"] is True
    n_untied = sum(p.numel() for p in untied.model.parameters())
    n_tied = sum(p.numel() for p in tied.model.parameters())
    assert n_tied == want == n_untied - tied.adapter.embeddings().weight.numel()
    torch.testing.assert_close(_logits(tied.model), _logits(untied.model), rtol=0, atol=1e-5)
    # a tied sliced model is an ordinary tied checkpoint: it reloads with identical logits
    out = prunelab.save(tied, tmp_path / "ckpt")
    again = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert again.config.tie_word_embeddings is True and again.config.hidden_size == 24
    torch.testing.assert_close(_logits(again), _logits(tied.model), rtol=0, atol=1e-5)


def test_keep_tied_with_a_varying_final_scale_loses_little_to_the_untied_head():
    ref = _logits(_tied_lm().model, IDS)
    kls = {}
    for keep in (False, True):
        lm = _tied_lm()
        slice_stream(lm, SliceGPT(rotation="global", ratio=0.25, multiple=4, keep_tied=keep),
                     IDS, batch_size=2)
        kls[keep] = _kl(_logits(lm.model, IDS), ref)
    assert 0 < kls[False] and kls[True] < 2 * kls[False] + 1e-4, kls


def test_keep_tied_refusals():
    with pytest.raises(ConfigError, match="keep_tied needs rotation global"):
        SliceGPT(rotation="per-layer", keep_tied=True)
    lm = _lm("gemma")
    with pytest.raises(ConfigError, match="scales its embeddings"):
        SliceGPT(rotation="global", ratio=0.25, multiple=4, keep_tied=True).precheck(lm)
    with pytest.raises(ConfigError, match="keep_tied"):
        METHODS.from_dict({"name": "slicegpt", "rotation": "global", "keep_tied": "false"})


def test_gguf_only_allows_a_width_the_config_refuses_and_saving_says_why(tmp_path):
    """Hidden 24 with 3 heads of 8, sliced to 16: Llama's config wants the hidden size a
    multiple of the heads (refused without gguf_only); the model runs, writes a GGUF
    that states the head size, and refuses to be saved as a checkpoint."""
    from prunelab.checkpoint.gguf_export import write_gguf

    cfg = dict(name="slicegpt", rotation="global", ratio=1 / 3, multiple=8, keep_tied=True)
    # without gguf_only the nearest width the config takes is 24 itself: nothing to slice
    with pytest.raises(ConfigError, match="keeps d'=24 of 24"):
        METHODS.from_dict(cfg).precheck(_tied_lm(heads=3, hidden=24))
    lm = _tied_lm(heads=3, hidden=24, tokenizer=bpe_tokenizer())
    rep = prunelab.prune(lm, METHODS.from_dict({**cfg, "gguf_only": True}), CALIB,
                         batch_size=2)
    assert (rep["d_kept"], rep["path"]) == (16, "gguf")
    assert lm.model.config.hidden_size == 16 and lm.model.config.head_dim == 8
    assert torch.isfinite(_logits(lm.model)).all()
    with pytest.raises(UnsupportedOperationError, match="hidden size 16 is refused by"):
        prunelab.save(lm, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    gguf = pytest.importorskip("gguf")
    write_gguf(lm, tmp_path / "m.gguf", "f16")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")

    def value(key: str) -> int:
        return int(reader.fields[key].parts[reader.fields[key].data[0]][0])

    assert value("llama.embedding_length") == 16 and value("llama.attention.key_length") == 8
    assert "output.weight" not in {t.name for t in reader.tensors}  # the head is tied
