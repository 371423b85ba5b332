"""Model specs: local directories, embedded packages, error paths."""

from __future__ import annotations

import sys

import pytest
import torch

import prunelab
from prunelab.errors import ConfigError, ModelNotFoundError, UnsupportedArchitectureError
from prunelab.models.embedded import EMBEDDED
from prunelab.models.loading import resolve_device, resolve_dtype
from prunelab.paths import package_file

from tiny_models import save_tiny_checkpoint


def test_load_local_checkpoint(tmp_path):
    save_tiny_checkpoint("qwen2", tmp_path)
    lm = prunelab.load(str(tmp_path))
    assert lm.adapter.family == "llama" and lm.model.dtype == torch.float32
    assert not lm.model.training and lm.tokenizer is not None
    lm16 = prunelab.load(str(tmp_path), dtype="bfloat16")
    assert lm16.model.dtype == torch.bfloat16
    info = prunelab.info(lm)
    assert (info["blocks"], info["heads"], info["kv_heads"], info["head_dim"], info["ffn"]) == \
        (4, 4, 2, 8, 48)
    assert info["block_details"][0]["attention"]["k"] == [16, 32]


def test_missing_path_and_not_a_checkpoint(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        prunelab.load(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        prunelab.load(str(tmp_path))
    (tmp_path / "f.bin").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        prunelab.load(str(tmp_path / "f.bin"))


def test_unknown_architecture(tmp_path):
    import transformers as tf

    cfg = tf.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="supported: bert"):
        prunelab.load(str(tmp_path))


def test_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    from prunelab.io import hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE",
                        huggingface_hub.constants.HF_HUB_OFFLINE)
    hub.reset()
    try:
        with pytest.raises(ModelNotFoundError, match="smollm2-135m") as err:
            prunelab.load("some-org/some-model-that-is-not-cached")
    finally:
        hub.reset()
    assert "this machine is offline (HF_HUB_OFFLINE is set)" in str(err.value)


def test_a_device_the_machine_lacks_is_one_line(monkeypatch):
    """cuda:7 on a one-GPU machine used to pass and fail later with a traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"^--device cuda:7: this machine has 1 CUDA device "
                       r"\(cuda:0 to cuda:0\)$"):
        resolve_device("cuda:7")
    for bad in ("cuda:x", "cuda:-1", "cudax", "bogus"):
        with pytest.raises(ConfigError, match="--device must be cpu, cuda, cuda:N or auto"):
            resolve_device(bad)


def test_dtype_and_device_validation():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ConfigError, match="--dtype"):
        resolve_dtype("int3", torch.device("cpu"))
    with pytest.raises(ConfigError, match="--device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


def test_embedded_files_found_without_importing_packages():
    missing, checked = [], 0
    for em in EMBEDDED.values():
        for dist, module, rel in em.packages:
            path = package_file(dist, module, rel)
            if path is None:  # e.g. the 1.5B, installed only on request
                missing.append(dist)
                continue
            assert path.is_file() and path.stat().st_size > 1000
            assert module not in sys.modules, f"{module} was imported"
            checked += 1
    if missing:  # every installed package was checked above
        pytest.skip(f"checked {checked}; not installed: {', '.join(missing[:3])}"
                    + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))


def test_gguf_path_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    """A .gguf spec goes through the converter, keyed by the file's sha256, and the
    converted directory is then loaded like any checkpoint."""
    from prunelab.models import loading

    from tiny_models import save_tiny_checkpoint

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-not-really")
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(path, name=None):
        calls.append((path, name))
        return save_tiny_checkpoint("llama", tmp_path / "converted")

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    lm = prunelab.load(str(gguf))
    assert calls == [(gguf.resolve(), None)] and lm.adapter.num_blocks == 4
    assert lm.source == str(tmp_path / "converted")
