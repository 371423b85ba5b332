"""Layer-wise loading from disk (``load(stream=True)``, ``--stream``): the streamed run
gives the very tensors / logits of the resident run, holds at most one block, writes its
checkpoint atomically, and refuses what cannot stream in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import prunelab
from prunelab.data.batches import TokenBatches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.streaming import is_materialised

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint, tiny_tokens


def _batches(ids, mode):
    return TokenBatches(input_ids=ids, spec="tiny", seqlen=ids.shape[1], samples=len(ids),
                        seed=0, mode=mode, total_windows=len(ids), sha256="0")


CALIB = _batches(tiny_tokens(4, 12), "calib")
TEST = _batches(tiny_tokens(4, 12, seed=1), "test")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def _counting(lm) -> list[int]:
    """Materialised blocks after every load / free of the streamer."""
    counts: list[int] = []
    lm.streamer.listeners.append(lambda event, i: counts.append(
        sum(is_materialised(b) for b in lm.adapter.blocks())))
    return counts


def _same_checkpoints(a, b) -> None:
    ma = transformers.AutoModelForCausalLM.from_pretrained(a)
    mb = transformers.AutoModelForCausalLM.from_pretrained(b)
    sa, sb = ma.state_dict(), mb.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    ids = CALIB.input_ids
    assert torch.equal(ma(ids).logits, mb(ids).logits)


def _prune_both(ckpt, tmp_path, cfg):
    dense = prunelab.load(str(ckpt / "model"))
    streamed = prunelab.load(str(ckpt / "model"), stream=True)
    counts = _counting(streamed)
    assert not any(is_materialised(b) for b in streamed.adapter.blocks())
    ra = prunelab.prune(dense, cfg, CALIB, batch_size=2)
    rb = prunelab.prune(streamed, cfg, CALIB, batch_size=2)
    prunelab.save(dense, tmp_path / "dense")
    prunelab.save(streamed, tmp_path / "streamed")
    _same_checkpoints(tmp_path / "dense", tmp_path / "streamed")
    assert counts and max(counts) == 1 and streamed.streamer.peak_resident == 1
    assert not any(is_materialised(b) for b in streamed.adapter.blocks())
    man = json.loads((tmp_path / "streamed" / "manifest.json").read_text())
    assert man["streamed"] is True and man["operations"][0]["operation"] == ra["operation"]
    return ra, rb


@pytest.mark.parametrize("cfg", [prunelab.Wanda(sparsity=0.5), prunelab.SparseGPT(sparsity=0.5),
                                 prunelab.Magnitude(sparsity=0.5)], ids=lambda c: type(c).__name__)
def test_sparsity_streamed_equals_resident(ckpt, tmp_path, cfg):
    ra, rb = _prune_both(ckpt, tmp_path, cfg)
    assert rb["achieved_sparsity"] == ra["achieved_sparsity"] == pytest.approx(0.5)
    assert rb["size_after"] == ra["size_after"]


def test_width_streamed_equals_resident(ckpt, tmp_path):
    ra, rb = _prune_both(ckpt, tmp_path, prunelab.Width(unit="ffn", ratio=0.25))
    assert rb["removed_params"] == ra["removed_params"] > 0


def test_depth_foldable_streamed_equals_resident(ckpt, tmp_path):
    ra, rb = _prune_both(ckpt, tmp_path, prunelab.Depth(remove=1, recovery="foldable"))
    assert rb["removed_blocks"] == ra["removed_blocks"]
    assert rb["calib_kl_after_recovery"] == pytest.approx(ra["calib_kl_after_recovery"],
                                                          rel=1e-6)
    cfg = json.loads((tmp_path / "streamed" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3


def test_eval_and_probe_streamed_equal_resident(ckpt):
    dense = prunelab.load(str(ckpt / "model"))
    streamed = prunelab.load(str(ckpt / "model"), stream=True)
    counts = _counting(streamed)
    ea = prunelab.evaluate(dense, TEST, batch_size=2, reference=dense)
    eb = prunelab.evaluate(streamed, TEST, batch_size=2, reference=streamed)
    assert eb["perplexity"] == ea["perplexity"] and eb["tokens"] == ea["tokens"] == 4 * 11
    assert eb["kl_to_reference"] == pytest.approx(0, abs=1e-9)
    assert eb["params"] == ea["params"] and eb["bytes"] == ea["bytes"]
    pa = prunelab.probe(dense, "block-influence", CALIB, batch_size=2)
    pb = prunelab.probe(streamed, "block-influence", CALIB, batch_size=2)
    assert pb.to_dict()["scores"] == pa.to_dict()["scores"]
    assert max(counts) == 1


def test_failed_save_leaves_no_partial_folder(ckpt, tmp_path, monkeypatch):
    from prunelab.checkpoint import stream_save

    lm = prunelab.load(str(ckpt / "model"), stream=True)
    prunelab.prune(lm, prunelab.Magnitude(sparsity=0.5), CALIB, batch_size=2)
    real, calls = stream_save.write_safetensors, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(*a, **kw)

    monkeypatch.setattr(stream_save, "write_safetensors", failing)
    with pytest.raises(prunelab.PrunelabError, match="disk full"):
        prunelab.save(lm, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == []
    monkeypatch.setattr(stream_save, "write_safetensors", real)
    prunelab.save(lm, tmp_path / "out")  # the staged blocks are still there
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    # 4 blocks, the embeddings, the head (untied here), the rest (final norm)
    assert len(set(index["weight_map"].values())) == 7


def test_streaming_refusals_are_one_line(ckpt, tmp_path):
    lm = prunelab.load(str(ckpt / "model"), stream=True)
    cases = [(prunelab.Width(unit="ffn", ratio=0.25, score="ablation-kl"), "ablation-kl"),
             (prunelab.Depth(remove=1, recovery="ghost"), "ghost"),
             (prunelab.Depth(remove=1, probe="leave-one-out"), "leave-one-out"),
             (prunelab.SparseGPT(sparsity=0.5, hessian_alpha=0.5), "gradients")]
    for cfg, word in cases:
        with pytest.raises(UnsupportedOperationError, match=word) as err:
            prunelab.prune(lm, cfg, CALIB, batch_size=2)
        assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedOperationError, match="interchange"):
        prunelab.probe(lm, "block-influence,interchange", CALIB)
    with pytest.raises(UnsupportedOperationError, match="hub id"):
        prunelab.load("someone/some-model", stream=True)
    with pytest.raises(ConfigError, match="--allow-pickle"):
        prunelab.load(str(ckpt / "model"), stream=True, allow_pickle=True)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for f in (ckpt / "model").iterdir():
        if f.suffix != ".safetensors":
            (pickled / f.name).write_bytes(f.read_bytes())
    with pytest.raises(UnsupportedOperationError, match="safetensors"):
        prunelab.load(str(pickled), stream=True)


def _cli(capsys, *args):
    from prunelab.cli import cli_main

    capsys.readouterr()
    code = cli_main(["--quiet", *args])
    return code, capsys.readouterr().err


def test_cli_stream(ckpt, tmp_path, capsys):
    data = f"text:{ckpt / 'text.txt'}"
    model = str(ckpt / "model")
    common = ["--data", data, "--seqlen", "16", "--samples", "4", "--batch-size", "2"]
    for flag, out in (([], "dense"), (["--stream"], "streamed")):
        code, err = _cli(capsys, "prune", "sparsity", "--model", model, "--method", "wanda",
                         "--budget", "remove-weights:0.5", "--out", str(tmp_path / out), *common,
                         *flag)
        assert code == 0, err
    _same_checkpoints(tmp_path / "dense", tmp_path / "streamed")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # staging removed
    code, err = _cli(capsys, "eval", "--model", model, "--stream", "--speed", "--data", data)
    assert code == 2 and err.count("\n") == 1 and "--speed" in err
    code, err = _cli(capsys, "probe", "--model", model, "--stream", "--probe", "interchange",
                     "--out", str(tmp_path / "p"), *common)
    assert code == 2 and err.count("\n") == 1 and "interchange" in err
    code, err = _cli(capsys, "eval", "--model", model, "--stream", "--data", data,
                     "--seqlen", "16", "--samples", "4", "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    dense = prunelab.evaluate(prunelab.load(model), data, seqlen=16, samples=4)
    assert json.loads((tmp_path / "e.json").read_text())["perplexity"] == dense["perplexity"]


def test_gguf_source_streams_from_its_converted_shards(ckpt, tmp_path, monkeypatch):
    """A .gguf spec is converted once (as for a resident load) and its blocks are then
    read from the converted safetensors checkpoint."""
    from prunelab.models import loading

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-not-really")
    calls = []

    def fake_convert(path, name=None):
        calls.append(path)
        return ckpt / "model"

    monkeypatch.setattr(loading, "convert_gguf", fake_convert)
    lm = prunelab.load(str(gguf), stream=True)
    assert calls == [gguf.resolve()] and lm.source == str(ckpt / "model")
    assert prunelab.evaluate(lm, TEST, batch_size=2)["perplexity"] == prunelab.evaluate(
        prunelab.load(str(ckpt / "model")), TEST, batch_size=2)["perplexity"]
