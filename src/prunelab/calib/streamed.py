"""What runs on a streamed model (:mod:`prunelab.models.streaming`), and how.

* Evaluation (:func:`score_windows_streamed`): perplexity by the protocol of
  :mod:`prunelab.eval.perplexity`, the blocks run one at a time by the block runner over
  every test window, then the final norm and the head row by row. The hidden states of all
  windows are held in memory (``[N, T, hidden]``), not the model.
* Pruning (:func:`streamed_prune`): the method runs as usual; every block that leaves
  memory is written to a staging shard (:meth:`Streamer.writing`). Methods that need the
  whole model at once (gradients through it, whole-model passes) are refused in one line
  (:func:`check_streamable`).
* Probes: only those in :data:`prunelab.probes.base.STREAMABLE_PROBES` (forward passes
  through the stack).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.errors import UnsupportedOperationError
from prunelab.eval.divergence import kl_from_logits, nll_sum, top1_agreement
from prunelab.eval.perplexity import final_hidden
from prunelab.models.streaming import streamer_of


@torch.no_grad()
def streamed_final_hidden(lm, input_ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Base-model outputs (after the final norm) per batch of ``input_ids`` ``[N, T]``,
    computed block by block (one block resident at a time)."""
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    hidden = runner.run(desc="eval (streamed)")
    if lm.streamer is not None:
        lm.streamer.release()
    norm = lm.adapter.final_norm()
    return [norm(h) if norm is not None else h for h in hidden]


def _final_hidden(lm, ids_batches, input_ids, batch_size):
    if streamer_of(lm) is not None:
        return streamed_final_hidden(lm, input_ids, batch_size)

    return [final_hidden(lm, ids) for ids in ids_batches]


@torch.no_grad()
def score_windows_streamed(lm, input_ids: torch.Tensor, batch_size: int = 4,
                           reference=None, reference_cache: dict | None = None) -> dict:
    """:func:`prunelab.eval.perplexity.score_windows` for a streamed ``lm`` (and a
    streamed or resident ``reference``): same protocol, same keys."""
    input_ids = torch.as_tensor(input_ids)
    n, t = input_ids.shape
    start = time.perf_counter()
    batches = list(input_ids.split(batch_size))
    hidden = _final_hidden(lm, batches, input_ids, batch_size)
    ref_hidden = None
    if reference is not None:
        ref_hidden = _final_hidden(reference, batches, input_ids, batch_size)
    nll = kl_sum = agree_sum = 0.0
    for b, ids in enumerate(batches):
        for row in range(ids.shape[0]):
            logits = lm.adapter.logits(hidden[b][row:row + 1].to(lm.device))
            nll += float(nll_sum(logits, ids[row:row + 1]))
            if ref_hidden is not None:
                ref_logits = reference.adapter.logits(
                    ref_hidden[b][row:row + 1].to(reference.device)).to(logits.device)
                kl_sum += float(kl_from_logits(ref_logits, logits).double().sum())
                agree_sum += float(top1_agreement(ref_logits, logits).double().sum())
    elapsed = time.perf_counter() - start
    scored = n * (t - 1)
    out = {"perplexity": math.exp(nll / scored), "nll": nll / scored, "tokens": scored,
           "seqlen": t, "samples": n, "eval_seconds": elapsed,
           "eval_tokens_per_s": n * t / elapsed if elapsed > 0 else float("inf"),
           "streamed": True}
    if reference is not None:
        out["kl_to_reference"] = kl_sum / (n * t)
        out["top1_agreement"] = agree_sum / (n * t)
    return out


def check_streamable(lm, config) -> None:
    """One-line :class:`UnsupportedOperationError` for a method that needs the whole model
    in memory. Each method declares it (``config.check_streamable()``: its own errors); a
    config without that hook is not streamable."""
    check = getattr(config, "check_streamable", None)
    if check is None:
        raise UnsupportedOperationError(
            f"--stream supports prune sparsity, width and depth, not {type(config).__name__}")
    check()


@contextlib.contextmanager
def streamed_prune(lm, config) -> Iterator[None]:
    """Around a prune: checks the method streams, then stages every block that leaves
    memory (the last one on exit). A no-op for a model that is not streamed."""
    st = streamer_of(lm)
    if st is None:
        yield
        return
    check_streamable(lm, config)
    with st.writing():
        yield


def check_streamed_eval(speed: bool = False, press: str | None = None,
                        moe_mass: float | None = None,
                        gradient_alignment: str | None = None) -> None:
    """One-line error for evaluation options that need the whole model resident."""
    asked = [flag for flag, on in (("--speed", speed), ("--press", press),
                                   ("--budget keep-mass:F", moe_mass is not None),
                                   ("--gradient-alignment", gradient_alignment)) if on]
    if asked:
        raise UnsupportedOperationError(
            f"--stream evaluates perplexity / KL block by block; {asked[0]} needs the whole "
            "model in memory: run it without --stream")
