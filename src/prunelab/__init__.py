"""prunelab: measure where a transformer is redundant and remove that redundancy."""

__version__ = "0.1.0"
