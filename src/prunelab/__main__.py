"""``python -m prunelab`` and the ``prunelab`` console script: the command line
(:func:`prunelab.cli.run`), with Ctrl-C handled from the first instant: an interrupt while
the command line is still being imported exits 130 with one line, no traceback."""

import sys

from prunelab import interrupts  # stdlib only: loaded with this module, before main()


def main() -> None:
    """Import the command line and run it; Ctrl-C during the imports is exit 130 (also
    when a library swallowed it and its import then failed: see :mod:`prunelab.interrupts`)."""
    try:
        interrupts.watch()
        from prunelab.cli import run
    except KeyboardInterrupt:
        interrupted_early()
    except Exception:
        if not interrupts.seen():
            raise
        interrupted_early()
    run()


def interrupted_early() -> None:
    """Exit 130 with one line (nothing was written: no command ran yet). A second Ctrl-C
    meanwhile is ignored, so that it cannot turn the exit into a traceback."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stderr.write("interrupted: nothing was written\n")
        sys.stderr.flush()
    finally:
        import os

        os._exit(130)


if __name__ == "__main__":
    main()
