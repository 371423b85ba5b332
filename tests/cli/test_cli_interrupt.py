"""Ctrl-C at any moment after prunelab starts, the imports of the command line included,
is exit 130 with one line and no traceback (issue 39, class 4). The child restores the
default SIGINT handler (a background job of a non-interactive shell starts with SIGINT
ignored, and Python would then keep ignoring it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# the child: the interpreter (and its site imports) is up, it says so, then runs prunelab
# exactly as `python -m prunelab` does
STARTED = ("import sys, prunelab.__main__ as m; print('started', flush=True); "
           "sys.argv = ['prunelab', *sys.argv[1:]]; m.main()")

# the child sends itself a real SIGINT when the command line starts importing typer (the
# middle of `from prunelab.cli import run`), so the interrupt lands in the imports
DURING_IMPORT = """
import importlib.abc, os, signal, sys
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "typer":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Hook())
import prunelab.__main__ as m
sys.argv = ["prunelab", *sys.argv[1:]]
m.main()
"""


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _child(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_default_sigint)


def _assert_one_line_130(proc: subprocess.Popen, out: str, err: str) -> None:
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), err


def test_ctrl_c_during_the_imports_is_130_and_one_line(tmp_path):
    proc = _child(DURING_IMPORT, "info", "--model", str(tmp_path / "none"))
    out, err = proc.communicate(timeout=120)
    _assert_one_line_130(proc, out, err)
    assert err.strip() == "interrupted: nothing was written"
    assert out == ""


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.1, 0.25, 0.5])
def test_ctrl_c_in_the_first_seconds_is_130_and_one_line(delay, tmp_path):
    """SIGINT at several moments of the start (imports, option parsing, the model load)."""
    from tiny_models import save_tiny_checkpoint

    model = save_tiny_checkpoint("llama", tmp_path / "m")
    proc = _child(STARTED, "eval", "--model", str(model), "--data", "text:" + __file__,
                  "--seqlen", "16", "--samples", "2", "--json", str(tmp_path / "e.json"))
    assert proc.stdout.readline().strip() == "started"
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    _assert_one_line_130(proc, out, err)
    assert not (tmp_path / "e.json").exists()


# library code that swallows the interrupt (as C functions that clear any error do) at the
# moment a module is imported, and leaves a marker file saying it did
SWALLOWED = """
import importlib.abc, os, signal, sys
marker, target, then = sys.argv[1], sys.argv[2], sys.argv[3]
class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target_=None):
        if name == target:
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # the handler runs between bytecodes
                    pass
            except KeyboardInterrupt:
                pass
            open(marker, "w").write("swallowed")
            if then == "fail":  # what a half-imported package does next
                raise ImportError("cannot import name 'x' from partially initialized module")
        return None
sys.meta_path.insert(0, Hook())
import prunelab.__main__ as m
sys.argv = ["prunelab", *sys.argv[4:]]
m.main()
"""


def test_a_ctrl_c_swallowed_during_the_imports_still_stops_the_command(tmp_path):
    """The interrupt lands while transformers imports accelerate, inside code that swallows
    it: the command must not go on to run and write its output."""
    from tiny_models import save_tiny_checkpoint

    model = save_tiny_checkpoint("llama", tmp_path / "m")
    marker = tmp_path / "marker"
    proc = _child(SWALLOWED, str(marker), "accelerate", "go-on", "eval", "--model",
                  str(model), "--data", "text:" + __file__, "--seqlen", "16", "--samples",
                  "2", "--json", str(tmp_path / "e.json"))
    out, err = proc.communicate(timeout=300)
    assert marker.read_text() == "swallowed"
    _assert_one_line_130(proc, out, err)
    assert not (tmp_path / "e.json").exists()


def test_an_import_that_fails_after_a_swallowed_ctrl_c_is_130_not_a_traceback(tmp_path):
    """A half-imported package fails its next import: that is the interrupt's consequence
    (CI saw accelerate's 'partially initialized module' ImportError), reported as exit 130."""
    marker = tmp_path / "marker"
    proc = _child(SWALLOWED, str(marker), "typer", "fail", "info", "--model",
                  str(tmp_path / "none"))
    out, err = proc.communicate(timeout=120)
    assert marker.read_text() == "swallowed"
    _assert_one_line_130(proc, out, err)
    assert err.strip() == "interrupted: nothing was written"


def test_an_import_failure_without_ctrl_c_is_still_a_bug_traceback(tmp_path):
    """Only an interrupt turns a failure into exit 130: the same ImportError alone is exit 1
    with its traceback."""
    code = SWALLOWED.replace("os.kill(os.getpid(), signal.SIGINT)", "pass")
    marker = tmp_path / "marker"
    proc = _child(code, str(marker), "typer", "fail", "info", "--model", str(tmp_path / "n"))
    out, err = proc.communicate(timeout=120)
    assert marker.read_text() == "swallowed"
    assert proc.returncode == 1 and "partially initialized module" in err
