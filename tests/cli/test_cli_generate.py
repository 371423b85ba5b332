"""``prunelab generate`` refuses, in one line, prompts it cannot run (issue 39, class 4):
an empty prompt, a prompt (or ``@FILE``) that is not UTF-8, and a prompt plus
``--max-new-tokens`` beyond the model's positions (GPT-2's learned positions used to be an
``IndexError``; a RoPE model ran past its trained length silently). Exactly at the limit
it generates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from prunelab.cli import cli_main

from tiny_models import save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    return {a: str(save_tiny_checkpoint(a, root / a)) for a in ("llama", "gpt2")}


def _one_error(capsys) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), cap.err
    assert "Traceback" not in cap.err + cap.out
    return err[0]


@pytest.mark.parametrize(("arch", "prompt", "new", "msg"), [
    ("gpt2", "hello", 124, "the prompt (5 tokens) plus --max-new-tokens 124 is beyond the 128 "
     "positions of"),
    ("gpt2", "x" * 200, 1, "the prompt (200 tokens) plus --max-new-tokens 1 is beyond"),
    ("llama", "hello", 200, "give --max-new-tokens 123 or less"),  # RoPE: trained length
    ("llama", "x" * 128, 1, "shorten the prompt"),
    ("llama", "", 4, "--prompt is empty"),
])
def test_prompts_that_cannot_run_are_one_line(tiny, capsys, arch, prompt, new, msg):
    args = ["generate", "--model", tiny[arch], "--prompt", prompt, "--max-new-tokens", str(new)]
    assert cli_main(args) == 2
    assert msg in _one_error(capsys)


def test_a_prompt_file_that_is_not_utf8_or_empty(tiny, tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"hello \xff\xfe world")
    assert cli_main(["generate", "--model", tiny["gpt2"], "--prompt",
                     f"@{tmp_path / 'p.txt'}"]) == 2
    assert "is not UTF-8 text (invalid start byte at byte 6)" in _one_error(capsys)
    (tmp_path / "e.txt").write_text("")
    assert cli_main(["generate", "--model", tiny["gpt2"], "--prompt",
                     f"@{tmp_path / 'e.txt'}"]) == 2
    assert f"--prompt file {tmp_path / 'e.txt'} is empty" in _one_error(capsys)


def test_a_prompt_argument_that_is_not_utf8(tiny):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable.encode(), b"-m", b"prunelab", b"generate", b"--model",
                          tiny["gpt2"].encode(), b"--prompt", b"\xff\xfe"],
                         capture_output=True, env=env, timeout=300)
    err = res.stderr.decode("utf-8", "replace").strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr
    assert err[0] == "error: --prompt is not UTF-8 text (character 0 cannot be encoded)"


def test_exactly_at_the_limit_it_generates(tiny, capsys):
    assert cli_main(["generate", "--model", tiny["gpt2"], "--prompt", "hello",
                     "--max-new-tokens", "123"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens" in out and "generated tokens" in out
