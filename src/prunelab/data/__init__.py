"""Data: text sources from spec strings, and fixed-length token windows for eval/calibration.

See :mod:`prunelab.data.sources` for the accepted specs (and the embedded corpus split rule)
and :mod:`prunelab.data.batches` for the tokenization and windowing rule.
"""

from prunelab.data.batches import (
    DEFAULT_CALIB_SAMPLES,
    TokenBatches,
    make_batches,
    special_frame,
    tokenize_source,
)
from prunelab.data.sources import SPEC_HELP, TextSource, describe_sources, load_text_source
from prunelab.io.fingerprint import tensor_sha256

__all__ = [
    "DEFAULT_CALIB_SAMPLES",
    "SPEC_HELP",
    "TextSource",
    "TokenBatches",
    "describe_sources",
    "load_text_source",
    "make_batches",
    "special_frame",
    "tensor_sha256",
    "tokenize_source",
]
