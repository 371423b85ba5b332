"""Run the points of a study as Ray tasks (``--ray auto`` or ``--ray ADDRESS``).

Ray (https://docs.ray.io) does the scheduling, the resources and the retries; this module
only turns each :class:`~prunelab.workflow.executor.Point` into one ``ray.remote`` task
with ``num_cpus`` / ``num_gpus`` and yields the results as the tasks finish.

* ``address="auto"`` starts a private local Ray instance (``ray.init(address="local")``,
  all CPUs of the machine, no dashboard, worker logs not forwarded) and shuts it down at
  the end; it never joins a cluster someone else started on the machine. Any other
  address (``HOST:PORT`` of a ``ray start --head``, or ``ray://HOST:PORT``) joins that
  cluster, after a 5-second TCP check so an unreachable address fails in one line. A Ray
  instance this process already initialised is reused as it is.
* A point's task runs ``run_point(point, folder)`` with ``folder = OUT/points/<key>/`` --
  the same layout as a serial run. **Assumption: the workers see the driver's ``OUT``
  path (one machine, or a shared filesystem such as NFS) for anything large (a
  checkpoint).** For workers without it, the task also returns the files it wrote under
  ``SMALL_FILE_BYTES`` each (JSON, CSV, PNG) and the driver writes those that are missing
  on its side; a checkpoint written on a remote disk stays there.
* A point whose worker process dies (a lost node, a killed worker) is re-run by Ray up to
  ``retries`` times (``max_retries``); an exception raised by ``run_point`` is retried only
  when it is a system error (:data:`SYSTEM_ERRORS`), never a user error
  (:class:`~prunelab.errors.PrunelabError`), which is re-raised here as itself.
* The workers run the driver's code: the driver's ``sys.path`` entries that exist on the
  worker are added before ``run_point`` is unpickled (so a test module's function or a
  source checkout on ``PYTHONPATH`` works as on the driver).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from prunelab.errors import ConfigError, PrunelabError
from prunelab.registry import check_range
from prunelab.workflow.points import Point, point_dir

SYSTEM_ERRORS = (ConnectionError, TimeoutError, MemoryError)
SMALL_FILE_BYTES = 4 * 1024 * 1024
LOCAL_OBJECT_STORE_BYTES = 512 * 1024 * 1024  # results are small; checkpoints go to disk


class RayError(PrunelabError):
    """Ray is missing, its cluster cannot be reached, or a point's task was lost for good."""


def import_ray():
    """The ``ray`` module, or a one-line :class:`RayError` naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise RayError("--ray needs Ray: pip install 'ray>=2.9' (or prunelab[ray])") from exc
    return ray


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse in one line an address whose host:port does not accept a TCP connection."""
    text = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"--ray takes 'auto' or HOST:PORT of a Ray cluster, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise RayError(f"cannot reach the Ray cluster at {address} "
                       f"({exc.strerror or type(exc).__name__}); start it with "
                       "'ray start --head' or use --ray auto") from exc


def connect(address: str = "auto", num_cpus: int | None = None,
            object_store_memory: int = LOCAL_OBJECT_STORE_BYTES) -> bool:
    """Initialise Ray for ``address`` (see the module docstring); returns True when this
    call started the connection (the caller then shuts it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    common = {"include_dashboard": False, "log_to_driver": False,
              "configure_logging": False}
    if address == "auto":
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1,
                 object_store_memory=object_store_memory, **common)
    else:
        _check_reachable(address)
        try:
            ray.init(address=address, **common)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            msg = " ".join(str(exc).split())[:200]
            raise RayError(f"cannot join the Ray cluster at {address}: {msg}") from exc
    return True


def _run_task(fn_bytes: bytes, paths: list[str], key: str, payload: dict, out: str,
              *after: dict) -> dict:
    """The body of one Ray task: run the point, return its result and its small files.
    ``after``: the replies of the points it depends on (Ray starts the task once they
    are all done; their values are not used)."""
    for p in paths:
        if p not in sys.path and os.path.isdir(p):
            sys.path.append(p)
    import ray.cloudpickle as cloudpickle

    run_point = cloudpickle.loads(fn_bytes)
    folder = point_dir(Path(out), key)
    folder.mkdir(parents=True, exist_ok=True)
    result = run_point(Point(key, payload), folder)
    files = {}
    for f in sorted(folder.rglob("*")):
        if f.is_file() and f.stat().st_size <= SMALL_FILE_BYTES and not f.name.startswith("."):
            files[str(f.relative_to(folder))] = f.read_bytes()
    return {"result": result, "files": files}


def _write_missing(folder: Path, files: dict[str, bytes]) -> None:
    """Write the returned files the driver does not see (a worker without shared disk)."""
    for rel, data in files.items():
        target = folder / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp")
            tmp.write_bytes(data)
            tmp.replace(target)


def _unwrap(ray, exc: Exception, key: str) -> Exception:
    """A user error of the task as itself; anything else as a one-line :class:`RayError`."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, PrunelabError):
        return cause
    if isinstance(exc, ray.exceptions.RayTaskError):
        what = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)
        return RayError(f"point {key} failed on Ray: {' '.join(what.split())[:300]}")
    return RayError(f"point {key} was lost on Ray after its retries "
                    f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")


def check_resources(cpus_per_point: float, gpus_per_point: float) -> None:
    """Refuse resource requests Ray cannot honour (nan, inf, negative) before it starts."""
    check_range("cpus_per_point (--cpus-per-point)", cpus_per_point, 0.0, 1e6)
    check_range("gpus_per_point (--gpus-per-point)", gpus_per_point, 0.0, 1e6)


def check_cluster(ray, address: str, cpus_per_point: float, gpus_per_point: float) -> None:
    """Refuse in one line a point that asks for more CPUs or GPUs than any node of the
    cluster has (Ray would wait for them forever)."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    where = "this machine" if address == "auto" else f"the Ray cluster at {address}"
    for what, flag, ask in (("GPU", "--gpus-per-point", gpus_per_point),
                            ("CPU", "--cpus-per-point", cpus_per_point)):
        most = max((float(n.get(what, 0.0)) for n in nodes), default=0.0)
        if ask > most:
            raise RayError(f"{flag} {ask:g}: no node of {where} has {ask:g} {what}s (the "
                           f"largest has {most:g}); a point would wait for them forever")


def run_on_ray(points: list[Point], run_point: Callable[[Point, Path], dict], out: Path, *,
               address: str = "auto", cpus_per_point: float = 1.0,
               gpus_per_point: float = 0.0, retries: int = 2,
               deps: dict[str, list[str]] | None = None) -> Iterator[tuple[Point, dict]]:
    """Yield ``(point, result)`` for every point as its Ray task finishes (any order).

    ``run_point`` must be a module-level function (it is pickled by cloudpickle); each
    task asks Ray for ``cpus_per_point`` CPUs and ``gpus_per_point`` GPUs and is retried
    ``retries`` times when its worker is lost (see the module docstring). ``deps``: key
    -> keys of EARLIER points in ``points`` that must finish first (keys not among the
    points are taken as done); Ray holds such a task until their results exist (they are
    passed to it as object references), so independent points run in parallel."""
    check_resources(cpus_per_point, gpus_per_point)
    if retries < 0:
        raise ConfigError(f"retries must be >= 0, got {retries}")
    ray = import_ray()
    import ray.cloudpickle as cloudpickle

    started = connect(address)
    refs: dict = {}
    try:
        check_cluster(ray, address, cpus_per_point, gpus_per_point)
        task = ray.remote(_run_task).options(
            num_cpus=cpus_per_point, num_gpus=gpus_per_point, max_retries=retries,
            retry_exceptions=list(SYSTEM_ERRORS))
        fn = ray.put(cloudpickle.dumps(run_point))
        paths = [p for p in sys.path if p]
        out = Path(out).resolve()
        by_key: dict = {}
        for p in points:
            after = [by_key[k] for k in (deps or {}).get(p.key, ()) if k in by_key]
            by_key[p.key] = task.remote(fn, paths, p.key, p.payload, str(out), *after)
            refs[by_key[p.key]] = p
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            for ref in done:
                point = refs.pop(ref)
                try:
                    reply = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 (mapped to a one-line error)
                    raise _unwrap(ray, exc, point.key) from exc
                _write_missing(point_dir(out, point.key), reply["files"])
                yield point, reply["result"]
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()
