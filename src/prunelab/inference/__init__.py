"""Inference-time presses: KV-cache eviction and mid-prefill token pruning applied to a
loaded model as a context manager (``with press(lm, SnapKV(ratio=0.5)): ...``). A press is
a registered :class:`Press` config whose hooks say what it keeps (a KV press: ``score``
over the cached tokens, :class:`ScoreInputs`; :mod:`prunelab.inference.base`)."""

from prunelab.registry import import_submodules

# registration order = the order of CLI lists and error messages
import_submodules(__name__, first=("config", "decay", "expected", "budgets"))

from prunelab.inference.base import CACHE_BUDGET, check_press
from prunelab.inference.budgets import AdaKV, PyramidKV
from prunelab.inference.config import (
    H2O,
    PRESSES,
    TOVA,
    EntroPrefill,
    KNorm,
    LazyLLM,
    Press,
    SnapKV,
    StreamingLLM,
    press_for,
)
from prunelab.inference.decay import DecayEviction, fit_decay
from prunelab.inference.expected import ExpectedAttention
from prunelab.inference.kv import cache_bytes
from prunelab.inference.press import Session, press
from prunelab.inference.scores import ScoreInputs

__all__ = ["PRESSES", "Press", "CACHE_BUDGET", "ScoreInputs", "check_press",
           "StreamingLLM", "H2O", "SnapKV", "TOVA", "KNorm", "LazyLLM", "EntroPrefill",
           "ExpectedAttention", "AdaKV", "PyramidKV", "DecayEviction", "fit_decay", "press",
           "press_for", "Session", "cache_bytes"]
