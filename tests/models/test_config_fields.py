"""Typed ``config.json`` checks before a model is built (issue 39, classes 3 and 4): sizes of
the wrong type or sign and NaN / infinite numbers are one line naming the field, in the
loader, ``info`` and ``eval`` (``rms_norm_eps: NaN`` used to evaluate to perplexity nan)."""

from __future__ import annotations

import json
import math

import pytest

import prunelab
from prunelab.errors import CorruptCheckpointError
from prunelab.models.loading import check_config_fields, model_positions

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

CASES = [  # (arch, field, value, words of the message)
    ("llama", "hidden_size", "32", 'hidden_size must be a positive integer, got "32" (str)'),
    ("llama", "hidden_size", 32.0, "hidden_size must be a positive integer, got 32.0"),
    ("llama", "num_attention_heads", [4], "num_attention_heads must be a positive integer"),
    ("llama", "num_hidden_layers", 4.0, "num_hidden_layers must be a positive integer"),
    ("llama", "intermediate_size", -48, "intermediate_size must be positive, got -48"),
    ("llama", "vocab_size", True, "vocab_size must be a positive integer, got true"),
    ("llama", "rms_norm_eps", math.nan, "rms_norm_eps is nan; a model needs finite"),
    ("llama", "max_position_embeddings", math.inf, "max_position_embeddings is inf"),
    ("gpt2", "n_positions", "128", 'n_positions must be a positive integer, got "128"'),
    ("gpt2", "layer_norm_epsilon", -math.inf, "layer_norm_epsilon is -inf"),
    # transformers' own validators, one line instead of a multi-line traceback
    ("llama", "hidden_size", 33, "hidden size (33) is not a multiple of the number of "
     "attention heads (4)"),
    ("llama", "head_dim", 7, "head_dim`=7"),
]


def _edit(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))  # Python writes NaN / Infinity
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    return {a: save_tiny_checkpoint(a, root / a) for a in ("llama", "gpt2")}


@pytest.mark.parametrize(("arch", "field", "value", "msg"), CASES)
def test_bad_config_fields_are_refused_before_the_model_is_built(tiny, tmp_path, arch, field,
                                                                 value, msg):
    import shutil

    path = _edit(shutil.copytree(tiny[arch], tmp_path / "m"), **{field: value})
    with pytest.raises(CorruptCheckpointError) as ei:
        prunelab.load(str(path))
    assert msg in str(ei.value) and str(path / "config.json") in str(ei.value)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("command", ["info", "eval"])
@pytest.mark.parametrize(("field", "value"), [("rms_norm_eps", math.nan),
                                              ("hidden_size", "32"), ("head_dim", [8])])
def test_info_and_eval_say_one_line(tiny, tmp_path, capsys, command, field, value):
    import shutil

    from prunelab.cli import cli_main

    path = _edit(shutil.copytree(tiny["llama"], tmp_path / "m"), **{field: value})
    (tmp_path / "t.txt").write_text(SAMPLE_TEXT)
    args = ["info", "--model", str(path)] if command == "info" else \
        ["eval", "--model", str(path), "--data", f"text:{tmp_path / 't.txt'}", "--seqlen",
         "16", "--samples", "2", "--json", str(tmp_path / "e.json")]
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and field in err[0]
    assert not (tmp_path / "e.json").exists()


def test_nested_configs_and_nulls():
    check_config_fields({"text_config": {"hidden_size": 8, "head_dim": None}}, "c")
    check_config_fields({"sliding_window": None, "num_hidden_layers": 0}, "c")  # 0: later
    with pytest.raises(CorruptCheckpointError, match=r"c: text_config.hidden_size must be a "
                       "positive integer"):
        check_config_fields({"text_config": {"hidden_size": "8"}}, "c")
    with pytest.raises(CorruptCheckpointError, match=r"rope_scaling.factor is nan"):
        check_config_fields({"rope_scaling": {"factor": math.nan}}, "c")
    with pytest.raises(CorruptCheckpointError, match=r"layer_norms\[1\] is inf"):
        check_config_fields({"layer_norms": [1.0, math.inf]}, "c")


def test_a_config_that_is_not_an_object_is_one_line(tiny, tmp_path):
    import shutil

    path = shutil.copytree(tiny["llama"], tmp_path / "m")
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CorruptCheckpointError, match="must hold a JSON object, got a list"):
        prunelab.load(str(path))
    (path / "config.json").write_bytes(b'{"model_type": "ll\xffama"}')
    with pytest.raises(CorruptCheckpointError, match="is not UTF-8"):
        prunelab.load(str(path))


def test_model_positions(tiny):
    assert model_positions(prunelab.load(str(tiny["gpt2"])).model.config) == 128
    assert model_positions(prunelab.load(str(tiny["llama"])).model.config) == 128
