"""A tokenizer whose ids the model cannot embed (vocab_size smaller than the tokenizer's
ids): one line naming both sizes, before the model runs, in Python and on the command
line (eval on data and on a task file, generate), never an IndexError."""

from __future__ import annotations

import json

import pytest
import transformers as tf

from prunelab.errors import ConfigError
from prunelab.eval.tasks import evaluate_tasks
from prunelab.models.loading import wrap
from prunelab.models.vocab import check_token_ids, embedding_rows

from tiny_models import SAMPLE_TEXT, char_tokenizer, cli_here, tiny_model


def _small_vocab(vocab: int = 100):
    """A tiny Llama embedding ids 0..vocab-1, with the char tokenizer (ids up to 130)."""
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=48, max_position_embeddings=128)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def test_ids_within_the_vocabulary_pass_and_beyond_are_one_line():
    lm = wrap(_small_vocab(100), char_tokenizer())
    assert embedding_rows(lm.model) == 100
    check_token_ids(lm, [[0, 5, 99]])  # the last row is fine
    with pytest.raises(ConfigError) as exc:
        check_token_ids(lm, [[3, 100]], "--data text:x")
    assert str(exc.value) == ("the tokenizer of 131 tokens gives token id 100 in --data "
                              "text:x, but the model has vocab_size 100 (100 embedding rows): "
                              "the tokenizer does not belong to this model")
    with pytest.raises(ConfigError, match="gives token id -1 in"):
        check_token_ids(lm, [[-1, 3]])
    check_token_ids(wrap(tiny_model("llama"), char_tokenizer()), [[0, 130]])  # VOCAB 131


@pytest.fixture
def small_dir(tmp_path):
    path = tmp_path / "small"
    _small_vocab(100).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT)  # letters: ids 101..121 among them
    return path


def test_eval_and_generate_name_both_sizes(small_dir, tmp_path, capsys):
    text = tmp_path / "t.txt"
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"context": "zz", "choices": ["yes", "no"], "gold": 0}) + "\n")
    for args in (["eval", "--model", str(small_dir), "--data", f"text:{text}", "--seqlen",
                  "16", "--samples", "2"],
                 ["generate", "--model", str(small_dir), "--prompt", "zebra"]):
        res = cli_here(capsys, *args)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1, res.stdout + res.stderr
        assert "Traceback" not in res.stderr and "IndexError" not in res.stderr
        assert lines[0].startswith("error: the tokenizer of 131 tokens gives token id 1")
        assert lines[0].endswith("but the model has vocab_size 100 (100 embedding rows): "
                                 "the tokenizer does not belong to this model")
    lm = wrap(_small_vocab(100), char_tokenizer())
    with pytest.raises(ConfigError, match="in a task item, but the model has vocab_size 100"):
        evaluate_tasks(lm, str(task))
