"""Ctrl-C that is never lost on the way to exit 130.

Python's default SIGINT handler raises ``KeyboardInterrupt`` wherever the main thread
happens to be. Inside library code that is not always survivable: C functions that clear
any pending error swallow it (``PyObject_HasAttr`` before Python 3.13 does), an import it
stops half way leaves a package half in ``sys.modules`` so that the next import of it
fails with a "partially initialized module" ``ImportError`` (seen with accelerate, imported
lazily by transformers), and raised inside a C++ callback it aborts the process.

The command line therefore installs :func:`watch`'s handler, which remembers the interrupt
before raising it. Three things use the memory:

- :func:`deferred` blocks (the heavy library imports at start) only note the interrupt and
  raise it when the block has finished, so no half-import remains;
- :func:`check` raises a noted interrupt again at safe points (before a command runs,
  after a model is loaded) in case library code swallowed the first one;
- the command line reports any failure after an interrupt as the interrupt (exit 130, one
  line), not as a traceback of its consequence.

Library users (``import prunelab``) keep their own handler: nothing here is installed
unless the command line calls :func:`watch`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

_seen = False
_defer = 0


def _handler(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    global _seen
    _seen = True
    if not _defer:
        raise KeyboardInterrupt


def watch() -> bool:
    """Install the remembering handler when SIGINT has Python's default handler (not when
    it is ignored, as in a background job, nor over a handler someone else installed);
    main thread only. Returns whether it was installed."""
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        signal.signal(signal.SIGINT, _handler)
    except ValueError:  # not the main thread
        return False
    return True


def seen() -> bool:
    """Whether a SIGINT arrived since :func:`watch` (or :func:`reset`)."""
    return _seen


def check() -> None:
    """Raise ``KeyboardInterrupt`` if an interrupt arrived (again, if it was swallowed)."""
    if _seen and not _defer:
        raise KeyboardInterrupt


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block to its end even if SIGINT arrives; then raise the interrupt, if any.
    An exception of the block itself propagates unchanged."""
    global _defer
    _defer += 1
    try:
        yield
    finally:
        _defer -= 1
    check()


def reset() -> None:
    """Forget a noted interrupt (for a process that goes on, e.g. tests)."""
    global _seen
    _seen = False
