"""``rep-lie``: REP-LIE importance (first-order Taylor term of the merged LoRA weight,
estimated from the LoRA matrices' values and gradients only; derivation in
:mod:`prunelab.pruning.width.rep_lie`), averaged over a short LoRA fine-tune on the calibration
windows. The LoRA is dropped afterwards: the scores read the training signal, the weights
pruned are the model's own."""

from __future__ import annotations

from dataclasses import dataclass, field

from prunelab.pruning.width.rep_lie import rep_lie_importances
from prunelab.pruning.width.scoring.base import WIDTH_SCORES, WidthScore
from prunelab.registry import check_range


@WIDTH_SCORES.register("rep-lie")
@dataclass(frozen=True)
class RepLie(WidthScore):
    """Taylor importance from LoRA gradients over a short fine-tune"""

    steps: int = field(default=20, metadata={"cli": "rep_lie_steps",
                                             "help": "rep-lie: LoRA fine-tune steps"})
    lr: float = field(default=2e-4, metadata={"cli": "rep_lie_lr",
                                              "help": "rep-lie: LoRA learning rate"})
    rank: int = field(default=8, metadata={"cli": "lora_rank", "help": "rep-lie: LoRA rank"})
    seed: int = field(default=0, metadata={"cli": "rep_lie_seed",
                                           "help": "rep-lie: LoRA init and data order"})

    def __post_init__(self):
        check_range("rep_lie_steps", self.steps, 1, 10**6, integer=True)
        check_range("rep_lie_lr", self.lr, 0.0, 10.0)
        check_range("lora_rank", self.rank, 1, 4096, integer=True)
        check_range("rep_lie_seed", self.seed, 0, 2**31 - 1, integer=True)

    def needs_lm_head(self, unit):
        return True

    def block_scores(self, job, kind):
        means, _facts = rep_lie_importances(
            job.lm, job.input_ids, kind=kind, mode=job.cfg.heads, steps=self.steps,
            lr=self.lr, rank=self.rank, seed=self.seed, batch_size=job.batch_size)
        return [(m, None) for m in means]
