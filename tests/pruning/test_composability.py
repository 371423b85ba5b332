"""The composability matrix (issue 39, class 4): every pruning method applied to every
kind of prunelab checkpoint either works (exit 0, a checkpoint written) or refuses in one
`error:` line (exit 2) before writing anything; never a traceback.

The kinds are made once per module from one tiny llama (and a tiny ViT for the
token-pruned encoder) with the CLI itself, in-process (``cli_main``) to keep the matrix
fast; the cells the issue reported as tracebacks run always, the whole matrix is
``slow``."""

from __future__ import annotations

import pytest

from prunelab.cli import cli_main

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

SMALL = ["--samples", "4", "--seqlen", "16", "--batch-size", "2"]

#: how each kind of checkpoint is made from the dense tiny llama (``prune`` arguments)
KINDS = {
    "depth": ["depth", "--blocks", "1"],
    "sparse": ["sparsity", "--method", "magnitude", "--budget", "remove-weights:0.5"],
    "width": ["width", "--unit", "ffn", "--allocation", "global", "--budget",
              "remove-units:0.3"],
    "sliced": ["factor", "--method", "slicegpt", "--budget", "remove-hidden:0.25"],
    "lowrank": ["factor", "--method", "svd-llm", "--budget", "remove-weights:0.3"],
    "moe": ["moe", "--set", "experts=4"],
    "gates": ["gates", "--budget", "remove-compute:0.3", "--set", "steps=20"],
    "elastic": ["elastic", "--set", "steps=4"],
    "tokens": None,  # prune tokens on a tiny ViT (see _kind)
}

#: each method as it is applied to a checkpoint (``prune`` arguments)
METHODS = {
    "depth": ["depth", "--blocks", "1"],
    "sparsity": ["sparsity", "--method", "wanda", "--budget", "remove-weights:0.5"],
    "width": ["width", "--unit", "ffn", "--budget", "remove-units:0.25"],
    "slicegpt": ["factor", "--method", "slicegpt", "--budget", "remove-hidden:0.25"],
    "svd-llm": ["factor", "--method", "svd-llm", "--budget", "remove-weights:0.3"],
    "shared-dict": ["factor", "--method", "shared-dict", "--budget", "remove-weights:0.3"],
    "moe": ["moe", "--set", "experts=4"],
    "gates": ["gates", "--budget", "remove-compute:0.3", "--set", "steps=20"],
    "elastic": ["elastic", "--set", "steps=4"],
}

#: the cells the adversarial run found as tracebacks (always run)
REPORTED = [("moe", "sparsity"), ("moe", "slicegpt"), ("moe", "svd-llm"), ("sliced", "moe"),
            ("moe", "width"), ("lowrank", "svd-llm"), ("gates", "width"),
            ("tokens", "sparsity")]


def _run(args, capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        rc = cli_main(["--quiet", *args])
    except BaseException as exc:  # noqa: BLE001 - a traceback is what the test catches
        pytest.fail(f"prunelab {' '.join(args)} raised {type(exc).__name__}: {exc}")
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def kinds(tmp_path_factory):
    root = tmp_path_factory.mktemp("composability")
    save_tiny_checkpoint("llama", root / "dense")
    (root / "text.txt").write_text(SAMPLE_TEXT)
    return root


def _kind(root, kind: str, capsys):
    path = root / kind
    if kind == "tokens" and not path.exists():  # a token-pruned ViT (remote code)
        from tiny_media import tiny_vision

        tiny_vision().save_pretrained(root / "vit")
        rc, err = _run(["prune", "tokens", "--model", str(root / "vit"), "--budget",
                        "keep-tokens:0.5", "--layers", "1", "--samples", "3", "--size", "56",
                        "--lfw-size", "28", "--out", str(path)], capsys)
        assert rc == 0, err
    if not path.exists():
        rc, err = _run(["prune", *KINDS[kind], "--model", str(root / "dense"), "--data",
                        f"text:{root / 'text.txt'}", *SMALL, "--out", str(path)], capsys)
        assert rc == 0, err
    return path


def _cell(root, kind: str, method: str, capsys):
    src = _kind(root, kind, capsys)
    out = root / f"{kind}--{method}"
    rc, err = _run(["prune", *METHODS[method], "--model", str(src), "--trust-remote-code",
                    "--data", f"text:{root / 'text.txt'}", *SMALL, "--out", str(out)], capsys)
    lines = [x for x in err.strip().splitlines() if not x.startswith("prunelab: warning")]
    if rc == 0:
        assert (out / "manifest.json").exists()
        return "ok"
    assert rc == 2, f"{kind} x {method}: exit {rc}: {err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{kind} x {method}: {err}"
    assert "Traceback" not in err and not out.exists()
    return lines[0]


@pytest.mark.parametrize(("kind", "method"), REPORTED)
def test_reported_cells_work_or_refuse_in_one_line(kinds, kind, method, capsys):
    got = _cell(kinds, kind, method, capsys)
    assert got == "ok" or got.startswith("error: "), got


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_method_on_every_kind(kinds, kind, method, capsys):
    got = _cell(kinds, kind, method, capsys)
    assert got == "ok" or got.startswith("error: "), got
