"""Every checkpoint the prune commands write for a Llama-family model, exported from its
folder by the CLI as a new user would (``prunelab prune ... --out W``, then ``prunelab
export --model W --format gguf``): the file runs in llama.cpp with prunelab's own
log-probabilities of the reloaded folder, or the export is refused in one line that says
why llama.cpp cannot compute it and what to prune instead."""

from __future__ import annotations

import pytest

import prunelab
from prunelab.cli import cli_main
from prunelab.eval.llamacpp import compare_with_llamacpp

from tiny_models import save_tiny_checkpoint, tiny_tokens

pytest.importorskip("llama_cpp", reason="llama-cpp-python is built by scripts/test.sh")

EXPORTED = {
    "depth-foldable": ["depth", "--budget", "remove-blocks:1", "--recovery", "foldable"],
    "depth-sublayer": ["depth", "--budget", "remove-blocks:1", "--granularity", "sublayer",
                       "--recovery", "foldable"],
    "width-ffn-global": ["width", "--unit", "ffn", "--budget", "remove-units:0.25",
                         "--allocation", "global"],
    "width-heads-global": ["width", "--unit", "heads", "--budget", "remove-units:0.5",
                           "--allocation", "global"],
    "width-query": ["width", "--unit", "heads", "--heads", "query", "--budget",
                    "remove-units:0.5"],
    "sparsity": ["sparsity", "--method", "wanda", "--budget", "remove-weights:0.5"],
    "gates": ["gates", "--budget", "remove-compute:0.2"],
    "slice-global": ["factor", "--method", "slicegpt", "--rotation", "global", "--budget",
                     "remove-hidden:0.25"],
    "svd-llm": ["factor", "--method", "svd-llm", "--budget", "keep-params:0.8"],
    "basis-sharing": ["factor", "--method", "basis-sharing", "--budget", "keep-params:0.8"],
}
REFUSED = {
    "depth-ghost": (["depth", "--budget", "remove-blocks:1", "--recovery", "ghost"],
                    "--recovery foldable"),
    "moe": (["moe", "--budget", "keep-mass:0.7"], "prune width --unit ffn"),
    "slice-per-layer": (["factor", "--method", "slicegpt", "--budget", "remove-hidden:0.25"],
                        "--rotation global"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import bpe_tokenizer

    root = tmp_path_factory.mktemp("folders")
    ckpt = save_tiny_checkpoint("llama", root / "tiny")
    bpe_tokenizer().save_pretrained(ckpt)
    text = root / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, then the cat. " * 100)
    return root, ckpt, text


def _prune(tiny, name: str, args: list[str]):
    root, ckpt, text = tiny
    out = root / name
    rc = cli_main(["prune", *args, "--model", str(ckpt), "--data", f"text:{text}",
                   "--samples", "4", "--seqlen", "16", "--out", str(out)])
    assert rc == 0
    return out


@pytest.mark.parametrize("name", list(EXPORTED))
def test_saved_checkpoint_exports_and_runs_in_llamacpp(name, tiny, capsys):
    root, _, _ = tiny
    folder = _prune(tiny, name, EXPORTED[name])
    target = root / f"{name}.gguf"
    assert cli_main(["export", "--model", str(folder), "--format", "gguf",
                     "--trust-remote-code", "--out", str(target)]) == 0
    text = capsys.readouterr()
    if name in ("svd-llm", "basis-sharing"):
        assert "multiplied out" in text.err + text.out
    lm = prunelab.load(str(folder), trust_remote_code=True)
    got = compare_with_llamacpp(lm, target, tiny_tokens(2, 16, seed=3), threads=1)
    assert got["max_abs_target_logprob_diff"] < 0.02, got  # f16 weights, f16 KV cache


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_llamacpp_cannot_compute_is_refused_in_one_line(name, tiny, capsys):
    root, _, _ = tiny
    args, hint = REFUSED[name]
    folder = _prune(tiny, name, args)
    capsys.readouterr()
    target = root / f"{name}.gguf"
    assert cli_main(["export", "--model", str(folder), "--format", "gguf",
                     "--trust-remote-code", "--out", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: GGUF export: "), err
    assert hint in err[0]
    assert not target.exists()


def test_tied_slice_from_its_folder_exports_without_an_output_tensor(tiny, capsys):
    """A tied model sliced with --keep-tied, saved, exported from the folder by the CLI:
    the GGUF holds no output.weight (llama.cpp uses the embeddings) and runs as prunelab."""
    import gguf

    from tiny_models import bpe_tokenizer, tiny_tied_model

    root, _, text = tiny
    ckpt = root / "tied"
    tiny_tied_model().save_pretrained(ckpt)
    bpe_tokenizer().save_pretrained(ckpt)
    out, target = root / "tied-sliced", root / "tied-sliced.gguf"
    assert cli_main(["prune", "factor", "--method", "slicegpt", "--rotation", "global",
                     "--budget", "remove-hidden:0.25", "--keep-tied", "--model", str(ckpt),
                     "--data", f"text:{text}", "--samples", "4", "--seqlen", "16",
                     "--out", str(out)]) == 0
    assert cli_main(["export", "--model", str(out), "--format", "gguf", "--out",
                     str(target)]) == 0
    names = {t.name for t in gguf.GGUFReader(target).tensors}
    assert "token_embd.weight" in names and "output.weight" not in names
    lm = prunelab.load(str(out))
    assert lm.model.config.tie_word_embeddings is True and lm.model.config.hidden_size == 24
    got = compare_with_llamacpp(lm, target, tiny_tokens(2, 16, seed=3), threads=1)
    assert got["max_abs_target_logprob_diff"] < 0.02, got
