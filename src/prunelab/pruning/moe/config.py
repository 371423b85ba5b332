"""The ``prunepath`` method: every block's gated FFN becomes contiguous experts with a
cumulative-mass router (:class:`~prunelab.pruning.moe.module.PrunePathMLP`).

Calibration runs block by block on the dense stream (one block pass each: the MLP inputs
are tapped while the dense block runs, and the dense outputs feed the next block, so the
routers do not depend on the mass). Per block: the channels are clustered (weights or
co-activations), permuted, the router fitted (or set from the centroids), and the
selection at ``mass`` measured on the calibration tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from prunelab.calib.runner import BlockRunner
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.models.custom import flops_per_token, install
from prunelab.models.size import model_size
from prunelab.pruning.base import FACTORED, METHODS, PRUNERS, STREAM, TOKENS, DictReport, Pruner
from prunelab.pruning.moe.convert import convert_block, unsupported_reason
from prunelab.pruning.moe.module import MASS_ATTR
from prunelab.registry import check_range

CLUSTERINGS = ("kmeans", "coactivation")
ROUTERS = ("fitted", "centroid")


def _help(text: str, **more) -> dict:
    return {"help": text, **more}


@METHODS.register("prunepath")
@dataclass(frozen=True)
class PrunePath:
    """PrunePath: FFNs as experts with a cumulative-mass router (MoEfication, Zhang et al.
    2022, arXiv:2110.01786, plus the top-p routing threshold of PrunePath, a seed method).
    ``mass`` is stored in the checkpoint's config (``prunelab_moe_mass``) and can be
    changed at load time or with :func:`~prunelab.pruning.moe.module.set_mass`."""

    experts: int = field(default=16, metadata=_help(
        "experts per FFN (channels split into equal-size groups)"))
    clustering: str = field(default="coactivation", metadata=_help(
        "kmeans (balanced k-means of the normalised gate/up rows) or coactivation "
        "(balanced k-means of the channels' activation magnitudes on calibration data)"))
    router: str = field(default="fitted", metadata=_help(
        "fitted (softmax fitted to each expert's share of the FFN output norm) or "
        "centroid (training-free: gate-row centroids, one temperature per block)"))
    mass: float = field(default=0.9, metadata=_help(
        "routing mass p in (0, 1]: a token uses the fewest experts whose probabilities "
        "reach p (1 = dense); a runtime knob of the checkpoint", budget="keep-mass"))
    router_steps: int = field(default=300, metadata=_help(
        "Adam steps of the fitted router (0: keep the centroid router)"))
    router_lr: float = field(default=0.01, metadata=_help(
        "Adam learning rate of the fitted router (decays linearly to 0)"))
    seed: int = field(default=0, metadata=_help("seed of the clustering and the router fit"))

    def __post_init__(self) -> None:
        check_range("experts", self.experts, 2, 1 << 20, integer=True)
        if self.clustering not in CLUSTERINGS:
            raise ConfigError(f"clustering must be kmeans or coactivation, got "
                              f"{self.clustering!r}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router must be fitted or centroid, got {self.router!r}")
        check_range("mass", self.mass, 0.0, 1.0)
        if self.mass <= 0:
            raise ConfigError(f"mass must be in (0, 1], got {self.mass!r}")
        check_range("router_steps", self.router_steps, 0, 1_000_000, integer=True)
        check_range("router_lr", self.router_lr, 0.0, 10.0)
        if self.router_lr <= 0:
            raise ConfigError(f"router_lr must be in (0, 10], got {self.router_lr!r}")
        check_range("seed", self.seed, 0, 2**63 - 1, integer=True)

    def blocks(self, lm) -> list[int]:
        """Blocks with an MLP branch (a removed branch has nothing to route)."""
        ad = lm.adapter
        return [i for i in range(ad.num_blocks) if ad.has_branch(i, "mlp")]

    def precheck(self, lm) -> None:
        """The user errors found without data: family, activation, width."""
        blocks = self.blocks(lm)
        if not blocks:
            raise UnsupportedOperationError("the model has no MLP left to split into experts")
        for i in blocks:
            reason = unsupported_reason(lm, i)
            if reason is not None:
                raise UnsupportedOperationError(reason)
            width = lm.adapter.ffn_width(i)
            if self.experts > width:
                raise ConfigError(f"experts {self.experts} is more than block {i}'s "
                                  f"{width} FFN channels")

    def apply(self, lm, input_ids: torch.Tensor, *, batch_size: int) -> dict:
        """Convert every block's MLP in place; return the report values."""
        self.precheck(lm)
        runner = BlockRunner(lm, input_ids, batch_size)
        names = {id(m): n for n, m in lm.model.named_modules()}
        wanted = set(self.blocks(lm))
        setattr(lm.model.config, MASS_ATTR, float(self.mass))  # read by each module's attach
        rows: list[dict] = []

        def on_block(i, hidden):
            if i not in wanted:
                return None
            mlp = lm.adapter.mlp(i)
            outs, seen = runner.tap(i, hidden, {"mlp": mlp}, what="input")
            d = lm.adapter.hidden_size()
            x = torch.cat([s.reshape(-1, d) for s in seen["mlp"]]).to(runner.device)
            module, row = convert_block(lm, i, x, self)
            install(lm.model, names[id(mlp)], module)
            rows.append(row)
            return outs  # the dense outputs: routers fitted on the dense stream

        runner.run(on_block=on_block, propagate="modified", desc="prunepath experts")
        return summary(rows, self, runner.passes)


def summary(rows: list[dict], cfg: PrunePath, passes: float) -> dict:
    """The report values from the per-block rows."""
    n = max(len(rows), 1)
    return {"experts": cfg.experts, "clustering": cfg.clustering, "router": cfg.router,
            "mass": cfg.mass, "converted_blocks": [r["block"] for r in rows],
            "calib_experts_per_token": sum(r["experts_per_token"] for r in rows) / n,
            "calib_ffn_flops_ratio": sum(r["ffn_flops_ratio"] for r in rows) / n,
            "calib_relative_error": sum(r["relative_error"] for r in rows) / n,
            "blocks": rows, "block_evaluations": passes}


@PRUNERS.register(PrunePath)
class PrunePathPruner(Pruner):
    """Runs :meth:`PrunePath.apply` and adds sizes and FLOPs."""

    operation = "prune-moe"
    refuses_kinds = FACTORED | STREAM | TOKENS

    def precheck(self, lm, config: PrunePath) -> None:
        config.precheck(lm)

    def run(self, lm, config: PrunePath, input_ids, *, batch_size: int) -> DictReport:
        before = model_size(lm.model)["params"]
        flops_before = flops_per_token(lm.model)
        values = config.apply(lm, input_ids, batch_size=batch_size)
        values.update({"params_before": before, "params_after": model_size(lm.model)["params"],
                       "flops_per_token_before": flops_before,
                       "flops_per_token_all_experts": flops_per_token(lm.model),
                       "needs_remote_code": True})
        keys = ("experts", "clustering", "router", "mass", "calib_experts_per_token",
                "calib_ffn_flops_ratio", "params_before", "params_after", "needs_remote_code")
        return DictReport(values, history_keys=keys)
