"""The CLI starts without torch: importing it, and the help of the root, of a group and of
a command with generated options, import neither torch nor transformers (the options come
from the catalog, which a child process builds). The catalog matches the live registries
and is rebuilt when a fingerprinted source changes. (Speed: benchmarks/cli_startup.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prunelab.cli import catalog

ROOT = Path(__file__).resolve().parents[2]

PROBE = ("import sys, json, io, contextlib\n"
         "from prunelab.cli import cli_main\n"
         "buf = io.StringIO()\n"
         "with contextlib.redirect_stdout(buf):\n"
         "    code = cli_main(json.loads(sys.argv[1]))\n"
         "print(json.dumps({'code': code, 'out': buf.getvalue(),\n"
         "                  'heavy': sorted({'torch', 'transformers'} & set(sys.modules))}))\n")


def python(*args, env=None):
    env = dict(os.environ, COLUMNS="200", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"),
                                                    os.environ.get("PYTHONPATH")) if p)
    env.pop("PRUNELAB_PLUGINS", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_import_leaves_torch_out():
    res = python("-c", "import prunelab.cli, sys; "
                 "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def catalog_cache(tmp_path_factory):
    """One catalog cache for the help checks: the first builds the catalog in its child
    process (the path of a first run), the others read it back (every later run); building
    it costs a torch import each time, and rebuilding is checked below."""
    return tmp_path_factory.mktemp("catalog")


@pytest.mark.parametrize("args", [["--help"], ["prune", "--help"],
                                  ["prune", "sparsity", "--help"], ["prune", "depth", "--help"],
                                  ["prune", "width", "--help"], ["probe", "--help"],
                                  ["heal", "--help"], ["eval", "--help"],
                                  ["prune", "factor", "--help"]])
def test_help_imports_no_torch(args, catalog_cache):
    res = python("-c", PROBE, json.dumps(args), env={"PRUNELAB_CACHE": str(catalog_cache)})
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["code"] == 0 and got["heavy"] == []
    text = " ".join(got["out"].split())
    if args[:2] == ["prune", "sparsity"]:  # the registered names and their options
        assert "wanda" in text and "sparsegpt" in text and "--owl-m" in text
        assert "--qk-variant" in text and "--no-reorder" in text and "--percdamp" in text
    if args[:2] == ["prune", "depth"]:
        assert "--beam-width" in text and "--rank" in text and "lra" in text
    if args[:2] == ["prune", "width"]:
        assert "--channel-group" in text and "--taper-slope" in text and "cocurve" in text
    if args == ["probe", "--help"]:
        assert "block-influence" in text and "--induction-length" in text
    if args == ["heal", "--help"]:  # generated from HealConfig
        assert "--lora-rank" in text and "--prune-every" in text and "remove-units:F" in text
    if args == ["eval", "--help"]:  # the presses' options
        assert "--press-window" in text and "remove-cache:F" in text
    if args[:2] == ["prune", "factor"]:
        assert "--refit" in text and "--no-refit" in text and "--types" in text


def test_catalog_matches_the_live_registries():
    live = catalog.live_registries()
    built = catalog.build()
    child = catalog._build_in_child()
    # the child process sees prunelab's own pieces only; this process may also hold pieces
    # that earlier tests registered (examples, plugins): compare prunelab's own
    from prunelab.probes import PROBES

    def ours(kind: str, name: str) -> bool:
        cls = PROBES.get(name) if kind == "probes" else live[kind][name]
        return cls.__module__.startswith("prunelab.")

    own = {k: [e for e in built["kinds"][k] if ours(k, e["name"])] for k in catalog.KINDS}
    assert child == json.loads(json.dumps({"version": built["version"], "kinds": own}))
    for kind in catalog.KINDS:
        assert catalog.names(built, kind) == list(live[kind])
    from prunelab.pruning import RECOVERIES, STRATEGIES
    from prunelab.pruning.options import flat_options

    for kind, reg in (("strategies", STRATEGIES), ("recoveries", RECOVERIES)):
        flats = {f["flat"] for e in built["kinds"][kind] for f in e["fields"]}
        assert flats == set(flat_options(reg))
    lra = next(e for e in built["kinds"]["recoveries"] if e["name"] == "lra")
    rank = next(f for f in lra["fields"] if f["name"] == "rank")
    assert rank == {"name": "rank", "flat": "rank", "flag": "--rank", "kind": "int",
                    "optional": True, "choices": None, "default": None,
                    "help": "lra: rank of the adapter", "negate": False, "range": None,
                    "budget": None, "aliases": [], "toggle": False}


def test_catalog_is_rebuilt_when_a_source_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNELAB_CACHE", str(tmp_path / "cache"))
    plugin = tmp_path / "plug.py"
    plugin.write_text("from dataclasses import dataclass\n"
                      "from prunelab.pruning import RECOVERIES, Recovery\n"
                      "@RECOVERIES.register('plug-a')\n"
                      "@dataclass(frozen=True)\n"
                      "class A(Recovery):\n    '''first'''\n")
    monkeypatch.setenv("PRUNELAB_PLUGINS", str(plugin))
    first = catalog.get(live=False)
    assert "plug-a" in catalog.names(first, "recoveries")
    assert catalog.cache_path(first["key"]).is_file()
    assert catalog.get(live=False) == first  # read back, same key
    plugin.write_text(plugin.read_text().replace("plug-a", "plug-bb"))
    second = catalog.get(live=False)
    assert second["key"] != first["key"]
    assert "plug-bb" in catalog.names(second, "recoveries")
    assert "plug-a" not in catalog.names(second, "recoveries")
    # a package source file's mtime is part of the key too
    src = Path(catalog.__file__)
    st = src.stat()
    try:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        assert catalog.fingerprint() != second["key"]
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert catalog.fingerprint() == second["key"]
