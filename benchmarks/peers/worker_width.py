"""prunelab side of the width comparison (one fresh process, prunelab's environment).

Spec: ``model``, ``calib`` (``{"source", "seqlen", "samples"}``: the windows are rebuilt
with ``make_batches`` and their sha256 checked against ``ids_sha256``, the hash of the ids
the peer got), ``target_params`` (parameters the model keeps, a count: the peer's), ``unit``
(``ffn`` | ``heads``), ``score``, ``compensate``, ``save_dir``. Runs
``prunelab.prune(lm, Width(...), calib, batch_size=8)`` timed, with prunelab's
``PeakRSS`` over the RSS before the call, saves the checkpoint and writes the result.
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
    cfg = Width(unit=spec["unit"], score=spec.get("score", "wanda-sp"),
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
        prunelab.prune(lm, cfg, calib, batch_size=8)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    params_after = sum(p.numel() for p in lm.model.parameters())
    prunelab.save(lm, spec["save_dir"], overwrite=True)
    out = {"side": "prunelab", "ids_sha256": sha, "config": repr(cfg), "seconds": seconds,
           "cpu_seconds": cpu, "extra_peak": peak.peak - base, "params_before": params_before,
           "params_after": params_after, "save_dir": spec["save_dir"],
           "ffn": [lm.adapter.ffn_width(i) for i in range(lm.adapter.num_blocks)][:1]}
    result.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
