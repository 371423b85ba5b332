"""``python -m prunelab``: the command line (:func:`prunelab.cli.run`)."""

from prunelab.cli import run

run()
