"""The heal loop: a short fine-tune of a pruned model that keeps its structure.

Why a loop of our own rather than ``transformers.Trainer``: (1) resume equality: the
batch of a step is a pure function of (seed, step), the learning rate a pure function of
the step, and a checkpoint holds exactly what the next step reads, so an interrupted run
resumed gives the same weights as an uninterrupted one (Trainer's resume re-seeds its
sampler and dataloader workers and skips batches, and is tied to its own checkpoint
layout); (2) masks and structure: sparse zero patterns are enforced inside the forward
and after each step, and REP-LIE / CascadeFlow change the model's shapes *during*
training (slice, merge, rebuild the LoRA and the optimizer), which Trainer's fixed
model/optimizer pair does not allow; (3) tiny budgets: a few hundred steps on two CPU
cores, no accelerate launcher, dataloader workers or logging integrations needed.

One step: the student's forward on ``batch_size`` windows (eval mode: no dropout), the
configured loss (:mod:`prunelab.train.losses`; the teacher runs under ``no_grad``),
backward, observers (REP-LIE importance, CascadeFlow gradient norms), gradient clipping,
AdamW with the scheduled learning rate, masks re-applied. Every ``eval_every`` steps the
held-out mean NLL is measured, the best state kept, a checkpoint written; after
``patience`` evaluations without improvement the run stops (never before its last prune
event). At the end the best state is restored and the LoRA merged (masked), leaving no
``peft`` module in the model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch

from prunelab import log
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.loading import LoadedModel, wrap
from prunelab.registry import to_dict
from prunelab.train import losses as L
from prunelab.train.config import HealConfig
from prunelab.train.lora import Trainables, zero_count
from prunelab.train.record import heal_record
from prunelab.train.state import (
    DataOrder,
    claim_state_dir,
    fingerprint,
    load_state,
    save_state,
)

CHECKPOINT_EVERY = 25  # steps between checkpoints when eval_every is 0


def _as_loaded(model) -> LoadedModel | None:
    if model is None or isinstance(model, LoadedModel):
        return model
    return wrap(model)


@torch.no_grad()
def eval_nll(lm, ids: torch.Tensor, batch_size: int) -> float:
    """Mean next-token NLL of ``lm`` on windows ``ids`` ``[N, T]``."""
    total, count = 0.0, 0
    for chunk in torch.as_tensor(ids).split(batch_size):
        chunk = chunk.to(lm.device)
        logits = lm.model(input_ids=chunk, use_cache=False).logits
        total += float(L.ce_loss(logits, chunk).double()) * chunk[:, 1:].numel()
        count += chunk[:, 1:].numel()
    return total / max(count, 1)


def _check_inputs(lm, teacher, train_ids, eval_ids, cfg: HealConfig) -> None:
    if lm.is_encoder:
        raise UnsupportedOperationError(f"{lm.spec} is an encoder: healing trains the LM loss")
    if cfg.needs_teacher and teacher is None:
        raise ConfigError(f"loss {cfg.loss} needs a teacher (--teacher)")
    if teacher is not None and int(teacher.model.config.vocab_size) != \
            int(lm.model.config.vocab_size):
        raise ConfigError("the teacher must share the student's vocabulary")
    for name, ids in (("training", train_ids), ("evaluation", eval_ids)):
        if ids is not None and (ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2):
            raise ConfigError(f"{name} windows must be [N, T] with N >= 1, T >= 2")
    if cfg.patience > 0 and cfg.eval_every > 0 and eval_ids is None:
        raise ConfigError("early stopping (--patience) needs evaluation data (--eval-data)")


#: ``HealConfig.prune`` name -> ``factory(run)`` of its event controller, an observer that
#: prunes while tuning (:mod:`prunelab.heal.events` registers ``rep-lie`` and
#: ``cascadeflow``). The loop itself knows no pruning method.
PRUNE_EVENTS: dict[str, Callable] = {}


class HealRun:
    """One heal run (see module docstring); built by :func:`heal`."""

    def __init__(self, lm, teacher, train_ids, eval_ids, cfg: HealConfig, out_dir,
                 operations: Sequence[dict], observers: Sequence = ()):
        self.lm, self.teacher, self.cfg = lm, teacher, cfg
        self.train_ids = torch.as_tensor(train_ids)
        self.eval_ids = None if eval_ids is None else torch.as_tensor(eval_ids)
        self.out_dir = out_dir
        self.window = self.train_ids.shape[1]
        self.total = cfg.total_steps(self.window)
        self.order = DataOrder(self.train_ids.shape[0], cfg.batch_size, cfg.seed)
        self.positions = L.kept_positions(operations, lm.adapter.num_blocks)
        self.operations = list(operations)
        self.fingerprint = fingerprint(lm, cfg, self.train_ids, self.eval_ids)
        self.zeros_before = zero_count(lm.model, lm.adapter)
        self.events: list[dict] = []
        self.observers = list(observers)
        self.pruner = None
        self.step = 0
        self.evals: list[dict] = []
        self.best: dict | None = None
        self.bad_evals = 0
        self.losses: list[float] = []
        self.seconds = 0.0
        self.resumed_from: int | None = None
        self.stopped_early = False
        self._check_hidden()

    # ---------------------------------------------------------------- set-up
    def _check_hidden(self) -> None:
        if self.teacher is None or self.cfg.weights().get("hidden", 0) <= 0:
            return
        n_s, n_t = self.lm.adapter.num_blocks, self.teacher.adapter.num_blocks
        if self.positions == list(range(n_s)) and n_s != n_t:
            raise ConfigError(f"loss hidden: the student has {n_s} blocks, the teacher {n_t}, "
                              "and no depth record says which were kept: give the student's "
                              "manifest")
        L.check_hidden(self.lm, self.teacher, self.positions)

    def start(self) -> None:
        """Resume from ``out_dir`` or start fresh (held-out NLL before training)."""
        self.pruner = self._make_pruner()
        saved = load_state(self.out_dir, self.fingerprint)
        if saved is not None:
            self._replay(saved)
        self.trainables = Trainables(self.lm, self.cfg.lora_rank, self.cfg.lora_alpha,
                                     self.cfg.full, self.cfg.train_bridges,
                                     self._lora_seed())
        self.optimizer = self._optimizer()
        for obs in self._all_observers():
            if hasattr(obs, "attach"):
                obs.attach(self)
        if saved is not None:
            self._restore(saved)
            log.info(f"prunelab: heal resumes at step {self.step} of {self.total}")
            return
        nll = self.evaluate()
        if nll is not None:
            self.evals.append({"step": 0, "nll": nll})
            if self.cfg.eval_every > 0:  # no later evaluation: the last state is the result
                self.best = {"step": 0, "nll": nll, "state": self.trainables.state()}

    def _lora_seed(self) -> int:
        return self.cfg.seed + 7919 * len(self.events)

    def _optimizer(self, old: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
        params = self.trainables.params()
        if not params:
            raise UnsupportedOperationError("nothing to train: the model has no linear peft "
                                            "can wrap (use --full)")
        opt = torch.optim.AdamW(params, lr=self.cfg.peak_lr, weight_decay=self.cfg.weight_decay)
        if old is not None:  # carry the moments of parameters that survive a change
            for p in params:
                if p in old.state:
                    opt.state[p] = old.state[p]
        return opt

    def _make_pruner(self):
        """The event controller of ``cfg.prune`` (``None`` without pruning), built by the
        factory registered under its name in :data:`PRUNE_EVENTS`."""
        name = self.cfg.prune
        if name is None:
            return None
        factory = PRUNE_EVENTS.get(name)
        if factory is None:
            raise ConfigError(f"--prune {name}: no prune-while-tuning controller is registered "
                              "under that name (import prunelab.heal to register REP-LIE and "
                              "CascadeFlow)")
        return factory(self)

    def _all_observers(self) -> list:
        return self.observers + ([self.pruner] if self.pruner is not None else [])

    # ---------------------------------------------------------------- one step
    def batch(self, step: int) -> torch.Tensor:
        return self.train_ids[self.order.indices(step)].to(self.lm.device)

    def loss(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The configured loss of one batch and its terms."""
        w = self.cfg.weights()
        hidden = w.get("hidden", 0) > 0
        pairs = L.matched_pairs(self.positions) if hidden else []
        t_logits, t_states = None, None
        if self.teacher is not None and (w.get("kd", 0) > 0 or hidden):
            with torch.no_grad(), self._capture(self.teacher, [p for _, p in pairs],
                                                hidden) as t_states:
                t_logits = self.teacher.model(input_ids=ids, use_cache=False).logits
        with self._capture(self.lm, [j for j, _ in pairs], hidden) as s_states:
            logits = self.lm.model(input_ids=ids, use_cache=False).logits
        terms = {}
        if w.get("ce", 0) > 0:
            terms["ce"] = L.ce_loss(logits, ids)
        if w.get("kd", 0) > 0:
            terms["kd"] = L.kd_loss(logits, t_logits, self.cfg.temperature)
        if hidden:
            terms["hidden"] = L.hidden_loss(s_states, t_states, pairs,
                                            self.lm.adapter.final_norm(),
                                            self.teacher.adapter.final_norm())
        total = sum(w[k] * v for k, v in terms.items())
        return total, {k: float(v.detach()) for k, v in terms.items()}

    @staticmethod
    def _capture(lm, wanted, active: bool):
        return L.capture_boundaries(lm.adapter, wanted) if active else \
            contextlib.nullcontext({})

    def train_step(self) -> float:
        ids = self.batch(self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr_at(self.step, self.total)
        self.optimizer.zero_grad(set_to_none=True)
        loss, _ = self.loss(ids)
        loss.backward()
        for obs in self._all_observers():
            if hasattr(obs, "after_backward"):
                obs.after_backward(self)
        self.trainables.optimizer_step(self.optimizer, self.cfg.max_grad_norm)
        self.step += 1
        value = float(loss.detach())
        self.losses.append(value)
        return value

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> float | None:
        if self.eval_ids is None:
            return None
        return eval_nll(self.lm, self.eval_ids, self.cfg.batch_size)

    def maybe_evaluate(self) -> bool:
        """Evaluate when due; returns True when early stopping says stop."""
        k = self.cfg.eval_every
        if k <= 0 or self.eval_ids is None:
            return False
        if self.step % k != 0 and self.step != self.total:  # the last state is a candidate
            return False
        nll = self.evaluate()
        self.evals.append({"step": self.step, "nll": nll})
        if self.best is None or nll < self.best["nll"] - self.cfg.min_delta:
            self.best = {"step": self.step, "nll": nll, "state": self.trainables.state()}
            self.bad_evals = 0
        else:
            self.bad_evals += 1
        prune_done = self.pruner is None or self.pruner.done(self)
        return self.cfg.patience > 0 and prune_done and self.bad_evals >= self.cfg.patience

    def after_event(self) -> None:
        """A prune event changed the shapes: fresh LoRA and optimizer, best state reset."""
        old = self.optimizer
        if self.cfg.full:
            self.trainables.refresh_masks()
            self.trainables.build(self._lora_seed())
        else:
            self.trainables.rebuild(self._lora_seed())
        self.optimizer = self._optimizer(old if self.cfg.full else None)
        self.best, self.bad_evals = None, 0

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self) -> None:
        if self.out_dir is None:
            return
        base = None
        if self.events:
            base = {n.replace(".base_layer.", "."): t.detach().clone()
                    for n, t in self.lm.model.state_dict().items() if "lora_" not in n}
        state = {"fingerprint": self.fingerprint, "step": self.step,
                 "trainable": self.trainables.state(),
                 "optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state(),
                 "evals": self.evals, "best": self.best, "bad_evals": self.bad_evals,
                 "losses": self.losses, "seconds": self.seconds,
                 "events": self.events,
                 "base": base, "positions": self.positions,
                 "observers": [o.state_dict() if hasattr(o, "state_dict") else None
                               for o in self._all_observers()]}
        save_state(self.out_dir, state, {"step": self.step, "total": self.total,
                                         "evals": self.evals, "events": len(self.events),
                                         "config": self.cfg.to_dict()})

    def _replay(self, saved: dict) -> None:
        """Re-apply the saved prune events to the freshly loaded student."""
        for event in saved["events"]:
            self.pruner.replay(self, event)
            self.events.append(dict(event))
        if saved.get("base") is not None:
            result = self.lm.model.load_state_dict(saved["base"], strict=False)
            if result.unexpected_keys or result.missing_keys:
                raise ConfigError("the heal checkpoint's weights do not fit the student")
        self.positions = list(saved["positions"])

    def _restore(self, saved: dict) -> None:
        self.trainables.load_state(saved["trainable"])
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["rng"])
        self.step = self.resumed_from = saved["step"]
        self.evals, self.best = saved["evals"], saved["best"]
        self.bad_evals, self.losses = saved["bad_evals"], saved["losses"]
        self.seconds = saved["seconds"]
        for obs, st in zip(self._all_observers(), saved["observers"], strict=False):
            if st is not None and hasattr(obs, "load_state_dict"):
                obs.load_state_dict(st)

    # ---------------------------------------------------------------- the loop
    def train(self, callback: Callable[[dict], bool] | None = None) -> bool:
        """Run to the end (or early stop); returns False when ``callback`` interrupted."""
        every = self.cfg.eval_every or CHECKPOINT_EVERY
        tokens_per_step = self.cfg.batch_size * self.window
        t0 = time.perf_counter()
        base_seconds = self.seconds

        def status() -> str:
            el = time.perf_counter() - t0
            rate = (self.step - start) * tokens_per_step / el if el > 0 else 0.0
            last = self.losses[-1] if self.losses else float("nan")
            return f"loss {last:.3f} {rate:,.0f} tok/s"

        start = self.step
        for _ in log.progress(range(start, self.total), total=self.total - start,
                              desc="heal", status=status):
            self.train_step()
            self.seconds = base_seconds + time.perf_counter() - t0
            if self.pruner is not None and self.pruner.due(self):
                self.events.append(self.pruner.apply(self))
                self.after_event()
            stop = self.maybe_evaluate()
            if self.step % every == 0 or stop or self.step == self.total:
                self.checkpoint()
            if stop:
                self.stopped_early = True
                break
            if callback is not None and callback({"step": self.step, "loss": self.losses[-1],
                                                  "total": self.total}):
                self.checkpoint()
                return False
        return True

    # ---------------------------------------------------------------- the end
    def close(self, keep: bool) -> None:
        """Detach the observers and merge (or drop) the LoRA: no hook or peft module left."""
        for obs in self._all_observers():
            if hasattr(obs, "detach"):
                obs.detach(self)
        if getattr(self, "trainables", None) is not None:
            self.trainables.merge(keep=keep)

    def finish(self, merge: bool, completed: bool) -> dict:
        """Restore the best state, merge (or drop) the LoRA, measure, build the record."""
        if completed and self.best is not None:
            self.trainables.load_state(self.best["state"])
        self.close(keep=merge)
        after = self.evaluate() if completed and merge else None
        return self.record(after, completed)

    def record(self, after: float | None, completed: bool) -> dict:
        return heal_record(self, after, completed)


def heal(student_lm, teacher_lm, train_ids: torch.Tensor, eval_ids: torch.Tensor | None,
         config: HealConfig | None = None, out_dir=None, manifest: dict | None = None, *,
         callback: Callable[[dict], bool] | None = None, observers: Sequence = (),
         merge: bool = True) -> tuple[LoadedModel, dict]:
    """Heal ``student_lm`` in place (see the module docstring); returns ``(lm, record)``.

    ``train_ids`` / ``eval_ids``: token windows ``[N, T]`` (used as given; ``eval_ids``
    may be ``None``: no held-out metrics, no early stopping). ``teacher_lm``: the dense
    model (``kd``, ``hidden``; may be ``None`` for ``ce``). ``out_dir``: folder of the
    resumable checkpoint (``None``: no checkpoints). ``manifest``: the student's
    ``manifest.json`` (its ``operations`` map kept blocks to their original positions and
    are kept in the model's history); default: the model's own history.
    ``callback(info) -> bool``: called after each step; ``True`` stops the run (a
    checkpoint is written; resume by calling again with a freshly loaded student).
    ``observers``: objects with ``after_backward(run)`` (and optional ``attach`` /
    ``detach`` / ``state_dict`` / ``load_state_dict``) that read the gradients.
    ``merge=False``: drop the LoRA instead of merging it (the weights stay as they were:
    probes and scores that only read the training signals).
    The record is appended to ``lm.history`` as a ``heal`` operation.
    """
    cfg = config or HealConfig()
    lm, teacher = _as_loaded(student_lm), _as_loaded(teacher_lm)
    _check_inputs(lm, teacher, torch.as_tensor(train_ids), eval_ids, cfg)
    if out_dir is not None:
        out_dir = claim_state_dir(out_dir)  # heal's own folder, or refused in one line
    operations = list((manifest or {}).get("operations") or lm.history)
    if manifest is not None and not lm.history:
        lm.history = [dict(op) for op in operations]
    was_quiet = log.is_quiet()
    log.set_quiet(was_quiet or cfg.quiet)
    run = HealRun(lm, teacher, train_ids, eval_ids, cfg, out_dir, operations, observers)
    try:
        run.start()
        completed = run.train(callback)
    except BaseException:
        run.close(keep=False)
        raise
    finally:
        log.set_quiet(was_quiet)
    record = run.finish(merge, completed)
    if merge and completed:
        lm.history.extend(run.pruner.history(run) if run.pruner is not None else [])
        lm.history.append({"operation": "heal", "method": cfg.loss, "config": to_dict(cfg),
                           "healing": {k: v for k, v in record.items() if k != "config"}})
    return lm, record
