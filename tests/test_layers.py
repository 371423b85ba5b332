"""The house in floors: the import-linter contracts of ``.importlinter`` hold (every import
counted, those inside functions too), they fail on an upward import, and the root package
loads nothing heavy until a name is used."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports")
needs_linter = pytest.mark.skipif(LINT is None, reason="import-linter not installed "
                                  "(pip install -e .[dev])")


def _lint(src: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    return subprocess.run([LINT, "--config", str(ROOT / ".importlinter"), "--no-cache"],
                          cwd=src, env=env, capture_output=True, text=True)


@needs_linter
def test_contracts_kept():
    res = _lint(ROOT / "src")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 kept, 0 broken" in res.stdout


@needs_linter
@pytest.mark.parametrize("module, target", [
    ("io/lock.py", "prunelab.api"),                    # a floor reaching up, inside a function
    ("pruning/sparsity/masks.py", "prunelab.pruning.depth.config"),  # one family into another
    ("models/size.py", "prunelab.data.batches"),       # siblings on one floor
])
def test_contracts_catch_an_upward_import(tmp_path, module, target):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "prunelab", src / "prunelab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    with open(src / "prunelab" / module, "a") as f:
        f.write(f"\n\ndef _hidden():\n    import {target}  # noqa: F401\n")
    res = _lint(src)
    assert res.returncode != 0
    assert "BROKEN" in res.stdout and target in res.stdout


def test_root_package_is_lazy():
    code = ("import sys, prunelab; assert 'torch' not in sys.modules, 'torch'; "
            "assert 'transformers' not in sys.modules; print(prunelab.__version__); "
            "w = prunelab.Wanda; assert 'torch' in sys.modules; print(w.registry_name)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [__import__("prunelab").__version__, "wanda"]


def test_root_unknown_name_is_attribute_error():
    import prunelab

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        prunelab.Nope  # noqa: B018
    assert {"Wanda", "load", "prune", "__version__"} <= set(prunelab.__all__)


def test_root_subpackages_are_attributes():
    """``prunelab.probes.Interchange`` works right after ``import prunelab`` (the eager root
    used to import the sub-packages; the lazy one imports them on first use)."""
    code = ("import prunelab; print(prunelab.probes.Interchange.registry_name, "
            "prunelab.heal.HealConfig.__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["interchange", "HealConfig"]


def test_every_package_and_core_module_has_a_floor():
    """A top-level module or package missing from the floors contract would escape it."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    text = cfg["importlinter:contract:floors"]["layers"]
    listed = {p.strip().removeprefix("prunelab.") for p in
              text.replace(":", "|").replace("\n", "|").split("|") if p.strip()}
    src = ROOT / "src" / "prunelab"
    present = {p.stem for p in src.glob("*.py") if p.stem not in ("__init__", "__main__")}
    present |= {p.name for p in src.iterdir() if (p / "__init__.py").exists()}
    assert present == listed
