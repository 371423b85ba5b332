"""Every float option of every command rejects ``nan`` (and, in the slow run, ``inf``):
exit 2, one ``error:`` line that names the option, nothing written.

The options are read from the CLI itself (typer's click tree), so an option added later
without a valid base invocation here fails :func:`test_every_float_option_is_swept` instead
of going unchecked. Each case is a valid invocation on a tiny checkpoint plus the bad value,
so the error cannot come from a missing argument; options that only apply beside another one
get that companion in ``NEEDS``.
"""

from __future__ import annotations

import os

import pytest
import typer

from prunelab.cli import cli_main
from prunelab.cli.apps import app

from tiny_models import SAMPLE_TEXT, save_tiny_checkpoint

M, T, O, V = "{m}", "{t}", "{o}", "{v}"  # noqa: E741 (model, text, output, vision model)
DATA = ["--data", f"text:{T}", "--seqlen", "16"]

# a valid invocation of each command (before the bad option is added)
BASE = {
    "export": ["export", "--model", M, "--out", O],
    "generate": ["generate", "--model", M, "--prompt", "hello", "--max-new-tokens", "2",
                 "--press", "snapkv"],
    "heal": ["heal", "--model", M, "--out", O, *DATA, "--eval-data", f"text:{T}",
             "--steps", "1"],
    "eval": ["eval", "--model", M, *DATA, "--samples", "1"],
    "probe": ["probe", "--model", M, "--out", O, *DATA, "--probe", "gradient-flow"],
    "compare": ["compare", "--model", M, "--calib", f"text:{T}", "--test", f"text:{T}",
                "--methods", "wanda", "--budget", "remove-weights:0.5", "--out", O, "--ray",
                "auto"],
    "prune depth": ["prune", "depth", "--model", M, "--out", O, *DATA],
    "prune sparsity": ["prune", "sparsity", "--model", M, "--out", O, *DATA],
    "prune width": ["prune", "width", "--model", M, "--out", O, *DATA],
    "prune gates": ["prune", "gates", "--model", M, "--out", O, *DATA],
    "prune moe": ["prune", "moe", "--model", M, "--out", O, *DATA],
    "prune elastic": ["prune", "elastic", "--model", M, "--out", O, *DATA],
    "prune factor": ["prune", "factor", "--model", M, "--out", O, *DATA],
    "prune tokens": ["prune", "tokens", "--model", V, "--layers", "1", "--samples", "2",
                     "--size", "28", "--lfw-size", "28"],
    "run": ["run", "{r}", "--out", O, "--ray", "auto"],
    "sweep depth": ["sweep", "depth", "--model", M, "--out", O, *DATA, "--test",
                    f"text:{T}", "--test-seqlen", "16", "--budget", "remove-blocks:1..2", "--ray",
                    "auto"],
}

# companions an option needs to apply (without them it is refused for another reason)
NEEDS = {
    ("eval", "--press-context"): ["--press", "snapkv"],
    ("heal", "--prune-fraction"): ["--prune", "rep-lie"],
    ("heal", "--stability"): ["--prune", "rep-lie"],
    ("heal", "--ce-weight"): ["--loss", "mix"],
    ("heal", "--kd-weight"): ["--loss", "mix"],
    ("heal", "--hidden-weight"): ["--loss", "mix"],
    ("prune sparsity", "--owl-m"): ["--allocation", "owl"],
    ("prune sparsity", "--owl-lambda"): ["--allocation", "owl"],
    ("prune sparsity", "--pals-delta"): ["--allocation", "pals"],
    ("prune sparsity", "--ramp-span"): ["--allocation", "ramp"],
    ("prune sparsity", "--taper-slope"): ["--allocation", "taper"],
    ("prune sparsity", "--hessian-alpha"): ["--method", "sparsegpt"],
    ("prune width", "--rep-lie-lr"): ["--score", "rep-lie"],
    ("prune width", "--taper-slope"): ["--allocation", "taper"],
    # generated from the registered configs' fields (cli/generated.py)
    ("prune depth", "--ridge"): ["--recovery", "foldable"],
    ("prune width", "--outlier-z"): ["--score", "magnitude-profile"],
    ("prune sparsity", "--percdamp"): ["--method", "sparsegpt"],
    ("prune sparsity", "--threshold"): ["--method", "rose"],
    ("prune sparsity", "--rho"): ["--method", "admm"],
    ("prune sparsity", "--rho-growth"): ["--method", "admm"],
    ("prune sparsity", "--admm-damp"): ["--method", "admm"],
    ("prune sparsity", "--grad-damp"): ["--method", "cactus"],
    ("prune sparsity", "--tolerance"): ["--method", "admm"],

    ("prune factor", "--energy"): ["--widths", "energy"],
    ("prune factor", "--tol"): ["--method", "shared-dict"],
    ("prune factor", "--shrink"): ["--method", "shared-dict"],
    ("prune factor", "--expand"): ["--method", "shared-dict"],
    ("probe", "--scale"): ["--probe", "contraction"],
    **{(cmd, f"--press-{opt}"): ["--press", press] for cmd in ("eval", "generate")
       for opt, press in (("recent", "h2o"), ("mass-bound", "entroprefill"),
                          ("mix", "entroprefill"), ("alpha", "entroprefill"),
                          ("keep-scale", "entroprefill"), ("max-ratio", "entroprefill"),
                          ("stability", "entroprefill"), ("share", "decay"),
                          ("epsilon", "expected-attention"), ("alpha-safeguard", "adakv"),
                          ("beta", "pyramidkv"))},
}

# the size each command needs unless the swept option is the size itself
SIZE = {"prune depth": ["--budget", "remove-blocks:1"],
        "prune width": ["--budget", "remove-units:0.2"]}
SIZE_OPTIONS: set = set()  # the sizes are --budget KIND:VALUE now (tests/test_budget.py)


def _walk(cmd, path=()):
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _walk(sub, path + (name,))
    else:
        yield " ".join(path), cmd


def float_options() -> list[tuple[str, str]]:
    out = []
    for path, cmd in _walk(typer.main.get_command(app)):
        for p in cmd.params:
            if p.param_type_name == "option" and not p.is_flag \
                    and "float" in str(p.type_descriptor.annotation):
                out.append((path, p.opts[0]))
    return out


FLOATS = float_options()


def test_every_float_option_is_swept():
    assert len(FLOATS) >= 40
    assert sorted({path for path, _ in FLOATS} - set(BASE)) == []


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("float_sweep")
    save_tiny_checkpoint("llama", root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 4)
    from tiny_media import tiny_vision

    tiny_vision().save_pretrained(root / "vision")
    (root / "recipe.yaml").write_text(
        f"model: {root / 'model'}\ndata: text:{root / 'text.txt'}\nsamples: 2\nseqlen: 16\n"
        "stages:\n  - prune: {id: m, from: dense, method: magnitude, sparsity: 0.5}\n")
    return root


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def _with(argv: list[str], extra: list[str]) -> list[str]:
    """``argv`` plus the ``--flag value`` pairs of ``extra``, a flag already in ``argv``
    getting the new value (an option given twice is an error)."""
    argv = list(argv)
    for i in range(0, len(extra), 2):
        flag, value = extra[i], extra[i + 1]
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


# nan is the sharp case (every comparison with it is false, so ``x < 0`` checks let it
# through); inf runs with the slow tests
@pytest.mark.parametrize("value", ["nan", pytest.param("inf", marks=pytest.mark.slow)])
@pytest.mark.parametrize("path,option", FLOATS, ids=[f"{p}{o}" for p, o in FLOATS])
def test_float_option_rejects(path, option, value, assets, tmp_path, capsys):
    size = [] if option in SIZE_OPTIONS else SIZE.get(path, [])
    argv = _with(BASE[path] + size, NEEDS.get((path, option), [])) + [option, value]
    args = ["--quiet"] + [a.format(m=assets / "model", t=assets / "text.txt",
                                   o=tmp_path / "out", v=assets / "vision",
                                   r=assets / "recipe.yaml") for a in argv]
    before = _snapshot(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        code = cli_main(args)
    finally:
        os.chdir(cwd)
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert code == 2, text
    lines = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    # the message is about this value: it names the option (or its config field, the last
    # word of the flag, e.g. ``ratio`` for ``--press-ratio``) and shows the bad value
    word = option.lstrip("-").split("-")[-1]
    assert word in lines[0] and value in lines[0], lines[0]
    assert _snapshot(tmp_path) == before
