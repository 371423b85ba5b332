"""Points of a study as Ray tasks: same results as the serial run, resumable, retried.

One local Ray instance with 2 CPUs for the module (its start costs seconds)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prunelab.errors import ConfigError
from prunelab.workflow.executor import Point, run_points

from tiny_models import tiny_tokens

ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parents[1]  # tests/ (tiny_models)
SRC = str(HERE.parent / "src")


# ---------------------------------------------------------------- module-level points
def prune_and_score(point: Point, folder: Path) -> dict:
    """Prune a tiny llama (Wanda sparsity or depth) and score it against the dense one."""
    import torch as t

    from prunelab.eval.perplexity import score_windows
    from prunelab.models.loading import wrap
    from prunelab.pruning import Depth, Wanda, pruner_for

    from tiny_models import char_tokenizer, tiny_model, tiny_tokens

    t.set_num_threads(1)
    tok = char_tokenizer()
    dense = wrap(tiny_model("llama", seed=0), tok)
    work = wrap(tiny_model("llama", seed=0), tok)
    calib, test = tiny_tokens(4, 16, seed=1), tiny_tokens(4, 16, seed=2)
    p = point.payload
    cfg = Wanda(sparsity=p["sparsity"]) if p["method"] == "wanda" else Depth(remove=p["remove"])
    pruner_for(cfg).run(work, cfg, calib, batch_size=2)
    scores = score_windows(work, test, batch_size=2, reference=dense)
    (folder / "note.txt").write_text(f"{point.key} pid {os.getpid()}\n")
    return {"perplexity": scores["perplexity"], "kl": scores["kl_to_reference"],
            "top1": scores["top1_agreement"],
            "params": sum(int((q != 0).sum()) for q in work.model.parameters())}


def crash_once(point: Point, folder: Path) -> dict:
    """The first attempt kills its worker process (a lost worker); the retry succeeds."""
    marker = folder / "attempted"
    if not marker.exists():
        marker.write_text("1")
        os._exit(1)
    return {"key": point.key, "attempts": 2}


def flaky_connection(point: Point, folder: Path) -> dict:
    marker = folder / "attempted"
    if not marker.exists():
        marker.write_text("1")
        raise ConnectionError("storage hiccup")
    return {"ok": True}


def user_error(point: Point, folder: Path) -> dict:
    marker = folder / "attempts"
    marker.write_text(str(int(marker.read_text()) + 1 if marker.exists() else 1))
    raise ConfigError("sparsity 1.5 is out of range")


POINTS = [Point("wanda-0.5", {"method": "wanda", "sparsity": 0.5}),
          Point("wanda-0.25", {"method": "wanda", "sparsity": 0.25}),
          Point("depth-1", {"method": "depth", "remove": 1})]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module. Its workers run at the test's priority: Ray renices
    them to 15 by default, and on 2 cores shared with the other test worker a niced worker
    barely runs (a 3-point run took 142 s of wall time for 15 s of CPU time; 11 s at nice 0)."""
    from prunelab.workflow.ray_backend import connect

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_worker_niceness", "0")  # read by the raylet this starts
        started = connect("auto", num_cpus=2, object_store_memory=100 * 1024 * 1024)
        yield
        if started:
            ray.shutdown()


# ---------------------------------------------------------------- tests
def test_ray_matches_serial_and_rerun_skips(tmp_path, local_ray):
    serial = run_points(POINTS, prune_and_score, tmp_path / "serial")
    on_ray = run_points(POINTS, prune_and_score, tmp_path / "ray", ray="auto")
    assert on_ray == serial  # exact: same floats, same order
    assert serial[0]["params"] < serial[1]["params"]  # 50 % keeps fewer than 25 %
    for p in POINTS:  # the serial layout, written by the workers
        folder = tmp_path / "ray" / "points" / p.key
        assert json.loads((folder / "result.json").read_text()) == on_ray[POINTS.index(p)]
        assert (folder / "note.txt").read_text().startswith(p.key)
    notes = {(tmp_path / "ray" / "points" / p.key / "note.txt").read_text() for p in POINTS}
    assert all(str(os.getpid()) not in n for n in notes)  # ran in Ray workers
    # a rerun reads every point back: a function that would fail is never called
    assert run_points(POINTS, user_error, tmp_path / "ray", ray="auto") == serial
    # a changed payload reruns only that point
    changed = [POINTS[0], Point("wanda-0.25", {"method": "wanda", "sparsity": 0.3}), POINTS[2]]
    again = run_points(changed, prune_and_score, tmp_path / "ray", ray="auto")
    assert again[0] == serial[0] and again[2] == serial[2]
    assert serial[0]["params"] < again[1]["params"] < serial[1]["params"]


def test_sweep_depth_on_ray_equals_serial(tmp_path, local_ray):
    from prunelab import api
    from prunelab.workflow.sweep import sweep_depth

    from tiny_models import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint("llama", tmp_path / "ckpt")
    lm = api.load(str(ckpt), dtype="float32")
    calib, test = tiny_tokens(4, 12, seed=3), tiny_tokens(2, 12, seed=4)
    grid = (["block-influence"], [1], ["none", "foldable"])
    serial = sweep_depth(lm, *grid, calib, test, tmp_path / "serial", batch_size=2)
    on_ray = sweep_depth(lm, *grid, calib, test, tmp_path / "ray", batch_size=2, ray="auto",
                         load={"spec": str(ckpt), "dtype": "float32"})
    assert on_ray == serial and len(serial) == 2
    assert any(p["error"] is None and p["recovery"] == "foldable" for p in serial)
    for name in ("points.json", "curve.md", "curve.csv"):
        assert (tmp_path / "ray" / name).read_text() == (tmp_path / "serial" / name).read_text()
    stored = sorted(p.name for p in (tmp_path / "ray" / "points").iterdir())
    assert stored == sorted(f"{p['probe']}.{p['recovery']}.n{p['removed_count']}"
                            for p in serial)
    # a rerun finds every point in points.json: nothing is sent to Ray
    again = sweep_depth(lm, *grid, calib, test, tmp_path / "ray", batch_size=2, ray="auto",
                        load={"spec": "no-such-model"})
    assert again == serial


def test_lost_worker_is_retried(tmp_path, local_ray):
    res = run_points([Point("a")], crash_once, tmp_path, ray="auto", retries=1)
    assert res == [{"key": "a", "attempts": 2}]


def test_system_error_retried_user_error_not(tmp_path, local_ray):
    assert run_points([Point("c")], flaky_connection, tmp_path, ray="auto") == [{"ok": True}]
    with pytest.raises(ConfigError, match="sparsity 1.5"):
        run_points([Point("u")], user_error, tmp_path, ray="auto", retries=3)
    assert (tmp_path / "points" / "u" / "attempts").read_text() == "1"
    assert not (tmp_path / "points" / "u" / "result.json").exists()


def test_crash_without_retries_is_one_line(tmp_path, local_ray):
    from prunelab.workflow.ray_backend import RayError

    with pytest.raises(RayError, match="point z was lost on Ray") as info:
        run_points([Point("z")], crash_once, tmp_path, ray="auto", retries=0)
    assert "\n" not in str(info.value)


def test_unreachable_address_is_one_line(tmp_path):
    from prunelab.workflow import ray_backend

    port = _free_port()  # nothing listens there
    with pytest.raises(ray_backend.RayError, match="cannot reach the Ray cluster") as info:
        ray_backend._check_reachable(f"127.0.0.1:{port}", timeout=1)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ray_backend._check_reachable("nonsense")


def test_missing_ray_is_one_line(monkeypatch):
    from prunelab.workflow import ray_backend

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ray_backend.RayError, match="pip install"):
        ray_backend.import_ray()


def test_sweep_workers_reload_with_the_cli_load_options():
    import inspect

    from prunelab import api
    from prunelab.cli.common import LoadArgs
    from prunelab.cli.prune_cmds import ray_load_args

    args = ray_load_args(LoadArgs("smollm2-135m", dtype="bfloat16", offload=True))
    assert args == {"spec": "smollm2-135m", "dtype": "bfloat16", "device": "cpu",
                    "trust_remote_code": False, "allow_pickle": False,
                    "allow_missing_weights": False, "offload": True, "stream": False,
                    "stack": None, "calib_dtype": None}
    assert set(args) <= set(inspect.signature(api.load).parameters)


def test_sweep_cli_ray_flags_need_ray(tmp_path, capsys):
    from prunelab.cli import cli_main

    code = cli_main(["sweep", "depth", "--model", "x", "--out", str(tmp_path / "o"),
                     "--gpus-per-point", "1"])
    assert code == 2
    assert "--cpus-per-point and --gpus-per-point need --ray" in capsys.readouterr().err


# ---------------------------------------------------------------- slow: join by address
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_join_cluster_by_address(tmp_path, monkeypatch):
    """``ray start --head`` on 127.0.0.1 (in its own process group, stopped by its id, not
    by ``ray stop``, which would stop every Ray on the machine), joined by address. Token
    authentication is off for this private cluster (``~/.ray/auth_token`` is shared by
    every Ray on the machine)."""
    import signal

    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(HERE)])}
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
         f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         "--include-dashboard=false", f"--object-store-memory={100 * 1024 * 1024}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:  # wait for the GCS port
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.time() < deadline, "ray start failed"
                time.sleep(1)
        serial = run_points(POINTS[:2], prune_and_score, tmp_path / "serial")
        res = run_points(POINTS[:2], prune_and_score, tmp_path / "ray",
                         ray=f"127.0.0.1:{port}")
        assert res == serial
        assert not ray.is_initialized()  # joined for the run, left after it
    finally:
        if ray.is_initialized():
            ray.shutdown()
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


def test_more_gpus_or_cpus_than_any_node_is_one_line(tmp_path, local_ray):
    """A point asking for GPUs (or CPUs) no node has is refused before any task is queued:
    Ray would otherwise wait for them forever."""
    from prunelab.workflow.ray_backend import RayError

    gpus = ray.cluster_resources().get("GPU", 0) + 1
    with pytest.raises(RayError, match=r"--gpus-per-point .*no node of this machine") as info:
        run_points([Point("g")], crash_once, tmp_path, ray="auto", gpus_per_point=gpus)
    assert "\n" not in str(info.value)
    with pytest.raises(RayError, match=r"--cpus-per-point 3: .*largest has 2"):
        run_points([Point("c")], crash_once, tmp_path, ray="auto", cpus_per_point=3)
    assert not (tmp_path / "points" / "g").exists() and not (tmp_path / "points" / "c").exists()
