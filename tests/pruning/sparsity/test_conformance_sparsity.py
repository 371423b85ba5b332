"""Conformance of every registered sparsity method on the tiny-model matrix: it runs
through ``prunelab.prune``, meets its budget, saves, reloads with plain transformers with
identical outputs, and its manifest rebuilds the same config."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.data import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.linear import weight_out_in
from prunelab.models.loading import wrap
from prunelab.pruning import METHODS, sparsity_methods
from prunelab.pruning.linears import selected_linears

from tiny_models import ARCHS, char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(4, 16)
CALIB = TokenBatches(input_ids=IDS, spec="tiny", seqlen=16, samples=4, seed=0, mode="calib",
                     total_windows=4, sha256="0")


def configs(name: str, cls) -> list:
    """The method at 50 % unstructured and, unless it refuses patterns, at 2:4."""
    out = [cls(sparsity=0.5)]
    try:
        out.append(cls(pattern="2:4"))
    except ConfigError:  # e.g. qk-wanda: q and k share one unstructured budget
        pass
    return out


CASES = [pytest.param(arch, cfg, id=f"{name}-{cfg.pattern or cfg.sparsity}-{arch}")
         for name, cls in sparsity_methods().items() for cfg in configs(name, cls)
         for arch in ARCHS]


def outputs(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=IDS[:2])
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def check_budget(lm, cfg, rep) -> None:
    """Unstructured: every block's pruned linears within one weight per row of the
    block's target (a method may share the budget between linears); N:M: exactly N kept
    of every M consecutive weights of every row."""
    total = zeros = 0
    for i, target in enumerate(rep["per_block_sparsity"]):
        ws = [weight_out_in(m) for m in selected_linears(lm, i, cfg).values()]
        n, z = sum(w.numel() for w in ws), sum(int((w == 0).sum()) for w in ws)
        total, zeros = total + n, zeros + z
        if cfg.pattern:
            for w in ws:
                assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all(), i
        else:
            assert abs(z / n - target) <= max(1.0 / w.shape[1] for w in ws), i
    assert rep["achieved_sparsity"] == zeros / total
    assert abs(rep["achieved_sparsity"] - 0.5) <= (0.0 if cfg.pattern else 0.02)


@pytest.mark.parametrize(("arch", "cfg"), CASES)
def test_sparsity_method_conforms(arch, cfg, tmp_path):
    lm = wrap(tiny_model(arch), char_tokenizer(), spec=f"tiny-{arch}")
    fused = "qkv" in lm.adapter.spec.attn_proj
    if cfg.own_block_passes and fused:  # qk-wanda: refused before any data is read
        with pytest.raises(UnsupportedOperationError, match="fuses"):
            prunelab.prune(lm, cfg, "text:/nonexistent/file.txt")
        return
    if getattr(cfg, "needs_lm_loss", False) and lm.adapter.head() is None:
        with pytest.raises(UnsupportedOperationError, match="LM head"):  # cactus on bert
            prunelab.prune(lm, cfg, CALIB)
        return
    rep = prunelab.prune(lm, cfg, CALIB, batch_size=2)
    assert rep["method"] == cfg.registry_name and rep["operation"] == "prune-sparsity"
    check_budget(lm, cfg, rep)
    assert [ly["target"] for ly in rep["layers"]] == rep["per_block_sparsity"]
    out = prunelab.save(lm, tmp_path / "ckpt")
    cls = tf.AutoModel if arch == "bert" else tf.AutoModelForCausalLM
    again = cls.from_pretrained(out, attn_implementation="eager").eval()
    torch.testing.assert_close(outputs(again), outputs(lm.model), rtol=0, atol=0)
    man = json.loads((out / "manifest.json").read_text())
    last = man["operations"][-1]
    assert last["achieved_sparsity"] == rep["achieved_sparsity"]
    assert METHODS.from_dict(last["config"]) == cfg
