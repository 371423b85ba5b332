"""prunelab side of the width comparison (one fresh process, prunelab's environment).

Spec: ``model``, ``calib`` (``{"source", "seqlen", "samples"}``: the windows are rebuilt
with ``make_batches`` and their sha256 checked against ``ids_sha256``, the hash of the ids
the peer got), ``target_params`` (parameters the model keeps, a count: the peer's), ``unit``
(``ffn`` | ``heads``), ``score``, ``compensate``, ``save_dir``. Runs
``prunelab.prune(lm, Width(...), calib, batch_size=8)`` timed, with prunelab's
``PeakRSS`` over the RSS before the call, saves the checkpoint and writes the result.

``score: "group-l2-by-hand"`` (with ``ffn_width``): not a prunelab method but a check of
the peer, written here from Torch-Pruning's definition of its LLM example's criterion
(``GroupNormImportance(p=2, group_reduction="mean")`` over the coupled FFN group: each
channel's squared L2 norm in ``gate_proj`` and ``up_proj`` rows and the ``down_proj``
column, averaged; the ``ffn_width`` largest kept in every block, data-free), applied with
the adapter's ``slice_ffn``: if its checkpoint scores like Torch-Pruning's, Torch-Pruning
did what its criterion says and the criterion is what fails.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def main(argv=None) -> None:
    spec, result = common.worker_io(argv)
    common.one_thread()
    import torch

    import prunelab
    import prunelab.log
    from prunelab.data import make_batches
    from prunelab.eval.speed import PeakRSS
    from prunelab.pruning.width.config import Width

    prunelab.log.set_quiet(True)
    lm = prunelab.load(spec["model"], dtype="float32", device="cpu")
    c = spec["calib"]
    calib = make_batches(lm.tokenizer, c["source"], seqlen=c["seqlen"], samples=c["samples"],
                         seed=0)
    sha = common.ids_sha256(calib.input_ids)
    if sha != spec["ids_sha256"]:
        raise common.IdsMismatch(f"calibration ids {sha[:12]} != {spec['ids_sha256'][:12]}")
    by_hand = spec.get("score") == "group-l2-by-hand"
    cfg = None if by_hand else Width(
        unit=spec["unit"], score=spec.get("score", "wanda-sp"),
        target_params=spec["target_params"], compensate=spec["compensate"],
        round_to=spec.get("round_to", 8))
    params_before = sum(p.numel() for p in lm.model.parameters())
    with torch.no_grad():
        for t in lm.model.parameters():
            t.sum()
    common.trim_heap()
    base = common.rss()
    with PeakRSS() as peak:
        t0, c0 = time.perf_counter(), time.process_time()
        if by_hand:
            group_l2_by_hand(lm, spec["ffn_width"])
        else:
            prunelab.prune(lm, cfg, calib, batch_size=8)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    params_after = sum(p.numel() for p in lm.model.parameters())
    prunelab.save(lm, spec["save_dir"], overwrite=True)
    out = {"side": "prunelab", "ids_sha256": sha,
           "config": "group-l2-by-hand" if by_hand else repr(cfg), "seconds": seconds,
           "cpu_seconds": cpu, "extra_peak": peak.peak - base, "params_before": params_before,
           "params_after": params_after, "save_dir": spec["save_dir"],
           "ffn": [lm.adapter.ffn_width(i) for i in range(lm.adapter.num_blocks)][:1]}
    result.write_text(json.dumps(out, indent=2))


def group_l2_by_hand(lm, width: int) -> None:
    """Keep the ``width`` FFN channels of largest mean squared L2 norm over the coupled
    group (gate row, up row, down column) in every block (see the module docstring)."""
    import torch

    ad = lm.adapter
    with torch.no_grad():
        for i in range(ad.num_blocks):
            proj = ad.mlp_projections(i)
            parts = [proj[r].weight.pow(2).sum(1) for r in ("gate", "up") if r in proj]
            parts.append(proj["down"].weight.pow(2).sum(0))
            imp = torch.stack(parts).mean(0)
            ad.slice_ffn(i, imp.argsort(descending=True)[:width].tolist())
    ad.sync_config()


if __name__ == "__main__":
    main()
