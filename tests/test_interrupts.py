"""prunelab.interrupts: a Ctrl-C is noted before it is raised, held over deferred blocks,
raised again after library code swallowed it (real SIGINTs sent to this process)."""

from __future__ import annotations

import signal

import pytest

from prunelab import interrupts


@pytest.fixture
def watched():
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts.reset()
    assert interrupts.watch()
    yield
    signal.signal(signal.SIGINT, old)
    interrupts.reset()


def test_watch_leaves_an_ignored_or_foreign_handler_alone():
    old = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert not interrupts.watch()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        mine = lambda s, f: None  # noqa: E731
        signal.signal(signal.SIGINT, mine)
        assert not interrupts.watch()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, old)


def test_an_interrupt_is_raised_at_once_and_noted(watched):
    assert not interrupts.seen()
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert interrupts.seen()


def test_a_swallowed_interrupt_is_raised_again_by_check(watched):
    interrupts.check()  # nothing noted: nothing raised
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        pass  # what a library that clears errors does
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()


def test_a_deferred_block_runs_to_its_end_then_the_interrupt_is_raised(watched):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
            with interrupts.deferred():  # nested: only the outermost raises
                done.append("inner")
            done.append("end")
    assert done == ["after the signal", "inner", "end"]


def test_a_deferred_block_without_an_interrupt_raises_nothing(watched):
    with interrupts.deferred():
        x = 1
    assert x == 1 and not interrupts.seen()


def test_an_error_of_the_deferred_block_propagates_unchanged(watched):
    with pytest.raises(ValueError, match="its own"):
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            raise ValueError("its own")
    assert interrupts.seen()


def test_check_waits_inside_a_deferred_block(watched):
    with pytest.raises(KeyboardInterrupt):
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            interrupts.check()  # held: the block is not cut in the middle
            reached = True
    assert reached
