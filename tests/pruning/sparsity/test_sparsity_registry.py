"""A sparsity method registered from outside the package: this file alone defines it,
registers it, and runs it through ``prunelab.prune``, ``prunelab.save`` and the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError
from prunelab.models.linear import weight_out_in
from prunelab.models.loading import wrap
from prunelab.pruning import METHODS, SparsityConfig, sparsity_methods
from prunelab.pruning.sparsity.config import config_options

from tiny_models import SAMPLE_TEXT, char_tokenizer, save_tiny_checkpoint, tiny_model, tiny_tokens


def column_scale(d_in: int, seed: int) -> torch.Tensor:
    """``s_j`` in ``[0.5, 1.5)``, one per input column, from ``torch.Generator(seed)``."""
    return torch.rand(d_in, generator=torch.Generator().manual_seed(seed)) + 0.5


@METHODS.register("random-scaled-magnitude")
@dataclass(frozen=True)
class RandomScaledMagnitude(SparsityConfig):
    """Prune the smallest ``|W_ij| * s_j`` (``s`` a random per-column scale); no data."""

    scale_seed: int = field(default=0, metadata={
        "help": "random-scaled-magnitude: seed of the column scales"})

    def prune_weight(self, w, accs, sparsity):
        score = w.abs() * column_scale(w.shape[1], self.scale_seed).to(w.device)
        return w * self.keep_mask(score, sparsity)


def expected_kept(w: torch.Tensor, seed: int, sparsity: float) -> torch.Tensor:
    """Kept mask by hand: per row, everything above the k-th smallest score."""
    score = w.abs() * column_scale(w.shape[1], seed)
    k = int(w.shape[1] * sparsity)
    kth = torch.kthvalue(score, k, dim=1).values[:, None]
    return score > kth


def test_a_method_from_outside_is_listed_and_strict():
    assert sparsity_methods()["random-scaled-magnitude"] is RandomScaledMagnitude
    assert {"magnitude", "wanda", "sparsegpt", "rose", "qk-wanda"} <= set(sparsity_methods())
    assert "depth" not in sparsity_methods()
    opts = {o["name"]: o for o in config_options(RandomScaledMagnitude)}
    assert opts["scale_seed"]["default"] == 0 and opts["scale_seed"]["type"] is int
    assert opts["sparsity"]["help"].startswith("unstructured target")
    with pytest.raises(ConfigError, match="no option 'seed'.*scale_seed"):
        METHODS.make("random-scaled-magnitude", seed=1)


def test_prune_with_a_user_method_gives_the_hand_computed_mask(tmp_path):
    cfg = RandomScaledMagnitude(sparsity=0.5, scale_seed=3)
    dense = tiny_model("llama")
    before = {n: weight_out_in(m).detach().clone() for n, m in dense.named_modules()
              if isinstance(m, torch.nn.Linear)}
    lm = wrap(dense, char_tokenizer(), spec="tiny-llama")
    ids = tiny_tokens(2, 8)
    calib = TokenBatches(input_ids=ids, spec="tiny", seqlen=8, samples=2, seed=0,
                         mode="calib", total_windows=2, sha256="0")
    rep = prunelab.prune(lm, cfg, calib, batch_size=2)
    assert rep["method"] == "random-scaled-magnitude"
    assert rep["block_evaluations"] == lm.adapter.num_blocks  # no statistics: one pass
    for name, m in lm.model.named_modules():
        if not isinstance(m, torch.nn.Linear):
            continue
        w = weight_out_in(m)
        if name == "lm_head":
            assert torch.equal(w, before[name])
            continue
        keep = expected_kept(before[name], 3, 0.5)
        assert torch.equal(w != 0, keep), name
        assert torch.equal(w[keep], before[name][keep]), name  # kept weights unchanged
    out = prunelab.save(lm, tmp_path / "ckpt")
    man = json.loads((out / "manifest.json").read_text())
    assert METHODS.from_dict(man["operations"][-1]["config"]) == cfg


def test_the_cli_runs_a_user_method(tmp_path):
    from typer.testing import CliRunner

    from prunelab.cli import app

    save_tiny_checkpoint("llama", tmp_path / "model")
    (tmp_path / "text.txt").write_text(SAMPLE_TEXT)
    out = tmp_path / "pruned"
    res = CliRunner().invoke(app, [
        "--quiet", "prune", "sparsity", "--model", str(tmp_path / "model"), "--data",
        f"text:{tmp_path / 'text.txt'}", "--samples", "2", "--seqlen", "16",
        "--method", "random-scaled-magnitude", "--set", "scale_seed=3", "--budget",
        "remove-weights:0.5",
        "--out", str(out)])
    assert res.exit_code == 0, res.output
    man = json.loads((out / "manifest.json").read_text())
    assert METHODS.from_dict(man["operations"][-1]["config"]) == \
        RandomScaledMagnitude(sparsity=0.5, scale_seed=3)
    dense, pruned = tiny_model("llama"), prunelab.load(str(out)).model
    w0 = dense.model.layers[1].mlp.down_proj.weight
    w1 = pruned.model.layers[1].mlp.down_proj.weight
    assert torch.equal(w1 != 0, expected_kept(w0, 3, 0.5))
