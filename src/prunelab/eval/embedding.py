"""Encoder evaluation: mean-pooled sentence embeddings of held-out sentences.

A sentence encoder (``minilm-l6``, any bert-family model) has no next-token distribution,
so it is evaluated on what it is used for: sentence embeddings.

Protocol:

1. Sentences: the documents of the test source (``wiki-vital:test`` by default) in order,
   each split into sentences by :func:`split_sentences`; from every document the first
   ``per_document`` (4) sentences with at least ``min_words`` (5) words are taken, until
   ``samples`` sentences are collected (default 512). Documents are kept apart, so every
   sentence has a document id.
2. Each sentence is tokenized as the tokenizer frames one sequence (``[CLS] ... [SEP]``),
   truncated to ``max_length`` tokens and padded to the longest sentence; the embedding is
   the mean of the last hidden states over the real (attention-mask) tokens, as
   sentence-transformers' mean pooling does (Reimers & Gurevych 2019, the pooling
   all-MiniLM-L6-v2 was trained with). Maths in float32.
3. Metrics:

   * ``same_document_nn`` (needs no reference): the fraction of sentences whose most
     cosine-similar other sentence comes from the same document, a retrieval-style quality
     of the embedding space on its own;
   * with a reference model (the dense one): ``mean_cosine_to_reference``, the mean over
     sentences of ``cos(e_model, e_reference)``, and ``nn_agreement``, the fraction of
     sentences whose nearest other sentence (by cosine, itself excluded) is the same under
     both models.

The reference's embeddings can be kept in a dict (``reference_cache``) keyed by the token
sha256, so many pruned models are compared with one reference pass.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from prunelab.data import load_text_source, tensor_sha256
from prunelab.data.sources import TextSource
from prunelab.errors import ConfigError, DataError

DEFAULT_SENTENCES = 512

# a sentence ends at . ! or ? followed by whitespace and an upper-case letter, digit or quote
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\u201c])")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` at sentence ends (see ``_SENTENCE_END``); strips and drops empties."""
    parts = _SENTENCE_END.split(" ".join(text.split()))
    return [p.strip() for p in parts if p.strip()]


def held_out_sentences(source: TextSource | str, samples: int = DEFAULT_SENTENCES,
                       per_document: int = 4, min_words: int = 5
                       ) -> tuple[list[str], list[int]]:
    """``(sentences, document_ids)`` by step 1 of the protocol."""
    if isinstance(source, str):
        source = load_text_source(source)
    sentences: list[str] = []
    docs: list[int] = []
    for d, doc in enumerate(source.documents):
        taken = 0
        for sent in split_sentences(doc):
            if taken == per_document or len(sentences) == samples:
                break
            if len(sent.split()) >= min_words:
                sentences.append(sent)
                docs.append(d)
                taken += 1
        if len(sentences) == samples:
            break
    if len(sentences) < samples:
        raise DataError(f"{source.name} gives only {len(sentences)} sentences; ask for "
                        f"--samples {len(sentences)} or fewer")
    return sentences, docs


@dataclass(frozen=True)
class SentenceBatch:
    """Tokenized sentences: ``input_ids`` and ``attention_mask`` ``[N, T]`` (padded)."""

    input_ids: torch.Tensor = field(repr=False, compare=False)
    attention_mask: torch.Tensor = field(repr=False, compare=False)
    documents: tuple[int, ...] = field(repr=False)
    spec: str
    max_length: int
    sha256: str

    @property
    def samples(self) -> int:
        return int(self.input_ids.shape[0])

    def to_dict(self) -> dict:
        return {"spec": self.spec, "kind": "sentences", "samples": self.samples,
                "max_length": self.max_length, "tokens": int(self.attention_mask.sum()),
                "documents": len(set(self.documents)), "sha256": self.sha256}


def sentence_batch(tokenizer, source: TextSource | str = "wiki-vital:test",
                   samples: int | None = None, max_length: int = 128) -> SentenceBatch:
    """Held-out sentences of ``source``, tokenized with the tokenizer's own special tokens,
    truncated to ``max_length`` and padded to the longest."""
    samples = DEFAULT_SENTENCES if samples is None else samples
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
        raise ConfigError(f"--samples must be an integer >= 2 sentences (got {samples!r})")
    if max_length < 3:
        raise ConfigError(f"--seqlen (max sentence length) must be >= 3, got {max_length}")
    if isinstance(source, str):
        source = load_text_source(source)
    sentences, docs = held_out_sentences(source, samples)
    enc = tokenizer(sentences, add_special_tokens=True, truncation=True,
                    max_length=max_length, padding="longest", return_tensors="pt")
    ids, mask = _right_padded(enc["input_ids"].to(torch.int64),
                              enc["attention_mask"].to(torch.int64))
    return SentenceBatch(input_ids=ids, attention_mask=mask, documents=tuple(docs),
                         spec=source.name, max_length=max_length,
                         sha256=tensor_sha256(torch.cat([ids, mask], dim=1)))


def _right_padded(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the left (a left-padding tokenizer's output becomes
    right-padded, which :func:`embed` relies on); the pad id is kept."""
    lengths = mask.sum(1)
    if bool((mask == (torch.arange(mask.shape[1]) < lengths[:, None])).all()):
        return ids, mask
    new_ids = torch.empty_like(ids)
    for r in range(ids.shape[0]):
        real, pad = ids[r][mask[r].bool()], ids[r][~mask[r].bool()]
        new_ids[r] = torch.cat([real, pad])
    return new_ids, (torch.arange(mask.shape[1]) < lengths[:, None]).to(mask.dtype)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``hidden`` ``[B, T, d]`` over positions where ``mask`` ``[B, T]`` is 1, in
    float32: ``sum_t m_t h_t / max(sum_t m_t, 1)`` -> ``[B, d]``."""
    m = mask.to(hidden.device, torch.float32).unsqueeze(-1)
    return (hidden.float() * m).sum(1) / m.sum(1).clamp_min(1.0)


def cosine_matrix(emb: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` cosine similarities of the rows of ``emb`` (float64)."""
    e = emb.double()
    e = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return e @ e.t()


def nearest_neighbours(emb: torch.Tensor) -> torch.Tensor:
    """Index of each row's most cosine-similar other row (itself excluded), ``[N]``; ties
    go to the lowest index."""
    if emb.shape[0] < 2:
        raise ConfigError("nearest neighbours need at least 2 sentences")
    sim = cosine_matrix(emb)
    sim.fill_diagonal_(float("-inf"))
    return sim.argmax(dim=1)


def nn_agreement(ref: torch.Tensor, emb: torch.Tensor) -> float:
    """Fraction of rows whose nearest other row is the same under ``ref`` and ``emb``."""
    return float((nearest_neighbours(ref) == nearest_neighbours(emb)).double().mean())


def mean_cosine(ref: torch.Tensor, emb: torch.Tensor) -> float:
    """Mean over rows of ``cos(ref[i], emb[i])`` (float64)."""
    return float(torch.cosine_similarity(ref.double(), emb.double(), dim=-1).mean())


def same_document_nn(emb: torch.Tensor, documents) -> float:
    """Fraction of rows whose nearest other row belongs to the same document."""
    docs = torch.as_tensor(list(documents))
    return float((docs[nearest_neighbours(emb)] == docs).double().mean())


@torch.no_grad()
def embed(lm, batch: SentenceBatch, batch_size: int = 32) -> torch.Tensor:
    """Mean-pooled last hidden states of every sentence, ``[N, d]`` float32 on the CPU.

    Sentences run in batches of similar length (sorted by length, each batch cut to its
    longest sentence) to spend little on padding; the result is in the original order."""
    base = lm.adapter.base
    lengths = batch.attention_mask.sum(1)
    order = torch.argsort(lengths, stable=True)
    out = torch.empty(batch.samples, lm.adapter.hidden_size())
    for start in range(0, batch.samples, batch_size):
        rows = order[start:start + batch_size]
        width = int(lengths[rows].max())
        ids = batch.input_ids[rows, :width].to(lm.device)
        mask = batch.attention_mask[rows, :width].to(lm.device)
        hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
        out[rows] = mean_pool(hidden, mask).cpu()
    return out


def score_sentences(lm, batch: SentenceBatch, batch_size: int = 32, reference=None,
                    reference_cache: dict | None = None) -> dict:
    """Embedding metrics of ``lm`` on ``batch`` (see the module docstring)."""
    start = time.perf_counter()
    emb = embed(lm, batch, batch_size)
    elapsed = time.perf_counter() - start
    out = {"sentences": batch.samples, "max_length": batch.max_length,
           "tokens": int(batch.attention_mask.sum()), "embedding_dim": int(emb.shape[1]),
           "same_document_nn": same_document_nn(emb, batch.documents),
           "eval_seconds": elapsed,
           "sentences_per_s": batch.samples / elapsed if elapsed > 0 else float("inf")}
    if reference is not None:
        key = ("sentences", batch.sha256)
        if reference_cache is not None and key in reference_cache:
            ref = reference_cache[key]
        else:
            ref = embed(reference, batch, batch_size)
            if reference_cache is not None:
                reference_cache[key] = ref
        if ref.shape != emb.shape:
            raise ConfigError(f"the reference embeds into {ref.shape[1]} dimensions, the "
                              f"model into {emb.shape[1]}")
        out["mean_cosine_to_reference"] = mean_cosine(ref, emb)
        out["nn_agreement"] = nn_agreement(ref, emb)
    return out
