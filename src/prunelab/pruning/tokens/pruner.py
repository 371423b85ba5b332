"""``prunelab.prune(lm, TokenPruning(keep=0.7, layers=(3,)))``: the token-pruning method
through the one pruning verb. It installs :class:`~prunelab.pruning.tokens.checkpoint.TokenPruner`
modules, so the model (and a saved checkpoint, with remote code) prunes its own tokens; no
calibration data is read (the scores are the CLS attention of each input)."""

from __future__ import annotations

from prunelab.pruning.base import PRUNERS, DictReport, Pruner
from prunelab.pruning.tokens.checkpoint import install_token_pruning
from prunelab.pruning.tokens.runtime import TokenPrunedEncoder, TokenPruning


@PRUNERS.register(TokenPruning)
class TokenPruningPruner(Pruner):
    """Installs the token pruners of a :class:`TokenPruning` config (vision encoders)."""

    operation = "prune-tokens"
    needs_data = False

    def precheck(self, lm, config: TokenPruning) -> None:
        TokenPrunedEncoder(lm, config)  # vision family, layers in range: one-line errors

    def run(self, lm, config: TokenPruning, input_ids, *, batch_size: int) -> DictReport:
        paths = install_token_pruning(lm, config)
        return DictReport({"modules": paths, "needs_remote_code": True},
                          history_keys=("modules",))
