"""An importance matrix for llama.cpp's quantizer from prunelab's own calibration.

One pass of the block-by-block runner over the calibration windows: the input of every
prunable linear of every block is fed to a :class:`~prunelab.calib.stats.SumSquares`
(q / k / v and gate / up receive the same tensor and share one), and the sums are keyed by
the weight's llama.cpp name (``blk.N.attn_q.weight``; ``blk.N`` is the block's index in
the model as it is now, so a depth-pruned model's renumbered blocks match its GGUF file).
This is what ``llama-imatrix`` gathers inside llama.cpp (sum of squared inputs and token
count per weight, blocks only; see :mod:`prunelab.checkpoint.imatrix`), computed on the
model's own float forward instead of the quantized file's.
"""

from __future__ import annotations

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import SumSquares
from prunelab.checkpoint.imatrix import IMatrix
from prunelab.errors import UnsupportedOperationError
from prunelab.models.families import original_model_type
from prunelab.models.gguf_llama import BLOCK_NAMES, GEMMA3_BLOCK_NAMES


def gguf_weight_name(model_type: str, index: int, path: str) -> str:
    """llama.cpp's name of the linear at ``path`` inside block ``index``."""
    names = GEMMA3_BLOCK_NAMES if model_type.startswith("gemma3") else BLOCK_NAMES
    inner = names.get(path)
    if inner is None:
        raise UnsupportedOperationError(f"imatrix: block linear {path} has no llama.cpp name")
    return f"blk.{index}.{inner}.weight"


@torch.no_grad()
def collect_imatrix(lm, input_ids: torch.Tensor, batch_size: int = 4,
                    dataset: str = "") -> IMatrix:
    """Sum of squared inputs and token count of every block linear of ``lm`` over the
    windows ``input_ids`` (``[N, T]``), in one pass; ``dataset`` names the data in the
    file."""
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    ad = runner.adapter
    model_type = original_model_type(lm.model.config.model_type)
    im = IMatrix(datasets=[dataset] if dataset else [], chunk_size=int(input_ids.shape[1]),
                 chunk_count=int(input_ids.shape[0]))

    def on_block(i: int, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        outs: list[torch.Tensor] = []
        accs = runner.collect(i, hidden, ad.linears(i), lambda name: SumSquares(),
                              stop_early=False, outputs=outs, share=True)
        for path, (acc,) in accs.items():
            name = gguf_weight_name(model_type, i, path)
            im.sums[name] = acc.sum_sq.double().cpu().numpy()
            im.counts[name] = int(acc.tokens)
        return outs

    runner.run(on_block, desc="imatrix")
    return im
