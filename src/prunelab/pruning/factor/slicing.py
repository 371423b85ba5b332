"""Residual-stream slicing: SliceGPT with a rotation per boundary, or one global rotation.

SliceGPT (Ashkboos et al., "SliceGPT: Compress Large Language Models by Deleting Rows and
Columns", ICLR 2024): with the norms folded (:mod:`.folding`), the residual stream can be
rotated by any orthogonal ``Q`` without changing the model (readers ``W Q``, writers
``Q^T W``; the RMS norm is rotation invariant). Keeping only the first ``d'`` columns of
``Q`` (the principal directions of the stream's ``C = sum X^T X``, float64 ``eigh``,
damped by ``damping`` x the mean diagonal) slices the hidden size to ``d'``. Each norm then
sees ``d'`` channels; its constant weight ``sqrt(d / d')`` makes Hugging Face's mean over
``d'`` reproduce the original mean over ``d``.

``rotation="per-layer"`` (SliceGPT proper): block by block on the already-sliced model, one
``Q`` at each boundary (attention input, MLP input, final norm), computed in the original
coordinates of that boundary; the residual skipping a branch is mapped by
``Q_prev[:, :d']^T Q_next[:, :d']`` (a :class:`~.shortcuts.ResidualShortcut`, so the
checkpoint needs remote code). Until its next boundary is known, a branch writes in
original coordinates; the model meanwhile keeps its full width with the dropped
directions zeroed, and is cut to ``d'`` at the end.

``rotation="global"``: one ``Q`` from the summed covariances of every boundary of the
dense model (each divided by its trace unless ``global_weights="raw"``: every boundary
reads the stream through a norm, so what matters is the share of its own energy a slice
loses); no shortcut maps. For llama, mistral, qwen2, qwen3, phi3 and gemma the result is
an ordinary checkpoint of the same family with ``hidden_size = d'``; Gemma 2/3 norm the
branch outputs before the residual add, so their writers cannot be rotated and a map after
each post-norm (remote code) does it.

``widths="spectrum"`` / ``"energy"`` / ``"kl"`` (per-layer only) give every block its own
width: by the energy share per parameter under the same parameter budget as the uniform
slice, or by a fixed energy share per block (:mod:`.widths`), or by measured per-block
output-KL curves under that budget (:mod:`.width_kl`).

``basis="sensitivity"`` picks each kept subspace from the activation covariance and the
Fisher of the model output at the same boundary (computed on the dense model) through
:func:`prunelab.pruning.factor.subspace.sensitivity_basis`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.calib.stats import Gram
from prunelab.errors import ConfigError
from prunelab.log import info, warn
from prunelab.models.custom import install
from prunelab.models.size import model_size
from prunelab.pruning.base import METHODS
from prunelab.pruning.factor import fisher as fisher_mod
from prunelab.pruning.factor import widths as W
from prunelab.pruning.factor.config import FactorConfig
from prunelab.pruning.factor.folding import (
    POST_NORM_TYPES,
    base_type,
    check_sliceable,
    cut_inputs,
    cut_outputs,
    fold_norms,
    head_is_tied,
    norm_scale,
    rescale_embedding,
    rotate_inputs,
    rotate_outputs,
    set_norm_scale,
    set_norm_vector,
    stream_boundaries,
    stream_branches,
)
from prunelab.pruning.factor.select import select_basis
from prunelab.pruning.factor.shortcuts import ResidualShortcut
from prunelab.pruning.factor.subspace import pca_basis, sensitivity_basis
from prunelab.pruning.factor.width_kl import allocate_by_kl
from prunelab.pruning.factor.widths import (
    block_of,
    boundary_width,
    params_for_widths,
    record_shapes,
)
from prunelab.registry import check_range

ROTATIONS = ("per-layer", "global")
BASES = ("pca", "sensitivity")
WIDTHS = ("uniform", "spectrum", "energy", "kl")
SHORTCUT_ATTR = "prunelab_shortcut"

__all__ = ["SliceGPT", "stream_boundaries", "pca_basis", "width_for_ratio", "params_at",
           "config_refuses"]


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@METHODS.register("slicegpt")
@dataclass(frozen=True)
class SliceGPT(FactorConfig):
    """Residual-stream slicing (SliceGPT, Ashkboos et al. 2024); see the module docstring.

    ``target_params``, when given, decides ``d'`` (the largest multiple of ``multiple``
    whose model keeps at most that fraction of the parameters); ``ratio`` (default 0.25)
    otherwise. Giving both is an error. A ratio whose sliced model would store at least
    as many parameters as the dense one (``ratio`` 0, or so small that the shortcut maps
    outweigh what slicing removes) is refused before any calibration.
    """

    rotation: str = field(default="per-layer", metadata=_help(
        "per-layer: one rotation per boundary with shortcut maps (remote code); global: one "
        "rotation for the whole stream (a plain checkpoint where the family allows)"))
    ratio: float | None = field(default=None, metadata=_help(
        "fraction of the hidden size removed (d' rounded to a multiple of --multiple); "
        "default 0.25", budget="remove-hidden"))
    multiple: int = field(default=8, metadata=_help("the kept hidden size is a multiple of this"))
    basis: str = field(default="pca", metadata=_help(
        "pca: keep the stream's principal directions; sensitivity: weight them by the "
        "Fisher of the model output at each boundary"))
    damping: float = field(default=0.01, metadata=_help(
        "added to the covariance's diagonal, times its mean diagonal"))
    fisher_samples: int = field(default=1, metadata=_help(
        "sensitivity: labels drawn per window for the output Fisher"))
    fisher_damping: float = field(default=0.01, metadata=_help(
        "sensitivity: Fisher damping, times its mean diagonal"))
    refine_steps: int = field(default=30, metadata=_help(
        "sensitivity: Grassmann refinement steps per boundary (0: the spectral candidate, "
        "or PCA when that is better on the proxy)"))
    seed: int = field(default=0, metadata=_help("sensitivity: label sampling seed"))
    select: str = field(default="kl", metadata=_help(
        "sensitivity: kl (slice with PCA and with the Fisher basis at each damping of "
        "--select-grid, keep the lowest measured calibration KL) or proxy (one basis per "
        "boundary by the second-order proxy)"))
    select_grid: str = field(default="0.01,0.3,3", metadata=_help(
        "sensitivity, select kl: Fisher dampings tried (times its mean diagonal; large = "
        "closer to PCA); PCA is always a candidate"))
    select_windows: int = field(default=8, metadata=_help(
        "sensitivity, select kl: calibration windows the KL is measured on (0 = all)"))
    widths: str = field(default="uniform", metadata=_help(
        "per-layer: uniform (one d'), spectrum (per-block widths by energy share per "
        "parameter, same budget), energy (per block the fewest directions holding "
        "--energy of its spectrum) or kl (per-block widths from measured output-KL curves, "
        "same budget)"))
    width_levels: int = field(default=6, metadata=_help(
        "widths=kl: widths measured per block (from just under d down to 2 d' - d)"))
    width_windows: int = field(default=2, metadata=_help(
        "widths=kl: calibration windows the KL curves are measured on (0 = all)"))
    energy: float = field(default=0.95, metadata=_help(
        "widths=energy: share of each block's stream energy kept"))
    global_weights: str = field(default="trace", metadata=_help(
        "rotation global: trace (each boundary's covariance divided by its trace, so every "
        "boundary's relative energy counts alike: the norms see relative errors) or raw "
        "(summed as they are: large-norm boundaries dominate)"))
    keep_tied: bool = field(default=False, metadata=_help(
        "rotation global: an output head tied to the embeddings stays tied (one tensor "
        "stored, not two); the final norm keeps a per-channel scale, in a kept basis turned "
        "so that the scale is exact up to the sliced directions"))
    gguf_only: bool = field(default=False, metadata=_help(
        "allow a hidden size the model's transformers config refuses (SmolLM2's 512 with 9 "
        "heads of 64: Llama's config wants the hidden size a multiple of the head count, "
        "llama.cpp does not); such a model is written to GGUF from memory (prunelab front) "
        "and cannot be saved as a checkpoint"))

    history_keys: ClassVar[tuple] = ("d", "d_kept", "rotation", "basis", "path",
                                     "block_widths")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rotation not in ROTATIONS:
            raise ConfigError(f"rotation must be one of {', '.join(ROTATIONS)}, "
                              f"got {self.rotation!r}")
        if self.basis not in BASES:
            raise ConfigError(f"basis must be one of {', '.join(BASES)}, got {self.basis!r}")
        if self.ratio is not None and self.target_params is not None:
            raise ConfigError("give ratio (--budget remove-hidden:F) or target_params "
                              "(--budget keep-params:F), not both")
        if self.ratio is None and self.target_params is None:
            object.__setattr__(self, "ratio", 0.25)
        if self.ratio is not None:
            check_range("ratio", self.ratio, 0.0, 0.99)  # 0: refused by precheck (larger)
        check_range("multiple", self.multiple, 1, None, integer=True)
        check_range("damping", self.damping, 0.0, 1.0)
        check_range("fisher_samples", self.fisher_samples, 1, None, integer=True)
        check_range("fisher_damping", self.fisher_damping, 0.0, 1e3)
        check_range("refine_steps", self.refine_steps, 0, None, integer=True)
        check_range("seed", self.seed, 0, None, integer=True)
        if self.select not in ("kl", "proxy"):
            raise ConfigError(f"select must be kl or proxy, got {self.select!r}")
        check_range("select_windows", self.select_windows, 0, None, integer=True)
        try:
            grid = [float(x) for x in self.select_grid.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"select_grid: not a list of numbers: {self.select_grid!r}") \
                from None
        for mu in grid:
            check_range("select_grid", mu, 0.0, 1e3)
        if self.widths not in WIDTHS:
            raise ConfigError(f"widths must be one of {', '.join(WIDTHS)}, "
                              f"got {self.widths!r}")
        check_range("energy", self.energy, 0.0, 1.0)
        check_range("width_levels", self.width_levels, 1, None, integer=True)
        check_range("width_windows", self.width_windows, 0, None, integer=True)
        if self.energy == 0:
            raise ConfigError("energy must be > 0 (a share of each block's stream energy)")
        if self.widths != "uniform" and self.rotation != "per-layer":
            raise ConfigError(f"widths={self.widths} needs rotation per-layer (one global "
                              "rotation has one width)")
        if self.global_weights not in ("trace", "raw"):
            raise ConfigError(f"global_weights must be trace or raw, got "
                              f"{self.global_weights!r}")
        if self.keep_tied and self.rotation != "global":
            raise ConfigError("keep_tied needs rotation global (per-layer rotations give the "
                              "embeddings and the head different bases)")
        if self.widths == "energy" and self.target_params is not None:
            raise ConfigError("widths=energy sets the widths from --energy; drop "
                              "target_params (or use widths=spectrum)")

    def precheck(self, lm) -> None:
        check_sliceable(lm)
        if self.keep_tied and getattr(lm.adapter.embeddings(), "embed_scale", None) is not None:
            raise ConfigError("keep_tied: this model scales its embeddings (Gemma), which a "
                              "tied head would scale too; slice without keep_tied")
        d = lm.adapter.hidden_size()
        if self.multiple > d:
            raise ConfigError(f"multiple {self.multiple} exceeds the hidden size {d}")
        width = choose_width(self, lm)  # an unreachable target_params fails before any data
        if self.target_params is None and self.widths == "uniform":
            dense = model_size(lm.model)["params"]
            sliced = params_at(lm, width, self.rotation, self.keep_tied)
            what = (f"ratio {self.ratio} keeps d'={width} of {d}: the sliced model would "
                    f"store {sliced:,} parameters, not fewer than the dense {dense:,} "
                    f"(rotation {self.rotation})")
            if sliced >= dense and width == d:  # nothing sliced: only larger
                raise ConfigError(f"{what}; remove more of the hidden size")
            if sliced >= dense:  # a narrower stream, but the maps outweigh it (small models)
                warn(what)

    def apply(self, lm, input_ids, *, batch_size: int) -> dict:
        if self.basis == "sensitivity" and self.select == "kl":
            return select_basis(lm, self, input_ids, batch_size=batch_size, slicer=slice_stream,
                                fishers=_fishers(self, lm, input_ids, batch_size))
        return slice_stream(lm, self, input_ids, batch_size=batch_size)


# ---------------------------------------------------------------------- budget
def width_for_ratio(d: int, ratio: float, multiple: int) -> int:
    """``d'`` for removing ``ratio`` of ``d``: rounded to a multiple of ``multiple``
    (``d`` itself when ``ratio`` is 0), at least ``multiple``."""
    if ratio == 0:
        return d
    w = int(round((1.0 - ratio) * d / multiple)) * multiple
    return min(max(w, multiple), d)


def params_at(lm, width: int, rotation: str, keep_tied: bool = False) -> int:
    """Parameters the sliced model will store at hidden size ``width`` (the head untied
    unless ``keep_tied``, shortcut maps and Gemma 2/3's post-norm maps counted), from the
    current shapes."""
    return params_for_widths(lm, [width] * (lm.adapter.num_blocks + 1), rotation,
                             keep_tied=keep_tied)


def choose_width(cfg: SliceGPT, lm) -> int:
    """The kept hidden size: from ``ratio``, or the largest multiple of ``multiple`` that
    keeps at most ``target_params`` of the parameters (they grow with the width)."""
    d = lm.adapter.hidden_size()
    widths = range(d - d % cfg.multiple, 0, -cfg.multiple)
    valid = [w for w in widths if cfg.gguf_only or not config_refuses(lm, w)]
    if not valid:
        raise ConfigError(f"slicegpt: no hidden size that is a multiple of {cfg.multiple} "
                          f"below {d} is accepted by {type(lm.model.config).__name__} ("
                          f"{config_refuses(lm, widths[0] if widths else d)}); change "
                          "--multiple")
    if cfg.target_params is None:
        width = width_for_ratio(d, cfg.ratio, cfg.multiple)
        if width == d or width in valid:
            return width
        near = min(valid, key=lambda w: (abs(w - width), w))
        key = (id(lm), width, near)
        if key not in _WARNED:  # precheck and the slicing both choose the width
            _WARNED.add(key)
            warn(f"slicegpt: hidden size {width} cannot be a {type(lm.model.config).__name__} "
                 f"({config_refuses(lm, width)}); slicing to the nearest one that can, "
                 f"{near} (removes {1 - near / d:.1%} of {d})")
        return near
    limit = cfg.target_params * model_size(lm.model)["params"]
    for w in valid:
        if params_at(lm, w, cfg.rotation, cfg.keep_tied) <= limit:
            return w
    low = params_at(lm, valid[-1], cfg.rotation, cfg.keep_tied) / model_size(lm.model)["params"]
    raise ConfigError(f"target_params {cfg.target_params} is below what slicing reaches "
                      f"({low:.4f} at d'={valid[-1]})")


_WARNED: set = set()


def config_refuses(lm, width: int) -> str:
    """Why the model's transformers config refuses hidden size ``width`` (e.g. Llama's
    ``hidden_size % num_attention_heads == 0``); empty when it accepts it. Checked before
    any calibration: the sliced checkpoint's config must hold the width."""
    cfg = copy.deepcopy(lm.model.config)
    validate = getattr(cfg, "validate", None)
    if not callable(validate):
        return ""
    cfg.hidden_size = width
    try:
        validate()
    except Exception as exc:  # noqa: BLE001 - any refusal: the width cannot be a config
        text = str(exc.__cause__ or exc).strip().splitlines()
        return text[-1].strip().rstrip(".") if text else type(exc).__name__
    return ""


# ---------------------------------------------------------------------- bases
def _damp(cfg: SliceGPT, cov: torch.Tensor) -> torch.Tensor:
    cov = cov.double()
    return cov + cfg.damping * cov.diagonal().mean() * torch.eye(
        cov.shape[0], dtype=cov.dtype, device=cov.device)


def _basis(cfg: SliceGPT, cov, fisher, width: int) -> torch.Tensor:
    """The rotation at a boundary (``cov``, ``fisher``: matrices, or lists of them for one
    global rotation over several boundaries); ``width`` columns are kept."""
    if cfg.basis == "sensitivity":
        covs = [_damp(cfg, c) for c in cov] if isinstance(cov, list) else _damp(cfg, cov)
        fishers = [f.double() for f in fisher] if isinstance(fisher, list) else fisher.double()
        q, _ = sensitivity_basis(covs, fishers, cfg.fisher_damping, k=width,
                                 steps=cfg.refine_steps)
        return q.double()
    return pca_basis(_damp(cfg, sum(cov) if isinstance(cov, list) else cov))[0].double()


def _energy(cov: torch.Tensor, r: torch.Tensor) -> float:
    """Share of ``trace(cov)`` the columns of ``r`` keep."""
    cov = cov.double()
    kept = ((cov @ r.to(cov)) * r.to(cov)).sum()
    return float(kept / cov.trace().clamp_min(1e-300))


def _gram(states) -> torch.Tensor:
    g = None
    for x in states:
        x = x.reshape(-1, x.shape[-1]).double()
        g = x.t() @ x if g is None else g.addmm_(x.t(), x)
    return g


def _fishers(cfg: SliceGPT, lm, input_ids, batch_size: int) -> list | None:
    if cfg.basis != "sensitivity":
        return None
    return fisher_mod.output_fisher(lm, input_ids, stream_boundaries(lm), batch_size=batch_size,
                                    samples=cfg.fisher_samples, seed=cfg.seed)


# ---------------------------------------------------------------------- slicing
def slice_stream(lm, cfg: SliceGPT, input_ids, *, batch_size: int,
                 fishers: list | None = None, preset: dict | None = None) -> dict:
    """Slice ``lm``'s residual stream in place (see the module docstring); the report.
    ``fishers``: the boundaries' output Fisher matrices when already computed; ``preset``:
    a previous report of the same model and config whose per-block widths (and KL curves)
    are reused (the allocations read the dense PCA spectra / curves, not the basis)."""
    d = lm.adapter.hidden_size()
    width = choose_width(cfg, lm)
    budget = params_at(lm, width, cfg.rotation)
    tied = cfg.keep_tied and cfg.rotation == "global" and head_is_tied(lm)
    refused = config_refuses(lm, width) if cfg.gguf_only else ""
    fold_norms(lm, keep_final=tied)
    final_scale = None
    if fishers is None:
        fishers = _fishers(cfg, lm, input_ids, batch_size)
    extra: dict = {}
    if cfg.rotation == "per-layer" and preset is not None and cfg.widths != "uniform":
        widths = list(preset["block_widths"])
        extra.update({k: preset[k] for k in ("width_kl_curves",) if k in preset})
        energies = _per_layer(cfg, lm, input_ids, batch_size, widths, fishers)
    elif cfg.rotation == "per-layer":
        widths = _block_widths(cfg, lm, input_ids, batch_size, width, budget, extra=extra)
        energies = _per_layer(cfg, lm, input_ids, batch_size, widths, fishers)
    else:
        widths = [width] * (lm.adapter.num_blocks + 1)
        energies, final_scale = _global(cfg, lm, input_ids, batch_size, width, fishers,
                                        tied=tied)
    _finish(lm, d, widths, final_scale)
    width = widths[0]
    mt = base_type(lm.model)
    if len(set(widths)) > 1:
        path, note = "remote code", (f"per-block widths {min(widths)}..{max(widths)} "
                                     "(shortcut maps and shapes: remote code)")
    elif cfg.rotation == "per-layer":
        path, note = "remote code", "per-layer rotations need shortcut maps (remote code)"
    elif mt in POST_NORM_TYPES:
        path, note = "remote code", (f"{mt} norms the branch outputs before the residual "
                                     "add: their rotation is a map after each post-norm "
                                     "(remote code)")
    else:
        path, note = "plain", f"an ordinary {mt} checkpoint with hidden_size {width}"
    if tied:
        note += "; the head stays tied to the embeddings"
    if refused:
        lm.model.prunelab_gguf_only = (
            f"its hidden size {width} is refused by {type(lm.model.config).__name__} "
            f"({refused})")
        path, note = "gguf", f"GGUF only: {lm.model.prunelab_gguf_only}"
    info(f"slicegpt: hidden size {d} -> {width}; {note}")
    return {"d": d, "d_kept": width, "rotation": cfg.rotation, "basis": cfg.basis,
            "tied_head": head_is_tied(lm),
            "widths": cfg.widths, "block_widths": widths, "path": path, "path_note": note,
            "kept_energy": energies, "min_kept_energy": min(energies), **extra}


def _block_widths(cfg, lm, input_ids, batch_size: int, width: int, budget: int, *,
                  extra: dict | None = None) -> list[int]:
    """Per-block widths (``L + 1``: the blocks, then the final norm / head); ``extra``
    receives ``width_kl_curves`` with ``widths="kl"``."""
    n = lm.adapter.num_blocks + 1
    if cfg.widths == "uniform":
        return [width] * n
    grams = boundary_grams(lm, input_ids, batch_size)
    if cfg.widths == "kl":
        try:
            widths, curves = allocate_by_kl(
                lm, grams, input_ids, uniform=width, budget=budget, multiple=cfg.multiple,
                levels=cfg.width_levels, windows=cfg.width_windows, damping=cfg.damping,
                rotation=cfg.rotation, batch_size=batch_size)
        except ValueError as e:
            raise ConfigError(f"slicegpt widths=kl: {e}") from None
        if extra is not None:
            extra["width_kl_curves"] = curves
        return widths
    spectra = W.block_spectra(grams)
    if cfg.widths == "energy":
        return W.allocate_for_energy(spectra, cfg.energy, cfg.multiple)
    return W.allocate_for_budget(lm, spectra, budget, cfg.multiple, cfg.rotation)


def _zeroed(q: torch.Tensor, width: int) -> torch.Tensor:
    """``q`` with the columns from ``width`` on zeroed (a slice that keeps the width)."""
    r = q.clone()
    r[:, width:] = 0
    return r


def _per_layer(cfg, lm, input_ids, batch_size: int, widths: list[int], fishers
               ) -> list[float]:
    """SliceGPT block by block (full width, dropped directions zeroed; block ``i`` keeps
    ``widths[i]``, the final boundary ``widths[-1]``); the kept energy at every boundary."""
    branches = stream_branches(lm)
    d = lm.adapter.hidden_size()
    names = {id(m): n for n, m in lm.model.named_modules()}
    mods = []
    for k, br in enumerate(branches):
        ref = br.writer.weight
        post = br.post_norm is not None
        gin, gout = block_of(k, len(branches))
        layer = names[id(lm.adapter.block(br.block))] if widths[gin] != widths[gout] else ""
        mod = ResidualShortcut(names[id(br.norm)], d, d, d if post else 0,
                               writer=names[id(br.writer)] if post else "", layer=layer)
        mods.append(install(lm.model, f"{names[id(br.owner)]}.{SHORTCUT_ATTR}",
                            mod.to(ref.device, ref.dtype)))
    energies: list[float] = []

    def boundary(k: int, cov: torch.Tensor) -> torch.Tensor:
        width = boundary_width(widths, k)
        q = _basis(cfg, cov, fishers[k] if fishers else None, width)
        r = _zeroed(q, width)
        energies.append(_energy(cov, q[:, :width]))
        if k == 0:
            rotate_inputs(lm.adapter.embeddings(), r)
        else:
            _write_into(branches[k - 1], mods[k - 1], r)
        if k < len(branches):
            for reader in branches[k].readers:
                rotate_inputs(reader, r)
            mods[k].set_maps(shortcut=r.t())  # to original coordinates until the next Q
        else:
            rotate_inputs(lm.adapter.head(), r)
        return r

    runner = BlockRunner(lm, input_ids, batch_size=batch_size)

    def on_block(i: int, hidden: list) -> list:
        r = boundary(2 * i, _gram(hidden))
        rotated = [(x.double() @ r.to(x.device)).to(x.dtype) for x in hidden]
        accs = runner.collect(i, rotated, {"mlp_in": branches[2 * i + 1].norm},
                              make=lambda _name: Gram())
        boundary(2 * i + 1, accs["mlp_in"][0].xtx)
        return runner.run_block(i, rotated)

    out = runner.run(on_block, desc="slicegpt")
    boundary(len(branches), _gram(out))
    return energies


def _write_into(br, mod: ResidualShortcut, r: torch.Tensor) -> None:
    """The branch ``br`` (and its shortcut) now write into the coordinates ``r``."""
    if br.post_norm is None:
        rotate_outputs(br.writer, r)
    else:
        mod.set_maps(out_map=mod.out_map.detach().double() @ r.to(mod.out_map.device))
    if mod.shortcut is not None:
        mod.set_maps(shortcut=mod.shortcut.detach().double() @ r.to(mod.shortcut.device))


def boundary_grams(lm, input_ids, batch_size: int) -> list[torch.Tensor]:
    """``sum X^T X`` (float64) of the stream at every boundary of the current model."""
    branches = stream_branches(lm)
    runner = BlockRunner(lm, input_ids, batch_size=batch_size)
    grams: list[torch.Tensor] = []

    def on_block(i: int, hidden: list) -> None:
        grams.append(_gram(hidden))
        accs = runner.collect(i, hidden, {"mlp_in": branches[2 * i + 1].norm},
                              make=lambda _name: Gram())
        grams.append(accs["mlp_in"][0].xtx)

    out = runner.run(on_block, desc="slicegpt covariances")
    grams.append(_gram(out))
    return grams


def _global(cfg, lm, input_ids, batch_size: int, width: int, fishers, *,
            tied: bool = False) -> tuple[list[float], torch.Tensor | None]:
    """One rotation for every boundary, cut to ``width`` at once; the kept energies and,
    with ``tied``, the final norm's new per-channel scale.

    ``tied`` (the final norm's scale ``s`` not folded, the head sharing the embeddings'
    tensor ``E``): the logits ``n(x) diag(s) E^T`` become ``n(x r) r^T diag(s) r (E r)^T``
    up to the sliced directions, and any basis of the kept subspace slices alike, so the
    kept basis is turned to the eigenvectors of ``r^T diag(s) r``: the final norm then
    applies its eigenvalues per channel and ``E r`` serves the embeddings and the head."""
    grams = boundary_grams(lm, input_ids, batch_size)
    weighted = list(grams) if cfg.global_weights == "raw" else [
        g / g.trace().clamp_min(1e-300) for g in grams]
    q = _basis(cfg, weighted, list(fishers) if fishers else None, width)
    r = q[:, :width]
    final_scale = None
    emb = lm.adapter.embeddings()
    if tied:
        s = norm_scale(lm, lm.adapter.final_norm()).to(r)
        final_scale, turn = torch.linalg.eigh(r.t() @ (s[:, None] * r))
        r = r @ turn
        rotate_inputs(emb, r)
        lm.adapter.head().weight = emb.weight
    else:
        rotate_inputs(emb, r)
        rotate_inputs(lm.adapter.head(), r)
    names = {id(m): n for n, m in lm.model.named_modules()}
    d = lm.adapter.hidden_size()
    for br in stream_branches(lm):
        for reader in br.readers:
            rotate_inputs(reader, r)
        if br.post_norm is None:
            rotate_outputs(br.writer, r)
            continue
        ref = br.writer.weight
        mod = ResidualShortcut(names[id(br.norm)], width, width, d, shortcut=False,
                               writer=names[id(br.writer)])
        mod = install(lm.model, f"{names[id(br.owner)]}.{SHORTCUT_ATTR}",
                      mod.to(ref.device, ref.dtype))
        mod.set_maps(out_map=r)
    return [_energy(g, r) for g in grams], final_scale


def _finish(lm, d: int, widths: list[int], final_scale: torch.Tensor | None = None) -> None:
    """Cut what is still full width to its block's width (per-layer: every stream tensor;
    both: the norms), set the norms' constant scale (the final norm's ``final_scale`` per
    channel when given) and the config; non-uniform widths also record the shapes a
    reloaded checkpoint must take (:class:`.widths.StreamShapes`)."""
    branches = stream_branches(lm)
    emb, head = lm.adapter.embeddings(), lm.adapter.head()
    if emb.weight.shape[1] == d and min(widths) < d:  # per-layer: still full width
        cut_inputs(emb, widths[0])
        cut_inputs(head, widths[-1])
        for k, br in enumerate(branches):
            gin, gout = block_of(k, len(branches))
            for reader in br.readers:
                cut_inputs(reader, widths[gin])
            if br.post_norm is None:
                cut_outputs(br.writer, widths[gout])
            mod = getattr(br.owner, SHORTCUT_ATTR, None)
            if isinstance(mod, ResidualShortcut):
                _cut_maps(mod, widths[gin], widths[gout])
    for k, norm in enumerate(stream_boundaries(lm)):
        w = boundary_width(widths, k)
        set_norm_scale(lm, norm, (d / w) ** 0.5, w)
    if final_scale is not None:
        set_norm_vector(lm, lm.adapter.final_norm(), final_scale * (d / widths[-1]) ** 0.5)
    rescale_embedding(lm, widths[0])
    cfg = lm.model.config
    cfg.head_dim = int(lm.adapter.spec.head_dim(cfg))
    cfg.hidden_size = widths[0]
    if len(set(widths)) > 1:
        install(lm.model, "prunelab_stream_shapes", record_shapes(lm))


def _cut_maps(mod: ResidualShortcut, d_in: int, d_out: int) -> None:
    if mod.shortcut is not None:
        mod.set_maps(shortcut=mod.shortcut.detach()[:d_in, :d_out].clone())
    if mod.out_map is not None:
        mod.set_maps(out_map=mod.out_map.detach()[:, :d_out].clone())
