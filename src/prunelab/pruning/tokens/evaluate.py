"""One call that scores token pruning (and TAP-Path's gated multi-depth head) on a vision
encoder against its own dense forward; the face of ``prunelab prune tokens``."""

from __future__ import annotations

from prunelab.data.images import images_for
from prunelab.eval.vision import LFW_SIZE, LfwData, embed, fidelity, images_per_second, lfw_accuracy
from prunelab.pruning.tokens.head import lfw_gated_accuracy
from prunelab.pruning.tokens.runtime import TokenPrunedEncoder, TokenPruning


def evaluate_token_pruning(lm, config: TokenPruning, depths: tuple = (), samples: int = 32,
                           size: int = 224, lfw_size: int | None = None,
                           batch_size: int = 8, speed: bool = True) -> dict:
    """The :func:`~prunelab.eval.vision.evaluate_vision` metrics of ``lm`` with patch
    tokens pruned by ``config`` (reference: ``lm``'s dense forward), the tokens each block
    runs on, the dense images/s and the speed-up, and with ``depths`` (0-based blocks) the
    gated multi-depth head's LFW accuracy and mean gate weights."""
    enc = TokenPrunedEncoder(lm, config)
    photos = images_for("images:test", samples=samples, size=size)
    res = fidelity(embed(lm, photos.input_ids, batch_size),
                   embed(enc, photos.input_ids, batch_size))
    res["tokens_per_block"] = list(enc.tokens_per_block)  # at the photos' size
    res["token_share"] = sum(enc.tokens_per_block) / (
        enc.tokens_per_block[0] * len(enc.tokens_per_block))
    res["lfw_accuracy"] = lfw_accuracy(enc, LfwData.make(lfw_size or LFW_SIZE), batch_size)
    if speed:
        res["images_per_s"] = images_per_second(enc, size, batch_size)
        res["dense_images_per_s"] = images_per_second(lm, size, batch_size)
        res["speedup"] = res["images_per_s"] / res["dense_images_per_s"]
    if depths:
        res.update(lfw_gated_accuracy(enc, tuple(depths), lfw_size, batch_size))
    res.update({"keep": config.keep, "layers": list(config.layers), "fuse": config.fuse,
                "data": photos.to_dict(), "image_size": size, "model": lm.spec})
    return res
