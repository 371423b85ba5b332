"""Healing of pruned encoders (vision: DINOv2 / ViT; speech: the Whisper encoder) by
feature distillation from the dense model on unlabelled inputs.

The student is fitted to the teacher's (dense model's) final hidden states, every token
(for a ViT the CLS and the patch tokens; for Whisper the 1500 encoder frames):

* ``mse``: ``mean (h_s - h_t)^2`` over tokens and channels (the loss of
  :mod:`prunelab.train.encoder_distill`);
* ``cosine``: ``1 - mean_tokens cos(h_s, h_t)``;

plus, with ``hidden_weight > 0``, ``hidden_weight x`` the mean over matched block
boundaries of ``||h_s - h_t||^2 / ||h_t||^2`` (the stream entering kept block ``j`` of a
depth-pruned student against the stream entering the dense block at its original
position: the text ``hidden`` loss of :mod:`prunelab.train.losses`, after DistilBERT /
MiniLM-style layer matching). Feature distillation of a compressed ViT from its dense
self follows DeiT / MiniViT-style distillation (Touvron et al. 2021; Zhang et al. 2022);
the Whisper encoder version follows the leave-one-layer-out pruning study of the issue's
seed (prune, then distil the encoder on unlabelled speech; the decoder stays frozen).

What trains is the heal machinery's :class:`~prunelab.train.lora.Trainables`: LoRA on the
encoder blocks' prunable linears (merged at the end, no ``peft`` left) or, with ``full``,
every block parameter; the block count and every shape stay as they are. The teacher's
targets are computed once (inputs are a fixed tensor), batches are drawn by a seeded
permutation, the learning rate follows :meth:`HealConfig.lr_at` (warm-up, cosine), and
held-out inputs give early stopping (the best trainable state is restored at the end).
No resumable state (the runs are minutes long).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from prunelab import log
from prunelab.errors import ConfigError
from prunelab.registry import strict_kwargs, to_dict
from prunelab.train import losses as L
from prunelab.train.config import HealConfig
from prunelab.train.lora import Trainables

ENCODER_LOSSES = ("mse", "cosine")


def _help(text: str, default=None):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class EncoderHealConfig:
    """How a pruned encoder is healed (see the module docstring). The shared fields mean
    what they mean in :class:`~prunelab.heal.HealConfig` and are validated by it."""

    loss: str = _help("mse | cosine between the final hidden states", "mse")
    hidden_weight: float = _help("weight of the matched block-boundary term (0: off)", 0.0)
    lora_rank: int = _help("LoRA rank r", 8)
    lora_alpha: float = _help("LoRA alpha (scale s = alpha / r)", 16.0)
    full: bool = _help("train every block parameter instead of LoRA", False)
    train_bridges: bool = _help("train linear bridges of depth-pruned models too", False)
    steps: int = _help("optimizer steps", 100)
    lr: float | None = _help("peak learning rate (default 2e-4 LoRA, 2e-5 full)")
    warmup: float = _help("warm-up fraction of the steps", 0.05)
    final_lr_ratio: float = _help("cosine ends at this fraction of lr", 0.1)
    weight_decay: float = _help("AdamW weight decay", 0.0)
    max_grad_norm: float = _help("gradient clipping (0 = off)", 1.0)
    batch_size: int = _help("inputs (images / clips) per step", 4)
    eval_every: int = _help("held-out loss every K steps (0 = only before and after)", 25)
    patience: int = _help("stop after P evaluations without improvement (0 = never)", 3)
    min_delta: float = _help("improvement below this does not count", 0.0)
    seed: int = _help("LoRA init and batch order", 0)
    quiet: bool = _help("no progress output", False)

    def __post_init__(self):
        if self.loss not in ENCODER_LOSSES:
            raise ConfigError(f"encoder loss must be one of {', '.join(ENCODER_LOSSES)}, "
                              f"got {self.loss!r}")
        self.schedule()  # validates the shared fields (HealConfig's ranges and messages)

    def schedule(self) -> HealConfig:
        """The equivalent :class:`HealConfig` (learning rate, schedule, LoRA, early stop)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("loss",)}
        return HealConfig(loss="hidden", **shared)

    def to_dict(self) -> dict:
        return to_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EncoderHealConfig:
        strict_kwargs(cls, d, "encoder heal")
        return cls(**d)


def encoder_states(lm, x: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[B, T, d]`` of ``lm``'s encoder (after its final norm) on a
    batch of its inputs (pixels, or log-mel features through Whisper's encoder entry)."""
    dev = next(lm.model.parameters()).device
    dtype = next(lm.model.parameters()).dtype
    x = x.to(dev, dtype if x.is_floating_point() else x.dtype)
    return lm.adapter.base(**lm.adapter.model_inputs(x)).last_hidden_state


def final_loss(student: torch.Tensor, teacher: torch.Tensor, kind: str) -> torch.Tensor:
    """``mse``: mean squared difference; ``cosine``: ``1 - mean`` per-token cosine."""
    s, t = student.float(), teacher.detach().float()
    if kind == "mse":
        return F.mse_loss(s, t)
    return 1 - F.cosine_similarity(s, t, dim=-1).mean()


def _boundaries(lm, wanted, active: bool):
    return L.capture_boundaries(lm.adapter, wanted) if active else \
        contextlib.nullcontext({})


@torch.no_grad()
def teacher_targets(teacher, inputs: torch.Tensor, positions: list[int],
                    batch_size: int) -> dict:
    """``{"final": [N, T, d], p: [N, T, d] input of dense block p for p in positions}``
    (float32, on the CPU)."""
    out: dict = {"final": []}
    out.update({p: [] for p in positions})
    for chunk in inputs.split(batch_size):
        with _boundaries(teacher, positions, bool(positions)) as st:
            out["final"].append(encoder_states(teacher, chunk).float().cpu())
        for p in positions:
            out[p].append(st[p].float().cpu())
    return {k: torch.cat(v) for k, v in out.items()}


class EncoderHealRun:
    """One encoder heal run (see the module docstring); built by :func:`heal_encoder`."""

    def __init__(self, lm, teacher, train_inputs, eval_inputs, cfg: EncoderHealConfig,
                 positions: list[int]):
        self.lm, self.cfg, self.sched = lm, cfg, cfg.schedule()
        self.train_inputs, self.eval_inputs = train_inputs, eval_inputs
        self.pairs = L.matched_pairs(positions) if cfg.hidden_weight > 0 else []
        wanted = [p for _, p in self.pairs]
        self.targets = teacher_targets(teacher, train_inputs, wanted, cfg.batch_size)
        self.eval_targets = None if eval_inputs is None else \
            teacher_targets(teacher, eval_inputs, wanted, cfg.batch_size)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.order: list[int] = []
        self.step, self.evals, self.losses = 0, [], []
        self.best, self.bad_evals, self.stopped_early = None, 0, False
        self.seconds = 0.0
        self.trainables = Trainables(lm, cfg.lora_rank, cfg.lora_alpha, cfg.full,
                                     cfg.train_bridges, cfg.seed)
        params = self.trainables.params()
        if not params:
            raise ConfigError("nothing to train: the encoder has no linear peft can wrap "
                              "(use --full)")
        self.optimizer = torch.optim.AdamW(params, lr=self.sched.peak_lr,
                                           weight_decay=cfg.weight_decay)

    # ---------------------------------------------------------------- loss
    def loss(self, x: torch.Tensor, targets: dict, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, final states)`` of inputs ``x`` against ``targets`` rows ``idx``."""
        with _boundaries(self.lm, [j for j, _ in self.pairs], bool(self.pairs)) as st:
            out = encoder_states(self.lm, x)
        dev = out.device
        total = final_loss(out, targets["final"][idx].to(dev), self.cfg.loss)
        if self.pairs:
            hid = torch.stack([L._nmse(st[j], targets[p][idx].to(dev)) for j, p in self.pairs])
            total = total + self.cfg.hidden_weight * hid.mean()
        return total, out

    def batch(self) -> torch.Tensor:
        """Indices of the next batch: a seeded permutation, refilled when used up."""
        n, b = len(self.train_inputs), min(self.cfg.batch_size, len(self.train_inputs))
        if len(self.order) < b:
            self.order += torch.randperm(n, generator=self.gen).tolist()
        idx, self.order = self.order[:b], self.order[b:]
        return torch.tensor(idx)

    def train_step(self) -> float:
        idx = self.batch()
        for g in self.optimizer.param_groups:
            g["lr"] = self.sched.lr_at(self.step, self.cfg.steps)
        self.optimizer.zero_grad(set_to_none=True)
        loss, _ = self.loss(self.train_inputs[idx], self.targets, idx)
        loss.backward()
        self.trainables.optimizer_step(self.optimizer, self.cfg.max_grad_norm)
        self.step += 1
        self.losses.append(float(loss.detach()))
        return self.losses[-1]

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, inputs=None, targets=None) -> dict | None:
        """Held-out ``loss`` (the training loss), ``mse`` and ``token_cosine`` of the final
        states, ``pooled_cosine`` (mean over tokens, vision: patch tokens) and for vision
        ``cls_cosine``; averaged over inputs."""
        inputs = self.eval_inputs if inputs is None else inputs
        targets = self.eval_targets if targets is None else targets
        if inputs is None:
            return None
        vision = self.lm.adapter.is_vision
        sums: dict = {}
        for start in range(0, len(inputs), self.cfg.batch_size):
            idx = torch.arange(start, min(start + self.cfg.batch_size, len(inputs)))
            total, out = self.loss(inputs[idx], targets, idx)
            out = out.float().cpu()
            ref = targets["final"][idx]
            row = {"loss": float(total), "mse": float(F.mse_loss(out, ref)),
                   "token_cosine": float(F.cosine_similarity(out, ref, dim=-1).mean())}
            pool = slice(1, None) if vision else slice(None)
            row["pooled_cosine"] = float(F.cosine_similarity(
                out[:, pool].mean(1), ref[:, pool].mean(1), dim=-1).mean())
            if vision:
                row["cls_cosine"] = float(F.cosine_similarity(out[:, 0], ref[:, 0],
                                                              dim=-1).mean())
            for k, v in row.items():
                sums[k] = sums.get(k, 0.0) + v * len(idx)
        return {k: v / len(inputs) for k, v in sums.items()}

    def maybe_evaluate(self) -> bool:
        """Evaluate when due; True when early stopping says stop."""
        k = self.cfg.eval_every
        if k <= 0 or self.step % k != 0 or self.eval_inputs is None:
            return False
        self._record_eval()
        return self.cfg.patience > 0 and self.bad_evals >= self.cfg.patience

    def _record_eval(self) -> None:
        m = self.evaluate()
        self.evals.append({"step": self.step, **m})
        if self.cfg.eval_every <= 0:  # before / after only: the last state is kept
            return
        if self.best is None or m["loss"] < self.best["loss"] - self.cfg.min_delta:
            self.best = {"step": self.step, "loss": m["loss"],
                         "state": self.trainables.state()}
            self.bad_evals = 0
        else:
            self.bad_evals += 1

    # ---------------------------------------------------------------- the loop
    def train(self) -> None:
        if self.eval_inputs is not None:
            self._record_eval()
        t0 = time.perf_counter()

        def status() -> str:
            return f"loss {self.losses[-1]:.5f}" if self.losses else ""
        for _ in log.progress(range(self.cfg.steps), total=self.cfg.steps,
                              desc="heal encoder", status=status):
            self.train_step()
            if self.maybe_evaluate():
                self.stopped_early = True
                break
        k = self.cfg.eval_every
        if k > 0 and self.eval_inputs is not None and self.step % k != 0:
            self._record_eval()  # the last state competes for the best one too
        self.seconds = time.perf_counter() - t0

    def finish(self) -> dict:
        """Restore the best state, merge the LoRA, measure, build the record."""
        if self.best is not None:
            self.trainables.load_state(self.best["state"])
        self.trainables.merge(keep=True)
        after = self.evaluate()
        return {
            "modality": "vision" if self.lm.adapter.is_vision else "speech",
            "loss": self.cfg.loss, "hidden_weight": self.cfg.hidden_weight,
            "boundaries": [list(p) for p in self.pairs],
            "mode": "full" if self.cfg.full else "lora",
            "lora_rank": None if self.cfg.full else self.cfg.lora_rank,
            "steps": self.step, "planned_steps": self.cfg.steps,
            "batch_size": self.cfg.batch_size, "train_inputs": len(self.train_inputs),
            "eval_inputs": None if self.eval_inputs is None else len(self.eval_inputs),
            "lr_schedule": {"peak": self.sched.peak_lr,
                            "warmup_steps": round(self.cfg.warmup * self.cfg.steps),
                            "schedule": "linear warm-up, cosine decay",
                            "final": self.sched.peak_lr * self.cfg.final_lr_ratio},
            "held_out": {"before": self.evals[0] if self.evals else None, "after": after,
                         "history": self.evals},
            "best_step": self.best["step"] if self.best else self.step,
            "early_stopped": self.stopped_early,
            "train_loss_first": self.losses[0] if self.losses else None,
            "train_loss_last": self.losses[-1] if self.losses else None,
            "wall_seconds": self.seconds, "num_blocks": self.lm.adapter.num_blocks,
            "not_adapted": self.trainables.skipped, "config": self.cfg.to_dict(),
        }


def check_pair(lm, teacher, positions: list[int], cfg: EncoderHealConfig) -> None:
    """Refuse a student / teacher pair the distillation cannot use."""
    if teacher is None:
        raise ConfigError("healing an encoder distils it from the dense model: give "
                          "--teacher")
    if lm.adapter.family != teacher.adapter.family:
        raise ConfigError(f"the teacher ({teacher.adapter.family}) is not of the student's "
                          f"family ({lm.adapter.family})")
    if lm.adapter.hidden_size() != teacher.adapter.hidden_size():
        raise ConfigError("the student's and the teacher's hidden sizes differ")
    if cfg.hidden_weight > 0:
        n_s, n_t = lm.adapter.num_blocks, teacher.adapter.num_blocks
        if positions == list(range(n_s)) and n_s != n_t:
            raise ConfigError(f"--hidden-weight: the student has {n_s} blocks, the teacher "
                              f"{n_t}, and no depth record says which were kept")
        L.check_hidden(lm, teacher, positions)


def heal_encoder(student_lm, teacher_lm, train_inputs: torch.Tensor,
                 eval_inputs: torch.Tensor | None, config: EncoderHealConfig | None = None,
                 manifest: dict | None = None):
    """Heal a pruned encoder in place by distillation from ``teacher_lm`` (see the module
    docstring); ``train_inputs`` / ``eval_inputs``: pixels ``[N, 3, H, W]`` or log-mel
    features ``[N, mel, 3000]``. Returns ``(lm, record)``; the record is also appended to
    ``lm.history`` as a ``heal`` operation. ``manifest``: the student's manifest (its
    depth records map kept blocks to their original positions)."""
    cfg = config or EncoderHealConfig()
    lm, teacher = student_lm, teacher_lm
    operations = list((manifest or {}).get("operations") or lm.history)
    if manifest is not None and not lm.history:
        lm.history = [dict(op) for op in operations]
    positions = L.kept_positions(operations, lm.adapter.num_blocks)
    check_pair(lm, teacher, positions, cfg)
    if cfg.patience > 0 and cfg.eval_every > 0 and eval_inputs is None:
        raise ConfigError("early stopping (--patience) needs held-out data (--eval-data)")
    was_quiet = log.is_quiet()
    log.set_quiet(was_quiet or cfg.quiet)
    teacher.model.eval()
    lm.model.eval()  # no dropout; gradients still flow
    run = None
    try:
        run = EncoderHealRun(lm, teacher, train_inputs, eval_inputs, cfg, positions)
        run.train()
    except BaseException:
        if run is not None:
            run.trainables.merge(keep=False)
        raise
    finally:
        log.set_quiet(was_quiet)
    record = run.finish()
    lm.history.append({"operation": "heal", "method": f"distill-{cfg.loss}",
                       "config": cfg.to_dict(),
                       "healing": {k: v for k, v in record.items() if k != "config"}})
    return lm, record
