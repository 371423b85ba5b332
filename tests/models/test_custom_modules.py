"""prunelab's custom modules (factorized linears, hooks) survive a checkpoint: the generated
modeling file rebuilds and re-wires them, and the reloaded model gives identical logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from torch import nn

import prunelab
from prunelab.models.custom import (
    LowRankLinear,
    PrunelabModule,
    custom_modules,
    flops_per_token,
    install,
    register_module,
)
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, tiny_model, tiny_tokens

IDS = tiny_tokens(2, 10, seed=3)


@register_module
class _ScaleOwnerOutput(PrunelabModule):
    """Test module: multiplies its owner's output by a learned per-channel scale (a hook)."""

    prunelab_kind = "test_scale_owner_output"

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.scale = nn.Parameter(torch.ones(dim))

    def prunelab_spec(self) -> dict:
        return {"dim": self.dim}

    def prunelab_attach(self, owner, root) -> None:
        owner.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        return output * self.scale


def test_low_rank_linear_holds_the_product_and_counts_its_flops():
    a, b = torch.randn(3, 5), torch.randn(4, 3)
    mod = LowRankLinear.from_factors(a, b, bias=torch.ones(4))
    x = torch.randn(2, 5)
    torch.testing.assert_close(mod(x), x @ (b @ a).T + 1)
    torch.testing.assert_close(mod.dense_weight(), b @ a)
    assert (mod.in_features, mod.out_features, mod.rank) == (5, 4, 3)
    # 2 * (3*5 + 4*3) multiply-adds x 2; the bias is one add per output (counted as params)
    assert mod.flops_per_token() == 2 * (15 + 12 + 4)
    seq = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2, bias=False))
    assert flops_per_token(seq) == 2 * (35 + 14)
    seq[0] = mod  # a custom module is counted by its own rule, its children not again
    assert flops_per_token(seq) == 2 * (15 + 12 + 4) + 2 * 14


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "phi3"])
def test_custom_modules_reload_with_identical_logits(arch, tmp_path):
    lm = wrap(tiny_model(arch), char_tokenizer(), spec="tiny")
    ad = lm.adapter
    names = {id(m): n for n, m in lm.model.named_modules()}
    target = next(iter(ad.linears(1).values()))
    path = names[id(target)]
    w = target.weight.detach()
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    k = 3
    install(lm.model, path, LowRankLinear.from_factors(
        s[:k, None] * vh[:k], u[:, :k], bias=target.bias, like=target))
    mlp_path = names[id(ad.mlp(2))]
    scale = install(lm.model, mlp_path + ".prunelab_scale",
                    _ScaleOwnerOutput(lm.model.config.hidden_size))
    with torch.no_grad():
        scale.scale.copy_(torch.linspace(0.5, 1.5, scale.dim))
    assert [p for p, _ in custom_modules(lm.model)] == [path, mlp_path + ".prunelab_scale"]
    with torch.no_grad():
        ref = lm.model(input_ids=IDS, use_cache=False).logits
    out = prunelab.save(lm, tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    assert [m["kind"] for m in cfg["prunelab_modules"]] == ["low_rank_linear",
                                                           "test_scale_owner_output"]
    again = tf.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    with torch.no_grad():
        got = again(input_ids=IDS, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert type(again.get_submodule(path)).__name__ == "LowRankLinear"
    man = json.loads((out / "manifest.json").read_text())
    assert man["remote_code"]["modules"][0] == {"module": path, "kind": "low_rank_linear"}
    # the hook matters: without it the logits differ
    with torch.no_grad():
        again.get_submodule(mlp_path + ".prunelab_scale").scale.fill_(1.0)
        assert not torch.equal(again(input_ids=IDS, use_cache=False).logits, ref)


def test_a_reloaded_checkpoint_saves_again_with_its_custom_modules(tmp_path):
    """Modules rebuilt from a modeling file are copies of prunelab's classes: they are still
    found, counted, and written again (load -> save -> load keeps the logits)."""
    from prunelab.models.custom import flops_per_token

    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny")
    names = {id(m): n for n, m in lm.model.named_modules()}
    target = lm.adapter.linears(0)["mlp.down_proj"]
    w = target.weight.detach()
    install(lm.model, names[id(target)], LowRankLinear.from_factors(
        w[:5], torch.eye(w.shape[0])[:, :5], like=target))
    first = prunelab.save(lm, tmp_path / "a")
    back = prunelab.load(str(first), trust_remote_code=True)
    assert [p for p, _ in custom_modules(back.model)] == [names[id(target)]]
    assert flops_per_token(back.model) == flops_per_token(lm.model)
    second = prunelab.save(back, tmp_path / "b")
    again = tf.AutoModelForCausalLM.from_pretrained(
        second, trust_remote_code=True,
        attn_implementation=lm.model.config._attn_implementation).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS, use_cache=False).logits,
                                   lm.model(input_ids=IDS, use_cache=False).logits,
                                   rtol=0, atol=0)
