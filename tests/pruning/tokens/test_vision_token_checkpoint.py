"""Token pruning written into a checkpoint (``TokenPruner`` custom modules): the in-memory
model equals the runtime wrapper, the checkpoint reloads with ``trust_remote_code=True``
and gives identical outputs, and ``prune tokens --out`` writes it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.errors import ConfigError
from prunelab.models.loading import wrap
from prunelab.pruning.tokens import TokenPrunedEncoder, TokenPruning, install_token_pruning
from tiny_media import hidden, pixels, tiny_vision


@pytest.mark.parametrize("arch", ["dinov2", "vit"])
@pytest.mark.parametrize("fuse", [True, False])
def test_installed_pruning_equals_the_wrapper_and_reloads(arch, fuse, tmp_path):
    import prunelab

    dense = tiny_vision(arch)
    x = pixels(3).input_ids
    cfg = TokenPruning(keep=0.5, layers=(1, 2), fuse=fuse)
    want = TokenPrunedEncoder(wrap(dense), cfg)(x)
    lm = wrap(copy.deepcopy(dense))
    paths = install_token_pruning(lm, cfg)
    assert len(paths) == 2 and paths[0].endswith("1.token_pruner")
    got = hidden(lm.model, x)
    # fuse: 16 patches -> 8 + 1 fused at block 1 -> ceil(9 / 2) = 5 + 1 at block 2;
    # drop: 16 -> 8 -> 4 (CLS first in both)
    assert got.shape[1] == (1 + 5 + 1 if fuse else 1 + 4)
    assert torch.equal(got, want)
    # a distinct folder name per case: transformers caches remote code by folder name
    out = prunelab.save(lm, tmp_path / f"tok_{arch}_{fuse}")
    cfg_json = json.loads((out / "config.json").read_text())
    assert [m["kind"] for m in cfg_json["prunelab_modules"]] == ["token_pruner"] * 2
    with pytest.raises(ValueError, match="custom code"):  # needs its modeling file
        tf.AutoModel.from_pretrained(out)
    again = tf.AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    assert torch.equal(hidden(again, x), got)


def test_keep_one_installs_the_dense_function_and_refuses_twice():
    dense = tiny_vision()
    x = pixels(2).input_ids
    lm = wrap(copy.deepcopy(dense))
    install_token_pruning(lm, TokenPruning(keep=1.0, layers=(0,)))
    assert torch.equal(hidden(lm.model, x), hidden(dense, x))
    with pytest.raises(ConfigError, match="already prunes tokens"):
        install_token_pruning(lm, TokenPruning(keep=0.5, layers=(0,)))


def test_cli_prune_tokens_out_writes_a_reloadable_checkpoint(tmp_path):
    from prunelab.cli import cli_main

    ckpt = tmp_path / "tiny"
    dense = tiny_vision()
    dense.save_pretrained(ckpt)
    out = tmp_path / "tokens"
    rc = cli_main(["prune", "tokens", "--model", str(ckpt), "--budget", "keep-tokens:0.5",
                   "--layers", "1",
                   "--samples", "3", "--size", "56", "--lfw-size", "28", "--out", str(out),
                   "--json", str(tmp_path / "r.json")])
    assert rc == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["operations"][-1]["operation"] == "prune-tokens"
    assert man["operations"][-1]["config"]["keep"] == 0.5
    x = pixels(2).input_ids
    again = tf.AutoModel.from_pretrained(out, trust_remote_code=True).eval()
    want = TokenPrunedEncoder(wrap(dense), TokenPruning(keep=0.5, layers=(1,)))(x)
    assert torch.equal(hidden(again, x), want)
    # an existing --out is refused before any work
    assert cli_main(["prune", "tokens", "--model", str(ckpt), "--out", str(out)]) == 2


def test_prune_verb_installs_token_pruning_without_data():
    """``prunelab.prune(lm, TokenPruning(...))`` goes through the method registry like every
    method: no calibration data read, the operation recorded, the model then prunes its own
    tokens exactly as the runtime wrapper does."""
    from prunelab.pruning import METHODS, pruner_for
    from prunelab.workflow.recipe import load_recipe

    dense = tiny_vision()
    cfg = TokenPruning(keep=0.5, layers=(1,))
    want = TokenPrunedEncoder(wrap(copy.deepcopy(dense)), cfg)(pixels(2).input_ids)
    lm = wrap(dense)
    rep = prunelab.prune(lm, cfg, data="no-such-spec:never-read")
    assert rep["operation"] == "prune-tokens" and rep["method"] == "tokens"
    assert rep["data"] is None and rep["modules"] == ["encoder.layer.1.token_pruner"]
    assert lm.history[-1]["modules"] == rep["modules"]
    assert torch.equal(hidden(lm.model, pixels(2).input_ids), want)
    assert METHODS.get("tokens") is TokenPruning and pruner_for(cfg).needs_data is False
    # a recipe stage names it like any method
    rec = load_recipe({"model": "dinov2-small", "stages": [
        {"prune": {"method": "tokens", "keep": 0.5, "layers": [1]}}]})
    assert rec.stages[0].options.method == cfg


def test_prune_verb_refuses_token_pruning_on_a_text_model():
    from prunelab.errors import PrunelabError

    from tiny_models import tiny_model

    with pytest.raises(PrunelabError):
        prunelab.prune(wrap(tiny_model("llama")), TokenPruning(keep=0.5, layers=(1,)))


def test_checkpoints_of_two_bases_reload_right_in_one_process(tmp_path):
    """transformers keys weight renames of remote code by class name, process-wide: each
    base gets its own generated class (``PrunelabDinov2Model``, ``PrunelabViTModel``), so
    reloading a DINOv2 checkpoint after a ViT one keeps the DINOv2 weights (with one shared
    name the ViT renames left it partly random)."""
    x = pixels(2).input_ids
    got = {}
    for arch in ("dinov2", "vit"):
        lm = wrap(tiny_vision(arch))
        install_token_pruning(lm, TokenPruning(keep=0.5, layers=(1,)))
        got[arch] = hidden(lm.model, x)
        out = prunelab.save(lm, tmp_path / arch / "same_name")
        cfg = json.loads((out / "config.json").read_text())
        base = "Dinov2Model" if arch == "dinov2" else "ViTModel"
        assert cfg["architectures"] == [f"Prunelab{base}"]
    for arch in ("dinov2", "vit", "dinov2"):
        again = tf.AutoModel.from_pretrained(tmp_path / arch / "same_name",
                                             trust_remote_code=True).eval()
        assert torch.equal(hidden(again, x), got[arch]), arch


def test_vit_runs_at_any_image_size_and_natively_as_before():
    """ViT's position embeddings are interpolated to the photos' size (as DINOv2's always
    are); at the model's own size the interpolation is the identity."""
    from prunelab.pruning.tokens import evaluate_token_pruning

    dense = tiny_vision("vit")
    lm = wrap(dense)
    x = pixels(2).input_ids
    native = lm.adapter.base(**lm.adapter.model_inputs(x)).last_hidden_state
    assert torch.equal(native, hidden(dense, x))
    res = evaluate_token_pruning(lm, TokenPruning(keep=0.5, layers=(1,)), samples=3,
                                 size=84, lfw_size=28, speed=False)
    assert res["tokens_per_block"] == [1 + 36, 1 + 18 + 1, 20, 20]
    assert 0.5 < res["lfw_accuracy"] <= 1.0
