"""A checkpoint's JSON files read in one line on any defect (issue 39, class 4): a
``manifest.json`` that is a JSON list, not JSON or not UTF-8, and a truncated or edited
``elastic.json``, through the readers and through ``prunelab export`` / ``recipe``."""

from __future__ import annotations

import json
import shutil

import pytest

import prunelab
from prunelab.cli import cli_main
from prunelab.data.batches import TokenBatches
from prunelab.errors import CorruptCheckpointError
from prunelab.io.manifest import read_json_file, read_manifest
from prunelab.pruning.width.elastic import ElasticRanking
from prunelab.pruning.width.elastic.store import check_ranking

from tiny_models import save_tiny_checkpoint, tiny_tokens


@pytest.mark.parametrize(("text", "msg"), [
    (b"[1, 2]", "must hold a JSON object, got a list"),
    (b'"x"', "must hold a JSON object, got a string"),
    (b'{"operations": {"a": 1}}', "'operations' must be a list of objects"),
    (b'{"operations": [1]}', "'operations' must be a list of objects"),
    (b'{"source_model": "m"}', "'source_model' must be an object"),
    (b'{"format": "prunelab-manifest/1", "operati', "is not valid JSON (truncated or edited?"),
    (b'{"a": "\xff"}', "is not UTF-8 text"),
])
def test_bad_manifests_are_one_line(tmp_path, text, msg):
    (tmp_path / "manifest.json").write_bytes(text)
    with pytest.raises(CorruptCheckpointError) as ei:
        read_manifest(tmp_path)
    assert msg in str(ei.value) and "\n" not in str(ei.value)
    assert str(tmp_path / "manifest.json") in str(ei.value)


def test_readers_accept_good_files(tmp_path):
    assert read_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text('{"operations": [{"operation": "x"}]}')
    assert read_manifest(tmp_path) == {"operations": [{"operation": "x"}]}
    (tmp_path / "l.json").write_text("[1]")
    assert read_json_file(tmp_path / "l.json", list) == [1]


@pytest.fixture(scope="module")
def elastic_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("el")
    lm = prunelab.load(str(save_tiny_checkpoint("llama", root / "dense")))
    data = TokenBatches(input_ids=tiny_tokens(2, 8), spec="tiny", seqlen=8, samples=2, seed=0,
                        mode="calib", total_windows=2, sha256="0")
    prunelab.prune(lm, ElasticRanking(steps=2), data, batch_size=2)
    return prunelab.save(lm, root / "elastic")


def _ranking(elastic_ckpt):
    return json.loads((elastic_ckpt / "elastic.json").read_text())


@pytest.mark.parametrize(("edit", "msg"), [
    (lambda r: [r], "a JSON list, not an object"),
    (lambda r: {**r, "format": "x"}, "format 'x'"),
    (lambda r: {**r, "blocks": r["blocks"][:2]}, "2 blocks of scores for 4 blocks of counts"),
    (lambda r: {**r, "heads_per_block": 3}, "'heads_per_block' must be a list"),
    (lambda r: {**r, "blocks": [{**r["blocks"][0], "ffn": r["blocks"][0]["ffn"][:5]},
                                *r["blocks"][1:]]}, "block 0 needs 48 ffn scores"),
    (lambda r: {**r, "blocks": [{**r["blocks"][0], "heads": ["a", "b"]}, *r["blocks"][1:]]},
     "block 0: the heads scores must be finite numbers"),
])
def test_edited_rankings_are_refused(elastic_ckpt, edit, msg):
    with pytest.raises(CorruptCheckpointError) as ei:
        check_ranking(edit(_ranking(elastic_ckpt)), "elastic.json")
    assert str(ei.value).startswith("elastic.json: not a usable elastic ranking (")
    assert msg in str(ei.value)


@pytest.mark.parametrize("broken", ["truncated-ranking", "list-manifest"])
def test_export_and_recipe_of_a_broken_elastic_checkpoint_are_one_line(
        elastic_ckpt, tmp_path, capsys, broken):
    ckpt = shutil.copytree(elastic_ckpt, tmp_path / "c")
    if broken == "truncated-ranking":
        raw = (ckpt / "elastic.json").read_bytes()
        (ckpt / "elastic.json").write_bytes(raw[:len(raw) // 2])
        msg = f"{ckpt / 'elastic.json'} is not valid JSON (truncated or edited?"
    else:
        (ckpt / "manifest.json").write_text("[1, 2]")
        msg = f"{ckpt / 'manifest.json'} must hold a JSON object, got a list"
    commands = [["export", "--model", str(ckpt), "--budget", "keep-units:0.7", "--out",
                 str(tmp_path / "small")]]
    if broken == "list-manifest":
        commands.append(["recipe", "--from", str(ckpt)])
    for args in commands:
        assert cli_main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0], err
    assert not (tmp_path / "small").exists()
