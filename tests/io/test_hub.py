"""Offline is detected once per process (prunelab.io.hub): a model or data set that is not
local then fails at once in one line, without the hub libraries' retries; with a network
nothing changes."""

from __future__ import annotations

import os
import time

import pytest

from prunelab.cli import cli_main
from prunelab.io import hub

from tiny_models import cli

MISSING_MODEL = "prunelab-tests/no-such-model"


@pytest.fixture
def fresh(monkeypatch):
    """A clean answer, and the hub libraries' offline switches restored afterwards."""
    import datasets.config
    import huggingface_hub.constants

    for name in hub._ENV + ("HF_ENDPOINT",):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE",
                        huggingface_hub.constants.HF_HUB_OFFLINE)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setattr(datasets.config, name, getattr(datasets.config, name))
    hub.reset()
    yield monkeypatch
    hub.reset()


def _one_error_line(code, cap):
    text = cap.out + cap.err
    assert code == 2, text
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert "Traceback" not in text and "Retrying" not in text, text
    return lines[0]


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_the_environment_says_offline(fresh, value):
    fresh.setenv("HF_HUB_OFFLINE", value)
    fresh.setattr(hub, "_probe", lambda: pytest.fail("probed although HF_HUB_OFFLINE is set"))
    assert hub.offline_reason() == "HF_HUB_OFFLINE is set"


def test_the_probe_runs_once_and_switches_the_libraries_offline(fresh):
    import datasets.config
    import huggingface_hub.constants

    calls = []
    fresh.setattr(hub, "_probe", lambda: calls.append(1) or "huggingface.co cannot be reached")
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    datasets.config.HF_HUB_OFFLINE = False
    for _ in range(3):
        assert hub.offline_reason() == "huggingface.co cannot be reached"
    assert calls == [1]
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True
    assert datasets.config.HF_HUB_OFFLINE is True


def test_online_changes_nothing(fresh):
    import huggingface_hub.constants

    fresh.setattr(hub, "_probe", lambda: None)
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    assert hub.offline_reason() is None
    assert "HF_HUB_OFFLINE" not in os.environ
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_a_refused_connection_is_offline_at_once(fresh):
    fresh.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        fresh.delenv(name, raising=False)
    start = time.monotonic()
    reason = hub._probe()
    assert reason is not None and reason.startswith("127.0.0.1 cannot be reached")
    assert time.monotonic() - start < hub.PROBE_TIMEOUT_S + 1


def test_the_probe_goes_through_the_proxy(fresh):
    fresh.setenv("HF_ENDPOINT", "https://hub.example")
    fresh.setenv("https_proxy", "http://proxy.example:3128")
    fresh.delenv("no_proxy", raising=False)
    fresh.delenv("NO_PROXY", raising=False)
    assert hub._target() == ("proxy.example", 3128, "the proxy proxy.example")


@pytest.mark.parametrize("argv", [
    ["eval", "--model", MISSING_MODEL, "--samples", "2", "--seqlen", "16"],
    ["eval", "--model", "no-such-model-name", "--samples", "2", "--seqlen", "16"],
])
def test_a_model_not_local_offline_is_one_line(fresh, capsys, argv):
    fresh.setattr(hub, "_probe", lambda: "huggingface.co cannot be reached: no network")
    start = time.monotonic()
    code = cli_main(["--quiet", *argv])
    line = _one_error_line(code, capsys.readouterr())
    assert "this machine is offline (huggingface.co cannot be reached: no network)" in line
    assert repr(argv[2]) in line and "embedded models: smollm2-135m" in line
    assert time.monotonic() - start < 20  # the hub's retries alone took 23 s


@pytest.mark.parametrize("data", ["c4", "wikitext2:calib"])
def test_hub_data_not_local_offline_is_one_line(fresh, capsys, tmp_path, data):
    from tiny_models import save_tiny_checkpoint

    model = save_tiny_checkpoint("llama", tmp_path / "m")
    fresh.setenv("HF_HUB_OFFLINE", "1")
    code = cli_main(["--quiet", "eval", "--model", str(model), "--data", data,
                     "--samples", "2", "--seqlen", "16"])
    line = _one_error_line(code, capsys.readouterr())
    name = data.partition(":")[0]
    assert f"{name} is not in the local datasets cache and this machine is offline " \
           "(HF_HUB_OFFLINE is set)" in line
    assert "--data wiki-vital:" in line


def test_a_real_process_without_a_hub_says_one_line(fresh, tmp_path):
    """A subprocess whose hub endpoint refuses connections: no retries, one line."""
    fresh.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    res = cli("--quiet", "eval", "--model", MISSING_MODEL, "--samples", "2", cwd=tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "this machine is offline (127.0.0.1 cannot be reached" in lines[0]
    assert "Retrying" not in res.stderr
