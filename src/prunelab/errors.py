"""User-facing errors.

Every error a user can cause raises a :class:`PrunelabError` subclass whose message is
one line; the CLI prints it without a traceback and exits with code 2.
"""

from __future__ import annotations


class PrunelabError(Exception):
    """Base class of every error a user can cause (bad input, missing files, ...)."""

    exit_code = 2


class ModelNotFoundError(PrunelabError):
    """A model spec names nothing that can be loaded."""


class UnsupportedArchitectureError(PrunelabError):
    """The model's architecture has no adapter."""


class DataError(PrunelabError):
    """A data spec cannot be resolved or gives too little text."""


class ConfigError(PrunelabError):
    """A numeric or categorical option is out of range."""


class OutputExistsError(PrunelabError):
    """An output path exists and overwrite was not requested."""


class UnsupportedOperationError(PrunelabError):
    """An operation cannot be applied to this model (e.g. a shape a vanilla config cannot hold)."""


class PressedCacheError(UnsupportedOperationError):
    """A KV cache compressed by an inference-time press was continued outside a press (the
    model would place the new tokens at the shrunken cache length, not after the tokens
    seen)."""


class ResumeMismatchError(PrunelabError):
    """A resumable output in the target was made from another model, dtype, data or options."""


class CorruptCheckpointError(PrunelabError):
    """A checkpoint, tokenizer or GGUF file exists but cannot be read (truncated, garbage,
    shapes that contradict its config, a pickle that torch's restricted loader refuses)."""


class MissingWeightsError(CorruptCheckpointError):
    """A checkpoint lacks weights its config declares, holds weights the model does not
    have, or holds weights of the wrong shape (they would be left at random values)."""


class PickleRefusedError(PrunelabError):
    """A checkpoint stores its weights only as a pickle and pickles were not allowed."""


class OutputWriteError(PrunelabError):
    """An output path cannot be written (parent is a file, no permission, bad name...)."""
