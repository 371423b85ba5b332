"""Needle windows for the decay press' end-to-end fit: layout, seeding, errors, and the
fit running on them."""

import pytest
import torch

from prunelab.errors import ConfigError
from prunelab.inference.decay_kl import KLCalibration
from prunelab.inference.needles import ANSWER, NEEDLE, QUESTION, needle_windows, with_needles
from prunelab.models.loading import wrap

from tiny_models import char_tokenizer, tiny_model

TOK = char_tokenizer()


def _hay(n: int, t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    hay = torch.randint(97, 123, (n, t), generator=g)  # lower-case letters: no digit, no \n
    hay[:, 0] = 128  # a BOS that must stay first
    return hay


def _text(ids) -> str:
    return "".join(chr(i) for i in ids.tolist())


def test_needle_window_layout_is_exact():
    hay = _hay(3, 200)
    win, info = needle_windows(TOK, hay, horizon=16, seed=5)
    assert win.shape == (3, 200) and win.dtype == torch.long
    for row, h, meta in zip(win, hay, info, strict=True):
        key, at, p = meta["key"], meta["needle_at"], meta["answer_at"]
        needle, question, answer = (NEEDLE.format(key=key), QUESTION,
                                    ANSWER.format(key=key))
        assert 10000 <= key < 100000 and 0.1 <= meta["depth"] <= 0.9 and p == 200 - 16
        assert row[0] == 128  # the BOS stays first
        assert _text(row[at:at + len(needle)]) == needle
        assert _text(row[p - len(question):p]) == question  # the prompt ends with the question
        assert _text(row[p:p + len(answer)]) == answer  # the continuation opens with the key
        # the haystack, in order, fills everything else
        body = p - len(needle) - len(question)
        assert torch.equal(row[:at], h[:at])
        assert torch.equal(row[at + len(needle):p - len(question)], h[at:body])
        assert torch.equal(row[p + len(answer):], h[body:body + 16 - len(answer)])
        # the depth is the needle's place in the prompt's haystack
        assert at == max(1, min(body - 1, round(meta["depth"] * body)))


def test_needle_windows_are_seeded():
    hay = _hay(4, 160)
    a, ia = needle_windows(TOK, hay, horizon=12, seed=1)
    b, ib = needle_windows(TOK, hay, horizon=12, seed=1)
    c, ic = needle_windows(TOK, hay, horizon=12, seed=2)
    assert torch.equal(a, b) and ia == ib
    assert [m["key"] for m in ia] != [m["key"] for m in ic]
    assert len({m["key"] for m in ia}) == 4  # a key of its own per window


def test_needle_window_errors():
    with pytest.raises(ConfigError, match="cannot hold the needle"):
        needle_windows(TOK, _hay(1, 100), horizon=16)
    with pytest.raises(ConfigError, match="cannot hold the needle"):  # answer > horizon
        needle_windows(TOK, _hay(1, 300), horizon=4)
    with pytest.raises(ConfigError, match="depths"):
        needle_windows(TOK, _hay(1, 300), horizon=16, depths=(0.8, 0.2))
    with pytest.raises(ConfigError, match=r"\[N, T\]"):
        needle_windows(TOK, _hay(1, 300)[0], horizon=16)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="needles"):
            with_needles(TOK, _hay(2, 300), bad, horizon=16)


def test_with_needles_appends_windows_on_the_first_haystacks():
    text = _hay(2, 180, seed=3)
    assert with_needles(TOK, text, 0, horizon=16) is text
    out = with_needles(TOK, text, 3, horizon=16, seed=9)
    assert out.shape == (5, 180) and torch.equal(out[:2], text)
    want, _ = needle_windows(TOK, text[[0, 1, 0]], horizon=16, seed=9)
    assert torch.equal(out[2:], want)  # the haystacks repeat when needles > windows


def test_the_kl_fit_runs_on_needle_windows_and_never_loses_to_snapkv():
    """A tiny model knows no keys; this checks the plumbing: windows of mixed kind go
    through the fit, whose calibration KL stays at or below SnapKV's (its start)."""
    lm = wrap(tiny_model("llama"))
    text = _hay(2, 120, seed=1)
    text[:, 0] = 3  # inside the tiny vocabulary
    ids = with_needles(TOK, text, 2, horizon=12, seed=0)
    kl = KLCalibration(lm, ids, horizon=12, observe=4, kernel=3)
    assert len(kl.windows) == 4
    kl.fit(0.5, blocks=2)
    hist = kl.history[0.5]
    assert hist["kl_fitted"] <= hist["kl_snapkv"]
