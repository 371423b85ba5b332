"""A plugin's presses, written as docs/inference.md ("Writing a press") says: loaded by
``tests/inference/test_press_hook.py`` with ``prunelab.plugins.import_plugin`` (as
``--plugin`` does) and run through the same checks as the built-in presses."""

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from prunelab.inference import CACHE_BUDGET, PRESSES, Press


@PRESSES.register("keep-oldest")
@dataclass(frozen=True)
class KeepOldest(Press):
    """Keep the oldest tokens of the prompt (score: minus the position)"""

    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)

    def score(self, inputs):
        b, g, length = inputs.key.shape[:3]
        return -torch.arange(length, dtype=torch.float32).expand(b, g, length)


@PRESSES.register("prefill-oldest")
@dataclass(frozen=True)
class PrefillOldest(Press):
    """Mid-prefill: keep the oldest tokens and the last one at block ``layer``"""

    kind: ClassVar[str] = "prefill"
    ratio: float = field(default=0.5, metadata=CACHE_BUDGET)
    layer: int = field(default=1, metadata={"help": "block where the prompt is pruned"})

    def select(self, probs, groups):
        b, length = probs.shape[0], probs.shape[-1]
        remove = min(int(length * self.ratio), length - 1)
        keep = torch.cat([torch.arange(length - remove - 1), torch.tensor([length - 1])])
        return keep.expand(b, -1), {"removed": remove}
