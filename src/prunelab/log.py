"""Messages and progress for long work, on stderr; ``set_quiet(True)`` silences both (not
:func:`warn`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

T = TypeVar("T")
_state = {"quiet": False}
console = Console(stderr=True, highlight=False)


def set_quiet(quiet: bool) -> None:
    _state["quiet"] = bool(quiet)


def is_quiet() -> bool:
    return _state["quiet"]


def info(message: str) -> None:
    """Print one status line to stderr unless quiet."""
    if not _state["quiet"]:
        console.print(message, markup=False, soft_wrap=True)


def warn(message: str) -> None:
    """Print one ``prunelab: warning: ...`` line to stderr, also when quiet (a warning is
    not a status line: ``--quiet`` must not hide that a result may not be what was asked)."""
    console.print(f"prunelab: warning: {message}", markup=False, soft_wrap=True)


def progress(items: Iterable[T], total: int | None = None, desc: str = "",
             status: Callable[[], str] | None = None) -> Iterator[T]:
    """Iterate ``items`` showing a bar with the time elapsed and an estimate of the time left;
    ``status()`` (e.g. loss and tokens/s) is appended to the description after each item."""
    if _state["quiet"]:
        yield from items
        return
    if not sys.stderr.isatty():
        yield from _plain_progress(items, total, desc, status=status)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(desc, total=total)
        for item in items:
            yield item
            bar.advance(task)
            if status is not None:
                bar.update(task, description=f"{desc} {status()}")


def _plain_progress(items: Iterable[T], total: int | None, desc: str,
                    every: float = 15.0, status: Callable[[], str] | None = None
                    ) -> Iterator[T]:
    """Without a terminal: a status line at most every ``every`` seconds, with an ETA."""
    start = last = time.perf_counter()
    done = 0
    for item in items:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= every and total:
            eta = (now - start) / done * (total - done)
            extra = f" ({status()})" if status is not None else ""
            info(f"{desc}: {done}/{total} after {now - start:.0f} s, about {eta:.0f} s "
                 f"left{extra}")
            last = now


class Ticker:
    """Progress for work that is not one loop (a search calling an objective): call
    :meth:`tick` after each unit; a status line with an estimate of the time left at most
    every ``every`` seconds on stderr (nothing when quiet). ``total`` may be an upper
    bound: the estimate of the time left is then pessimistic."""

    def __init__(self, total: int, desc: str, every: float = 15.0) -> None:
        self.total, self.desc, self.every = max(int(total), 1), desc, every
        self.done = 0
        self.start = self.last = time.perf_counter()

    def tick(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if _state["quiet"] or now - self.last < self.every:
            return
        self.last = now
        left = max(self.total - self.done, 0)
        eta = (now - self.start) / self.done * left
        info(f"{self.desc}: {self.done} of at most {self.total} after {now - self.start:.0f} s, "
             f"at most about {eta:.0f} s left")
