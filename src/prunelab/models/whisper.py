"""Whisper's two stacks for prunelab: which one probes and pruning act on.

``WhisperForConditionalGeneration`` holds an encoder (audio) and a decoder (text) stack;
:data:`~prunelab.models.families.STACKS` describes both, and a loaded model's adapter
points at one of them (the encoder by default). The encoder adapter's ``base`` is
:class:`~prunelab.models.families.EncoderEntry`, so the block runner's
``base(input_ids=...)`` call runs the encoder on log-mel features (``[N, mel bins, 3000]``,
see :func:`prunelab.data.speech.feature_batches`).
"""

from __future__ import annotations

from torch import nn

from prunelab.errors import ConfigError
from prunelab.models.adapters import Adapter
from prunelab.models.families import STACKS


def stacks(model: nn.Module) -> list[str]:
    """Stack names of a multi-stack model (``[]`` for a single-stack one)."""
    return list(STACKS.get(getattr(model.config, "model_type", None), {}))


def use_stack(lm, stack: str | None):
    """Point ``lm.adapter`` at ``stack`` (``encoder`` / ``decoder`` for Whisper; ``None``
    keeps the default). A model with one stack accepts only ``None``."""
    if stack is None:
        return lm
    names = stacks(lm.model)
    if stack not in names:
        have = ", ".join(names) if names else "a single stack (no --stack)"
        raise ConfigError(f"--stack {stack!r} does not apply to {lm.spec}: it has {have}")
    lm.adapter = Adapter(lm.model, STACKS[lm.model.config.model_type][stack])
    lm.stack = stack
    return lm
