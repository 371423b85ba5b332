"""Messages and progress for long work, on stderr; ``set_quiet(True)`` silences both (not
:func:`warn`)."""

from __future__ import annotations

import contextlib
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
#: the live rich progress display, when one is open: a progress started inside another
#: adds its own line to it (rich allows one live display at a time)
_live: list[Progress] = []
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


def _columns() -> tuple:
    return (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())


def progress(items: Iterable[T], total: int | None = None, desc: str = "",
             status: Callable[[], str] | None = None) -> Iterator[T]:
    """Iterate ``items`` showing a bar with the time elapsed and an estimate of the time left;
    ``status()`` (e.g. loss and tokens/s) is appended to the description after each item.
    Inside another bar (:class:`Steps` or an outer :func:`progress`) the bar is a line of
    the same display, removed when done."""
    if _state["quiet"]:
        yield from items
        return
    if not sys.stderr.isatty():
        yield from _plain_progress(items, total, desc, status=status)
        return
    if _live:
        bar = _live[-1]
        task = bar.add_task(desc, total=total)
        try:
            for item in items:
                yield item
                bar.advance(task)
                if status is not None:
                    bar.update(task, description=f"{desc} {status()}")
        finally:
            bar.remove_task(task)
        return
    with Progress(*_columns(), console=console, transient=True) as bar:
        _live.append(bar)
        try:
            task = bar.add_task(desc, total=total)
            for item in items:
                yield item
                bar.advance(task)
                if status is not None:
                    bar.update(task, description=f"{desc} {status()}")
        finally:
            _live.pop()


class Steps:
    """A bar over a few long steps of unequal cost (a grid of prune, heal, quantize and
    measure steps): each step has an estimated weight (seconds), so the bar and its time
    left follow the work, not the step count. Bars started inside a step nest under it.
    Without a terminal: one line per step with the time spent and an estimate of the time
    left; nothing when quiet.

        with Steps(sum(weights), "front") as bar:
            with bar.step("prune depth:6", weight=120):
                ...
    """

    def __init__(self, total: float, desc: str, count: int | None = None) -> None:
        self.total, self.desc, self.count = max(float(total), 1e-9), desc, count
        self.done_weight, self.index = 0.0, 0
        self.start = time.perf_counter()
        self._bar: Progress | None = None
        self._task = None

    def __enter__(self) -> Steps:
        if not _state["quiet"] and sys.stderr.isatty() and not _live:
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TimeElapsedColumn(), TextColumn("eta"),
                                 TimeRemainingColumn(), console=console, transient=True)
            self._bar.__enter__()
            _live.append(self._bar)
            self._task = self._bar.add_task(self.desc, total=self.total)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            _live.remove(self._bar)
            self._bar.__exit__(*exc)
            self._bar = None

    @contextlib.contextmanager
    def step(self, label: str, weight: float) -> Iterator[None]:
        """Run one step of estimated ``weight``; the bar moves by it when the step ends."""
        self.index += 1
        of = f"/{self.count}" if self.count else ""
        text = f"{self.desc} [{self.index}{of}] {label}"
        if self._bar is not None:
            self._bar.update(self._task, description=text)
        elif not _state["quiet"]:
            now = time.perf_counter() - self.start
            left = (now / self.done_weight * (self.total - self.done_weight)
                    if self.done_weight > 0 and now > 0 else None)
            eta = f", about {left / 60:.0f} min left" if left is not None else ""
            info(f"{text} ({now / 60:.1f} min elapsed{eta})")
        yield
        self.done_weight += weight
        if self._bar is not None:
            self._bar.advance(self._task, weight)


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
