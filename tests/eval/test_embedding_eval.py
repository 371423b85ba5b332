"""Encoder evaluation: sentence split, mask-weighted pooling, NN agreement on hand-made cases,
and the API/CLI on a tiny BERT."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import prunelab
from prunelab.data import TextSource
from prunelab.errors import ConfigError, DataError, UnsupportedOperationError
from prunelab.eval.embedding import (
    embed,
    held_out_sentences,
    mean_cosine,
    mean_pool,
    nearest_neighbours,
    nn_agreement,
    same_document_nn,
    score_sentences,
    sentence_batch,
    split_sentences,
)
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, save_tiny_checkpoint, tiny_model


def bert_char_tokenizer():
    """The tiny char tokenizer with a ``<s>`` prefix on every sequence (like BERT's [CLS])."""
    from tokenizers import processors

    tok = char_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 128)])
    return tok


DOCS = (
    "Alpha one is here now. Alpha two is also here. Short. Alpha three ends the alpha text.",
    "Beta one is a sentence too. Beta two follows the first one! Beta three asks why it is?",
    "Gamma has only one long sentence in this document",
)


def source(docs=DOCS):
    return TextSource(name="hand:test", documents=tuple(docs), joiner="\n\n",
                      description="hand")


def test_split_sentences():
    assert split_sentences("One two. Three four! Five six? seven.  Eight\nnine. 9 ten") == \
        ["One two.", "Three four!", "Five six? seven.", "Eight nine.", "9 ten"]
    assert split_sentences("  ") == []


def test_held_out_sentences_too_few():
    with pytest.raises(DataError, match="only 5 sentences"):
        held_out_sentences(source(), samples=6, per_document=2, min_words=4)


def test_held_out_sentences_exact():
    sents, docs = held_out_sentences(source(), samples=5, per_document=2, min_words=4)
    assert sents == ["Alpha one is here now.", "Alpha two is also here.",
                     "Beta one is a sentence too.", "Beta two follows the first one!",
                     "Gamma has only one long sentence in this document"]
    assert docs == [0, 0, 1, 1, 2]


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, -100.0]],
                           [[2.0, 0.0], [50.0, 50.0], [60.0, 60.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert mean_pool(hidden, mask).tolist() == [[2.0, 3.0], [2.0, 0.0]]
    assert mean_pool(hidden, torch.zeros(2, 3)).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_nearest_neighbours_and_agreement_hand_made():
    # pairs (0, 1) and (2, 3) point the same way
    ref = torch.tensor([[1.0, 0.0], [2.0, 0.1], [0.0, 1.0], [0.1, 1.0]])
    assert nearest_neighbours(ref).tolist() == [1, 0, 3, 2]
    # row 0 becomes a copy of row 3: row 0 -> 3 (cos 1); row 1's best cosines are rows 0
    # and 3 (equal, 0.149) -> the lowest index 0, as under ref; rows 2 and 3 now both
    # pick row 0 (tie with row 3 / exact copy). Only row 1 agrees: 1/4.
    emb = torch.tensor([[0.1, 1.0], [2.0, 0.1], [0.0, 1.0], [0.1, 1.0]])
    assert nearest_neighbours(emb).tolist() == [3, 0, 0, 0]
    assert nn_agreement(ref, emb) == 0.25
    # row 2 moved next to row 0: cos(0, 2) = 0.99995 > cos(0, 1) = 0.970 and row 1's best
    # is row 2 (0.9725 > 0.970); row 3's is row 1 (0.338): no row agrees
    emb = torch.tensor([[1.0, 0.0], [2.0, 0.5], [1.0, 0.01], [0.1, 1.0]])
    assert nearest_neighbours(emb).tolist() == [2, 2, 0, 1]
    assert nn_agreement(ref, emb) == 0.0
    assert nn_agreement(ref, ref) == 1.0
    assert nn_agreement(ref, 3.0 * ref) == 1.0  # cosine ignores scale
    with pytest.raises(ConfigError):
        nearest_neighbours(ref[:1])


def test_mean_cosine_and_same_document():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    emb = torch.tensor([[1.0, 1.0], [0.0, -2.0]])
    assert mean_cosine(ref, emb) == pytest.approx((1 / math.sqrt(2) - 1) / 2)
    pts = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.2, 1.0]])
    assert same_document_nn(pts, [0, 0, 1, 1]) == 1.0
    assert same_document_nn(pts, [0, 1, 0, 1]) == 0.0
    assert same_document_nn(pts, [0, 0, 1, 2]) == 0.5


def test_sentence_batch_pads_and_embed_matches_unpadded_forward():
    tok = bert_char_tokenizer()
    tok.model_max_length = 1000
    batch = sentence_batch(tok, source(), samples=5, max_length=40)
    lens = batch.attention_mask.sum(1).tolist()
    assert lens == [min(len(s) + 1, 40) for s in held_out_sentences(source(), 5)[0]]
    assert batch.input_ids[:, 0].tolist() == [128] * 5  # the tokenizer's own prefix
    assert batch.input_ids.shape[1] == max(lens) and batch.documents == (0, 0, 0, 1, 1)
    lm = wrap(tiny_model("bert"), tok)
    emb = embed(lm, batch, batch_size=2)
    with torch.no_grad():
        for i, n in enumerate(lens):  # each sentence alone, no padding at all
            h = lm.model(input_ids=batch.input_ids[i:i + 1, :n]).last_hidden_state
            torch.testing.assert_close(emb[i], h[0].mean(0), rtol=1e-4, atol=1e-5)
    res = score_sentences(lm, batch, batch_size=3, reference=lm)
    assert res["mean_cosine_to_reference"] == pytest.approx(1.0, abs=1e-6)
    assert res["nn_agreement"] == 1.0 and res["sentences"] == 5
    assert 0.0 <= res["same_document_nn"] <= 1.0


def test_left_padding_tokenizer_gives_the_same_batch():
    tok = bert_char_tokenizer()
    tok.model_max_length = 1000
    right = sentence_batch(tok, source(), samples=5, max_length=40)
    tok.padding_side = "left"
    left = sentence_batch(tok, source(), samples=5, max_length=40)
    assert torch.equal(left.input_ids, right.input_ids)
    assert torch.equal(left.attention_mask, right.attention_mask)


def test_reference_cache_and_pruned_model():
    tok = bert_char_tokenizer()
    tok.model_max_length = 1000
    batch = sentence_batch(tok, source(), samples=5, max_length=64)
    dense = wrap(tiny_model("bert"), tok)
    pruned = wrap(copy.deepcopy(dense.model), tok)
    pruned.adapter.delete_blocks([1, 2])
    cache: dict = {}
    a = score_sentences(pruned, batch, reference=dense, reference_cache=cache)
    assert len(cache) == 1
    ref_emb, emb = embed(dense, batch), embed(pruned, batch)
    assert a["mean_cosine_to_reference"] == pytest.approx(mean_cosine(ref_emb, emb))
    assert a["mean_cosine_to_reference"] < 1.0 - 1e-6
    assert a["nn_agreement"] == nn_agreement(ref_emb, emb)
    # the cached reference is used: poison it and the result follows
    key = next(iter(cache))
    cache[key] = emb.clone()
    b = score_sentences(pruned, batch, reference=dense, reference_cache=cache)
    assert b["mean_cosine_to_reference"] == pytest.approx(1.0) and b["nn_agreement"] == 1.0


def test_api_evaluate_encoder(tmp_path):
    text = tmp_path / "t.jsonl"
    text.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    save_tiny_checkpoint("bert", tmp_path / "bert")
    lm = prunelab.load(str(tmp_path / "bert"))
    res = prunelab.evaluate(lm, f"jsonl:{text}", samples=5, seqlen=32, reference=lm)
    assert res["nn_agreement"] == 1.0 and res["data"]["kind"] == "sentences"
    assert res["seqlen"] == 32 and res["samples"] == 5 and "perplexity" not in res
    with pytest.raises(UnsupportedOperationError, match="encoder"):
        prunelab.evaluate(lm, f"jsonl:{text}", samples=5, speed=True)
    with pytest.raises(ConfigError, match="same kind"):
        prunelab.evaluate(lm, f"jsonl:{text}", samples=5,
                          reference=wrap(tiny_model("llama"), lm.tokenizer))
    # the CLI prints the embedding metrics and writes them
    from tiny_models import cli_inproc

    out = tmp_path / "e.json"
    r = cli_inproc("--quiet", "eval", "--model", str(tmp_path / "bert"), "--data", f"jsonl:{text}",
                   "--samples", "5", "--seqlen", "32", "--reference", str(tmp_path / "bert"),
                   "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "nearest-neighbour agreement" in r.stdout and "perplexity" not in r.stdout
    got = json.loads(out.read_text())
    assert got["nn_agreement"] == 1.0
    assert got["same_document_nn"] == pytest.approx(res["same_document_nn"])
    r = cli_inproc("--quiet", "eval", "--model", str(tmp_path / "bert"), "--data", f"jsonl:{text}",
                   "--samples", "50")
    assert r.returncode == 2 and "only 7 sentences" in r.stderr + r.stdout
