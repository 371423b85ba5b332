"""``prunelab.prune(lm, TokenPruning(keep=0.7, layers=(3,)))``: the token-pruning method
through the one pruning verb. It installs :class:`~prunelab.pruning.tokens.checkpoint.TokenPruner`
modules, so the model (and a saved checkpoint, with remote code) prunes its own tokens; no
calibration data is read (the scores are the CLS attention of each input)."""

from __future__ import annotations

from prunelab.errors import ConfigError
from prunelab.models.custom import install
from prunelab.pruning.base import PRUNERS, DictReport, Pruner
from prunelab.pruning.tokens.checkpoint import TokenPruner
from prunelab.pruning.tokens.runtime import TokenPrunedEncoder, TokenPruning


def install_token_pruning(lm, config) -> list[str]:
    """Put a :class:`TokenPruner` into every block of ``config.layers`` of ``lm.model``
    (a vision encoder's LoadedModel), so the model itself prunes tokens and a saved
    checkpoint does too. Returns the module paths."""
    TokenPrunedEncoder(lm, config)  # the same checks (vision family, layers in range)
    ad = lm.adapter
    names = {id(m): n for n, m in lm.model.named_modules()}
    paths = []
    for i in config.layers:
        block = ad.block(i)
        rel = {id(m): n for n, m in block.named_modules()}
        if any(isinstance(m, TokenPruner) or getattr(m, "prunelab_kind", "") == "token_pruner"
               for m in block.modules()):
            raise ConfigError(f"block {i} already prunes tokens")
        norm = ad.norms(i).get(ad.spec.norms[0])
        proj = ad.attn_projections(i)
        geo = ad.head_geometry(i)
        pruner = TokenPruner(config.keep, config.fuse, geo.num_heads, geo.head_dim,
                             rel[id(norm)], rel[id(proj["q"])], rel[id(proj["k"])])
        path = f"{names[id(block)]}.token_pruner"
        install(lm.model, path, pruner)
        paths.append(path)
    return paths


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
