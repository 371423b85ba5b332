"""Token ids against the model's vocabulary: a tokenizer that gives ids the model has no
embedding for (a tokenizer of another model, added tokens the embedding was never resized
for) would fail deep inside the forward (``IndexError`` in the embedding lookup); here it
is one line naming both sizes, before the model runs."""

from __future__ import annotations

import torch

from prunelab.errors import ConfigError


def embedding_rows(model) -> int | None:
    """The token ids ``model`` can embed: its input embedding's rows, else its config's
    ``vocab_size`` (``None`` when neither is known)."""
    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        emb = None
    rows = getattr(emb, "num_embeddings", None)
    if isinstance(rows, int) and rows > 0:
        return rows
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def check_token_ids(lm, ids, what: str = "the data") -> None:
    """Refuse, in one line, token ids ``ids`` (a tensor or nested lists) of ``what`` that
    ``lm`` (a ``LoadedModel``) cannot embed: naming the largest id, the tokenizer's size and
    the model's ``vocab_size``."""
    rows = embedding_rows(lm.model)
    if rows is None:
        return
    t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    if t.numel() == 0:
        return
    top, low = int(t.max()), int(t.min())
    if top < rows and low >= 0:
        return
    tok = getattr(lm, "tokenizer", None)
    size = f" of {len(tok):,} tokens" if tok is not None else ""
    vocab = getattr(lm.model.config, "vocab_size", rows)
    bad = top if top >= rows else low
    raise ConfigError(f"the tokenizer{size} gives token id {bad:,} in {what}, but the model "
                      f"has vocab_size {vocab:,} ({rows:,} embedding rows): the tokenizer "
                      f"does not belong to this model")
