"""Shared state of a probing session: cached block boundaries and the divergence to dense.

One dense block-by-block pass caches the hidden state at every block boundary
``h_0 .. h_L``. A modified stack (swap, removal, ablation) starts from the cached input of
its first changed block and never recomputes the unchanged prefix; every block keeps the
arguments the model gives it at its own depth (its own mask type), never a KV cache.

Divergence to the dense model: for causal LMs the KL of next-token distributions,
``KL(p_dense || p_modified)``, at the last position of each window (float64, q clamped
>= 1e-40: the "No Free Swap" protocol) and averaged over all positions (float32); both
come from :mod:`prunelab.eval.divergence`, as does the token NLL. For
encoders, which have no next-token distribution, ``1 - cos`` of the mean-pooled final
hidden states per window (``value``) and of every token's final hidden state
(``value_all_positions``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prunelab.calib.runner import BlockRunner, StateStore
from prunelab.calib.streamed import streamed_final_hidden
from prunelab.eval.divergence import kl_from_logits, kl_from_logits_float64, token_nll

kl_last_position = kl_from_logits_float64  # the probes' name for the float64 KL


@dataclass
class WindowDivergence:
    """Divergence to dense per calibration window: ``last[w]`` (last position; mean-pooled
    ``1 - cos`` for encoders) and ``all_positions[w]`` (mean over the window's positions),
    N floats each, in window order; ``value`` / ``value_all_positions``: the overall means
    (every window has the same length, so the per-window values average to them up to
    rounding)."""

    last: list[float]
    all_positions: list[float]
    value: float
    value_all_positions: float

    def entry(self) -> dict:
        """The score fields: ``value``, ``value_all_positions``, ``windows`` and
        ``windows_all_positions`` (the per-window values, for bootstrapping later)."""
        return {"value": self.value, "value_all_positions": self.value_all_positions,
                "windows": self.last, "windows_all_positions": self.all_positions}


class ProbeContext:
    """Cached boundaries of a model on calibration windows, and modified-stack runs."""

    def __init__(self, lm, input_ids: torch.Tensor, batch_size: int = 8,
                 states: str = "memory", data_info: dict | None = None, lazy: bool = False):
        self.lm = lm
        self.adapter = lm.adapter
        self.input_ids = torch.as_tensor(input_ids)
        self.runner = BlockRunner(lm, self.input_ids, batch_size=batch_size)
        self.batch_size = batch_size
        #: block evaluations spent elsewhere on this context's behalf (a search on a
        #: subset of its windows, in this context's units: see :meth:`subset`)
        self.extra_block_evaluations = 0.0
        self._subsets: dict[int, ProbeContext] = {}
        self.store = StateStore(states)
        self.data_info = data_info or {}
        self.num_blocks = self.adapter.num_blocks
        self.encoder = self.adapter.is_encoder
        self.setup_seconds = 0.0
        self.cache_block_evaluations = 0.0
        self._cached = False
        if not lazy:
            self.ensure_cached()
        self._ref_cache: dict[int, torch.Tensor] = {}
        self._ref_uses: dict[int, int] = {}
        self._ref_bytes = 0
        #: reference logits kept up to this many bytes, from a batch's third use on
        self.ref_cache_budget = 2 * 2**30

    # ------------------------------------------------------------------ running
    def ensure_cached(self) -> None:
        """One dense pass storing every block boundary ``h_0 .. h_L`` (once)."""
        if self._cached:
            return
        start = time.perf_counter()
        self.runner.run(states=self.store, desc="caching block boundaries")
        self.setup_seconds = time.perf_counter() - start
        self.cache_block_evaluations = self.block_evaluations
        self._cached = True

    @property
    def block_evaluations(self) -> float:
        """Blocks run over the whole calibration set (one block x all windows = 1)."""
        return self.runner.block_evals / max(len(self.runner.batches), 1) + \
            self.extra_block_evaluations

    def subset(self, windows: int) -> ProbeContext:
        """A context of the same dense model on the first ``windows`` calibration windows
        (made once, kept until :meth:`close`); ``self`` when that is all of them. A search
        run on it should charge :meth:`charge` with its cost."""
        if windows >= len(self.input_ids):
            return self
        if windows not in self._subsets:
            sub = ProbeContext(self.lm, self.input_ids[:windows], batch_size=self.batch_size,
                               data_info=self.data_info, lazy=True)
            if hasattr(self, "greedy_runs"):  # shared greedy runs: one store per subset
                sub.greedy_runs = {}
            self._subsets[windows] = sub
        return self._subsets[windows]

    def charge(self, sub: ProbeContext, evaluations: float) -> float:
        """Add ``evaluations`` block evaluations of ``sub`` (a :meth:`subset`) to this
        context's count, in this context's units (one block over all its windows);
        returns the converted figure."""
        converted = evaluations * len(sub.input_ids) / max(len(self.input_ids), 1)
        self.extra_block_evaluations += converted
        return converted

    def boundary(self, index: int) -> list[torch.Tensor]:
        """Cached hidden state entering block ``index`` (``index = L``: last output)."""
        self.ensure_cached()
        return self.store.get(index)

    def run_stack(self, start: int, order: Sequence[int],
                  hidden: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Run blocks ``order`` (original indices) from boundary ``start``; each block
        gets its own recorded arguments. Returns the raw output of the last one."""
        h = hidden if hidden is not None else self.boundary(start)
        for b in order:
            h = self.runner.run_block(b, h, args_from=b)
        return h

    # ------------------------------------------------------------------ divergence
    def _final(self, h: torch.Tensor) -> torch.Tensor:
        norm = self.adapter.final_norm()
        return norm(h) if norm is not None else h

    @torch.no_grad()
    def _ref(self, batch: int):
        """Reference (dense) outputs of one batch: logits (or final hidden for encoders).

        Recomputed from the cached last boundary (one final norm and LM head) on a batch's
        first two uses and kept from its third use on, within :attr:`ref_cache_budget`: a
        run that measures one or two models (depth pruning, before and after its recovery)
        never holds the ``[N, T, vocab]`` logits (1.5 GiB for 32 x 256 tokens of a 49k
        vocabulary), a search that measures hundreds pays two LM head passes more."""
        if batch in self._ref_cache:
            return self._ref_cache[batch]
        h = self.boundary(self.num_blocks)[batch].to(self.runner.device)
        final = self._final(h)
        out = final if self.encoder else self.adapter.logits(final)
        size = out.numel() * out.element_size()
        self._ref_uses[batch] = self._ref_uses.get(batch, 0) + 1
        if self._ref_uses[batch] >= 3 and self._ref_bytes + size <= self.ref_cache_budget:
            self._ref_cache[batch] = out.to("cpu")
            self._ref_bytes += size
        return out

    @torch.no_grad()
    def model_divergence(self, model_lm) -> tuple[float, float]:
        """Divergence of a whole (pruned) model on the same windows: one full forward."""
        outs = []
        if getattr(model_lm, "streamer", None) is not None:  # blocks on disk: in turn
            outs = streamed_final_hidden(model_lm, torch.cat(self.runner.batches),
                                         len(self.runner.batches[0]))
        for ids in self.runner.batches if not outs else ():
            out = model_lm.adapter.base(**model_lm.adapter.model_inputs(
                ids.to(self.runner.device)))
            outs.append(out.last_hidden_state)
        return self.divergence(outs, normed=True, adapter=model_lm.adapter)

    @torch.no_grad()
    def nll(self, final_raw: list[torch.Tensor]) -> float:
        """Mean next-token NLL of a modified stack on the calibration windows."""
        total, count = 0.0, 0
        for b, h in enumerate(final_raw):
            logits = self.adapter.logits(self._final(h.to(self.runner.device)))
            ids = self.runner.batches[b].to(logits.device)
            total += float(token_nll(logits, ids).double().sum())
            count += ids[:, 1:].numel()
        return total / count

    @torch.no_grad()
    def divergence(self, final_raw: list[torch.Tensor], normed: bool = False,
                   adapter=None) -> tuple[float, float]:
        """``(last-position value, all-positions value)`` of a modified stack's raw last
        block output (``normed``: already after the final norm) against the dense model
        (see module docstring); the two means of :meth:`divergence_windows`."""
        per = self.divergence_windows(final_raw, normed=normed, adapter=adapter)
        return per.value, per.value_all_positions

    @torch.no_grad()
    def divergence_windows(self, final_raw: list[torch.Tensor], normed: bool = False,
                           adapter=None) -> WindowDivergence:
        """Per-window divergence of a modified stack (see :class:`WindowDivergence`): for
        each of the N windows, the last-position value (``1 - cos`` of the mean-pooled
        states for encoders) and the mean over the window's positions; ``value`` and
        ``value_all_positions`` are the overall means, accumulated batch by batch as
        :meth:`divergence` always has (the same floats)."""
        adapter = adapter or self.adapter
        last_sum = all_sum = 0.0
        n_rows = n_tok = 0
        last_w: list[float] = []
        all_w: list[float] = []
        for b, h in enumerate(final_raw):
            ref = self._ref(b).to(self.runner.device)
            h = h.to(self.runner.device)
            final = h if normed else self._final(h)
            if self.encoder:
                pooled = torch.cosine_similarity(ref.mean(1).double(), final.mean(1).double(),
                                                 dim=-1)
                tok = torch.cosine_similarity(ref.double(), final.double(), dim=-1)
                last_sum += float((1 - pooled).sum())
                all_sum += float((1 - tok).sum())
                last_w += (1 - pooled).tolist()
                all_w += (1 - tok).mean(1).tolist()
            else:
                logits = adapter.logits(final)
                last = kl_from_logits_float64(ref[:, -1], logits[:, -1])
                last_sum += float(last.sum())
                last_w += last.tolist()
                for r in range(h.shape[0]):  # one window at a time: [T, V] float32
                    row = float(kl_from_logits(ref[r], logits[r]).double().sum())
                    all_sum += row
                    all_w.append(row / h.shape[1])
            n_rows += h.shape[0]
            n_tok += h.shape[0] * h.shape[1]
        return WindowDivergence(last_w, all_w, last_sum / n_rows, all_sum / n_tok)

    @property
    def divergence_name(self) -> str:
        """What :meth:`divergence` measures (for reports)."""
        if self.encoder:
            return "1 - cos of mean-pooled final hidden states (encoder)"
        return "KL(p_dense || p_modified) of next-token distributions"

    def close(self) -> None:
        for sub in self._subsets.values():
            sub.close()
        self._subsets.clear()
        self.store.close()
