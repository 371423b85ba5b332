"""One writer per output, and the file-system moves that keep outputs whole.

**Lock.**
``output_lock(path)`` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``.NAME.lock`` in the
target's parent directory, so a second prunelab process writing the same output is refused
at once (in one line) instead of silently replacing the first one's result. The lock is
released when the holder exits, even when it is killed, because the kernel drops a flock
with its open file description.

The holder removes the lock file before releasing it; an acquirer therefore checks, once
it holds the lock, that the file it locked is still the one at the path (same inode), and
retries otherwise -- the usual protocol that keeps "unlink on release" free of races.

Within one process the lock is re-entrant: the CLI holds it for a whole command while
:func:`prunelab.checkpoint.save.save` and :func:`~prunelab.io.files.write_json` take it again
for their own write (temp output, checks, final move). A killed holder may leave the
lock file behind; that is harmless (the kernel released its lock).

**Temp names and leftovers.** A writer of ``NAME`` works in ``.NAME.tmp-<pid>-<random>``
(and backs an old output up as ``.NAME.old-<pid>``); :func:`clean_leftovers` removes
those names whose process is gone, and nothing else.

**Durability and races.** :func:`fsync_tree` / :func:`fsync_dir` flush a finished temp
output and its directory entries; :func:`move_noreplace` renames without ever replacing
(``renameat2(RENAME_NOREPLACE)`` on Linux); :func:`publish_once` installs a cache entry
without deleting a complete one another process may be reading.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from prunelab.errors import OutputExistsError, OutputWriteError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no locking (documented)
    fcntl = None

_held: dict[str, list[int]] = {}  # lock path -> [fd, depth] held by this process
_guard = threading.Lock()


def lock_path(path: str | Path) -> Path:
    """The lock file of ``path``: ``.NAME.lock`` beside it."""
    p = Path(os.path.abspath(path))
    return p.with_name(f".{p.name}.lock")


def _acquire(lock: Path, target: Path) -> int:
    """Open and lock ``lock``; raise OutputExistsError when another process holds it."""
    for _ in range(100):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputWriteError(f"cannot create the lock file {lock}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputExistsError(f"another prunelab process is writing {target}") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed the file as we opened it: lock the new one
    raise OutputExistsError(f"another prunelab process is writing {target}")


@contextmanager
def output_lock(path: str | Path) -> Iterator[Path]:
    """Hold the exclusive writer lock of output ``path`` for the ``with`` block.

    Raises :class:`~prunelab.errors.OutputExistsError` ("another prunelab process is
    writing PATH") when another process holds it. Creates the parent directory if needed.
    Re-entrant within a process. Yields the lock file's path.
    """
    target = Path(os.path.abspath(path))
    lock = lock_path(target)
    if fcntl is None:  # pragma: no cover
        yield lock
        return
    key = str(lock)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            nested = True
        else:
            nested = False
    made: list[Path] = []  # the folders this lock created, deepest first
    if not nested:
        made = [d for d in (lock.parent, *lock.parent.parents) if not d.exists()]
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputWriteError(f"cannot create {lock.parent}: {exc}") from exc
        try:
            fd = _acquire(lock, target)
        except BaseException:
            _remove_empty(made)
            raise
        with _guard:
            _held[key] = [fd, 1]
    try:
        yield lock
    finally:
        with _guard:
            entry = _held[key]
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del _held[key]
        if last:
            try:
                os.unlink(lock)  # still holding the lock: see the module docstring
            except OSError:
                pass
            os.close(entry[0])
            if not os.path.lexists(target):  # nothing written: no empty folders left behind
                _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders this run created for an output it never wrote, deepest first,
    while they are empty (a folder anything else wrote into stays)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


# ---------------------------------------------------------------- temp names, leftovers

def temp_prefix(target: Path) -> str:
    return f".{target.name}.tmp-{os.getpid()}-"


def _leftover_re(name: str) -> re.Pattern:
    """``.NAME.tmp-<pid>-<random>`` or ``.NAME.old-<pid>[-...]``: only prunelab's names."""
    n = re.escape(name)
    return re.compile(rf"\.{n}\.(?:(tmp)-(\d+)-.+|(old)-(\d+)(?:-.*)?)", re.DOTALL)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # never a name prunelab writes: leave it alone
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, owned by someone else
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(FileNotFoundError):
            path.unlink()


def clean_leftovers(target: str | Path) -> list[Path]:
    """Remove ``.NAME.tmp-<pid>-*`` and ``.NAME.old-<pid>*`` beside ``target`` whose
    writer (``pid``) is no longer alive; return what was removed. Nothing else is touched.

    A dead writer's ``.NAME.old-<pid>`` when ``NAME`` itself is missing is the complete
    previous output (the writer died between its two renames): it is moved back to
    ``NAME`` instead of being deleted.
    """
    target = Path(target)
    if not target.parent.is_dir():
        return []
    pattern = _leftover_re(target.name)
    removed = []
    for entry in sorted(target.parent.iterdir()):
        m = pattern.fullmatch(entry.name)
        if m is None or _pid_alive(int(m.group(2) or m.group(4))):
            continue
        if m.group(3) == "old" and not os.path.lexists(target):
            with suppress(OSError):
                os.rename(entry, target)
                continue
        _remove(entry)
        removed.append(entry)
    return removed


# ---------------------------------------------------------------- durability, moves

def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: the names just created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; nothing more to do
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` (or ``root`` itself), then every directory."""
    if not root.is_dir():
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    for dirpath, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = Path(dirpath) / name
            if not p.is_symlink():
                fsync_tree(p)
        fsync_dir(Path(dirpath))


_AT_FDCWD, _RENAME_NOREPLACE = -100, 1


@functools.cache
def _renameat2_fn():
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None


def _renameat2(src: Path, dst: Path) -> bool:
    """Linux ``renameat2(RENAME_NOREPLACE)``; False when the system lacks it."""
    fn = _renameat2_fn()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, getattr(errno, "ENOTSUP", -1)):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def move_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` atomically, raising FileExistsError if ``dst`` exists
    (also when it appears between any check and the move)."""
    try:
        if _renameat2(src, dst):
            return
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, "exists", str(dst)) from exc
        raise
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "exists", str(dst))
    if src.is_dir():
        try:  # a non-empty directory or a file at dst makes rename fail
            os.rename(src, dst)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise FileExistsError(errno.EEXIST, "exists", str(dst)) from exc
            raise
        return
    try:
        os.link(src, dst)  # fails if dst exists
        os.unlink(src)
    except FileExistsError:
        raise
    except OSError:  # no hard links on this file system
        os.rename(src, dst)


def publish_once(tmp: Path, target: Path, complete: Callable[[Path], bool]) -> Path:
    """Move a finished cache entry ``tmp`` to ``target`` without ever deleting a complete
    ``target`` another process may be reading: if one appeared meanwhile, ``tmp`` is
    discarded. An incomplete ``target`` is moved aside first, then removed."""
    fsync_tree(tmp)
    for _ in range(3):
        try:
            move_noreplace(tmp, target)
        except FileExistsError:
            if complete(target):
                _remove(tmp)
                return target
            aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(target)))
            with suppress(FileNotFoundError):
                os.rename(target, aside / "stale")
            _remove(aside)
            continue
        fsync_dir(target.parent)
        return target
    raise OutputWriteError(f"cannot publish {target}: it keeps reappearing incomplete")
