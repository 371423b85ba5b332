"""benchmarks/beyond_memory.py's checkpoint writer at a tiny shape: the checkpoint loads
with prunelab with the planned parameter count, a rerun with the same shape and seed
reuses it, and a fresh write with the same seed gives the same tensors (another seed does
not)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import prunelab

from tiny_models import char_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    if "beyond_memory" in sys.modules:
        return sys.modules["beyond_memory"]
    spec = importlib.util.spec_from_file_location(
        "beyond_memory", ROOT / "benchmarks" / "beyond_memory.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["beyond_memory"] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def test_tiny_checkpoint_loads_and_is_reproducible(tmp_path):
    bm = _bench()
    tok = tmp_path / "tok"
    char_tokenizer().save_pretrained(tok)
    shape = bm.shape_for_tokenizer(bm.Shape(layers=2, hidden=64, intermediate=96, heads=4,
                                            kv_heads=2), tok)
    # small shards: several files, each tensor written alone
    info = bm.write_checkpoint(tmp_path / "a", shape, seed=3, tokenizer_dir=tok,
                               shard_bytes=40_000)
    assert not info["reused"] and len(info["files"]) > 2
    lm = prunelab.load(str(tmp_path / "a"))
    n = sum(p.numel() for p in lm.model.parameters())
    assert n == shape.params() == info["params"]
    assert lm.model.config.num_hidden_layers == 2 and not lm.model.config.tie_word_embeddings
    first = _tensors(tmp_path / "a")
    assert all(t.dtype == torch.bfloat16 for t in first.values())
    q = first["model.layers.0.self_attn.q_proj.weight"].float()
    assert 0.015 < q.std().item() < 0.025
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()}
    again = bm.write_checkpoint(tmp_path / "a", shape, seed=3, tokenizer_dir=tok,
                                shard_bytes=40_000)
    assert again["reused"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").iterdir()} == mtimes
    bm.write_checkpoint(tmp_path / "b", shape, seed=3, tokenizer_dir=tok, shard_bytes=10**6)
    second = _tensors(tmp_path / "b")  # other shards, same tensors
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    # another seed: rewritten in place (not reused), other values
    other = bm.write_checkpoint(tmp_path / "a", shape, seed=4, tokenizer_dir=tok,
                                shard_bytes=40_000)
    assert not other["reused"]
    assert not torch.equal(_tensors(tmp_path / "a")["lm_head.weight"], first["lm_head.weight"])


def test_vocabulary_must_match_the_tokenizer(tmp_path, capsys):
    bm = _bench()
    tok = tmp_path / "tok"
    char_tokenizer().save_pretrained(tok)
    with pytest.raises(SystemExit):
        bm.write_checkpoint(tmp_path / "a", bm.Shape(layers=1, hidden=32, intermediate=48,
                                                     heads=4, kv_heads=4, vocab=99),
                            seed=0, tokenizer_dir=tok)
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "a").exists()


def test_passes_split_the_block_loads():
    bm = _bench()
    ev = [(1.0, "load", 0), (2.0, "free", 0), (2.0, "load", 1), (4.0, "free", 1),
          (5.0, "load", 0), (5.5, "free", 0), (5.5, "load", 1), (6.0, "free", 1)]
    p = bm.passes(ev, 2)
    assert [x["blocks"] for x in p] == [2, 2]
    assert p[0]["seconds"] == 3.0 and p[1]["s_per_block"] == 0.5


def test_placed_depth_runs_remove_the_first_middle_or_last_blocks():
    bm = _bench()
    assert bm.placed_blocks("first", 12, 4) == [0, 1, 2, 3]
    assert bm.placed_blocks("middle", 12, 4) == [4, 5, 6, 7]
    assert bm.placed_blocks("last", 12, 4) == [8, 9, 10, 11]
    args = type("A", (), {"samples": 2, "seqlen": 8, "sparsity": 0.5, "remove": 2,
                          "layers": 6})()
    cmd = bm._command("depth-last", Path("m"), Path("o"), args)
    assert cmd[:4] == ["prune", "depth", "--blocks", "4,5"] and "--probe" not in cmd
    assert bm._pass_names("depth-first", 3) == ["dense outputs", "KL of the pruned model",
                                                "save"]
    assert bm._ratio(3, 2) == "1.50x" and bm._ratio(1, 0) == "-"
