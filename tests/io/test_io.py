"""Atomic saves, overwrite protection and the manifest."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import prunelab
from prunelab.errors import OutputExistsError, UnsupportedOperationError
from prunelab.io.files import write_json
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, tiny_model, tiny_tokens


def test_save_reload_identical_logits_and_manifest(tmp_path):
    lm = wrap(tiny_model("llama"), char_tokenizer(), spec="tiny-llama")
    before = prunelab.models.size.model_size(lm.model)
    lm.adapter.delete_blocks([0])
    out = prunelab.save(lm, tmp_path / "ckpt", operation="delete-blocks",
                        config={"blocks": [0]}, before=before)
    ids = tiny_tokens(2, 9)
    reloaded = tf.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, lm.model(input_ids=ids).logits,
                                   rtol=0, atol=0)
    man = json.loads((out / "manifest.json").read_text())
    assert man["source_model"]["spec"] == "tiny-llama"
    assert man["operations"] == [{"operation": "delete-blocks", "config": {"blocks": [0]}}]
    assert man["size_before"]["params"] > man["size_after"]["params"]
    assert man["num_blocks"] == 3 and "transformers" in man["versions"]
    assert tf.AutoTokenizer.from_pretrained(out)("ab")["input_ids"] == [97, 98]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary leftovers


def test_save_refuses_existing_and_overwrites_only_its_own_checkpoint(tmp_path):
    lm = wrap(tiny_model("gpt2"), char_tokenizer())
    target = tmp_path / "out"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a user's folder that looks like a checkpoint
    (target / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        prunelab.save(lm, target)
    with pytest.raises(OutputExistsError, match=r"is not a checkpoint prunelab wrote \(no "
                       r"prunelab manifest.json\): --overwrite would lose config.json, "
                       r"keep.txt; it replaces only"):
        prunelab.save(lm, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "keep.txt"]
    (target / "keep.txt").unlink()
    (target / "config.json").unlink()
    prunelab.save(lm, target, overwrite=True)  # an empty folder
    listed = json.loads((target / "manifest.json").read_text())["files"]
    assert sorted(listed) == sorted(p.name for p in target.iterdir())
    prunelab.save(lm, target, overwrite=True)  # its own checkpoint: replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
def test_save_refuses_shapes_a_plain_config_cannot_hold(tmp_path):
    lm = wrap(tiny_model("llama"))
    lm.adapter.slice_ffn(1, range(8))
    with pytest.raises(UnsupportedOperationError):
        prunelab.save(lm, tmp_path / "x")
    assert not any(tmp_path.iterdir())


def test_write_json_atomic(tmp_path):
    p = write_json(tmp_path / "a.json", {"x": torch.tensor(1.5), "p": tmp_path})
    assert json.loads(p.read_text()) == {"x": 1.5, "p": str(tmp_path)}
    with pytest.raises(OutputExistsError):
        write_json(p, {"y": 1})
    write_json(p, {"y": 1}, overwrite=True)
    assert json.loads(p.read_text()) == {"y": 1}
    assert [q.name for q in tmp_path.iterdir()] == ["a.json"]
