"""Score a greedy step's candidates in several processes (``Sleb.workers``).

Each step, after the current plan's streams are refreshed, ``workers - 1`` processes are
forked (Linux ``fork``: they share the model, the cached boundaries and the current
streams copy-on-write, nothing is pickled on the way in); candidate ``i`` goes to process
``i mod workers`` (process 0 is this one). Every process scores its candidates with the
same scorer as the serial loop, one torch thread each, and sends back each candidate's
``(value, raw)``, its own best :class:`~prunelab.pruning.depth.removal_plan.Scored` (with
the repair it fitted, pickled), its block evaluations, and what it cached for later steps:
the MLP taps (:class:`~prunelab.pruning.depth.fast_loop.TappedStates`) and the dense
mid-block targets of sub-block cuts, so no step computes them twice. The step's choice
is the first lowest value in candidate order, as in the serial loop, and it comes from
the process that scored it; the values are the serial loop's (each candidate is computed
by the same code on the same tensors). Interleaving balances the shares: candidates early
in the stack run more blocks.

Where ``fork`` is not available the candidates are scored serially.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

import torch


def best_of(scored: list) -> int:
    """Index of the first lowest ``value`` (the serial loop's choice)."""
    best = 0
    for i, s in enumerate(scored):
        if s[0] < scored[best][0]:
            best = i
    return best


def _score_share(scorer, plan, cands, idx, states) -> dict:
    """Score ``cands[i]`` for ``i`` in ``idx``: values, own best, evaluations, new taps."""
    runner = scorer.ctx.runner
    evals0 = runner.block_evals
    had = set(getattr(states, "taps", {}))
    mids = set(scorer._mid)
    values, best = [], None
    for i in idx:
        s = scorer.candidate(plan, cands[i], states)
        values.append((i, s.value, s.raw))
        if best is None or s.value < best[1].value:
            best = (i, s)
    taps = {b: t for b, t in getattr(states, "taps", {}).items() if b not in had}
    return {"values": values, "best": best, "evals": runner.block_evals - evals0,
            "taps": taps, "mid": {j: v for j, v in scorer._mid.items() if j not in mids}}


def _child(conn, scorer, plan, cands, idx, states) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        conn.send_bytes(pickle.dumps(_score_share(scorer, plan, cands, idx, states)))
    except BaseException as exc:  # report, never fall back into the parent's code
        code = 1
        try:
            conn.send_bytes(pickle.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        except BaseException:
            pass
    finally:
        conn.close()
        os._exit(code)


def score_step(scorer, plan, cands: list, states, workers: int):
    """``(best Scored, [(value, raw)] per candidate)`` of one greedy step, the candidates
    shared among ``workers`` processes (see module docstring)."""
    if workers <= 1 or len(cands) < 2 or "fork" not in mp.get_all_start_methods():
        share = _score_share(scorer, plan, cands, list(range(len(cands))), states)
        return share["best"][1], [(v, r) for _, v, r in share["values"]]
    fork = mp.get_context("fork")
    workers = min(workers, len(cands))
    procs = []
    for w in range(1, workers):
        recv, send = fork.Pipe(duplex=False)
        p = fork.Process(target=_child, args=(send, scorer, plan, cands,
                                              list(range(w, len(cands), workers)), states))
        p.start()
        send.close()
        procs.append((p, recv))
    shares = [_score_share(scorer, plan, cands, list(range(0, len(cands), workers)),
                           states)]
    errors = []
    for p, recv in procs:
        try:
            shares.append(pickle.loads(recv.recv_bytes()))
        except EOFError:
            errors.append(f"worker {p.pid} exited without a result")
        recv.close()
        p.join()
    errors += [s["error"] for s in shares if "error" in s]
    if errors:
        raise RuntimeError("sleb workers failed: " + "; ".join(errors))
    values: list = [None] * len(cands)
    for s in shares[1:]:
        scorer.ctx.runner.block_evals += s["evals"]
        for j, v in s["mid"].items():
            scorer._mid.setdefault(j, v)
        if hasattr(states, "taps"):
            for b, t in s["taps"].items():
                states.taps.setdefault(b, {}).update(t)
    for s in shares:
        for i, v, r in s["values"]:
            values[i] = (v, r)
    win = best_of(values)
    best = next(s["best"][1] for s in shares if s["best"][0] == win)
    return best, values
