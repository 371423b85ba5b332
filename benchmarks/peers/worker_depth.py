"""prunelab side of the depth comparison (one fresh process, prunelab's environment).

Spec: ``model``, ``calib`` (``{"source", "seqlen", "samples"}``, rebuilt here and checked
against ``ids_sha256``), ``remove`` (blocks), ``recovery`` (``none`` | ``foldable``),
``save_dir``. Runs ``prunelab.prune(lm, Depth(remove=n, probe="span-angular",
select="span", recovery=...), calib)`` timed, prunelab's ``PeakRSS`` over the RSS before
the call, saves the checkpoint and writes the result (the report's JSON-able fields).
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

    prunelab.log.set_quiet(True)
    lm = prunelab.load(spec["model"], dtype="float32", device="cpu")
    c = spec["calib"]
    calib = make_batches(lm.tokenizer, c["source"], seqlen=c["seqlen"], samples=c["samples"],
                         seed=0)
    sha = common.ids_sha256(calib.input_ids)
    if sha != spec["ids_sha256"]:
        raise common.IdsMismatch(f"calibration ids {sha[:12]} != {spec['ids_sha256'][:12]}")
    cfg = prunelab.Depth(remove=spec["remove"], probe="span-angular", select="span",
                         recovery=spec["recovery"])
    with torch.no_grad():
        for t in lm.model.parameters():
            t.sum()
    common.trim_heap()
    base = common.rss()
    with PeakRSS() as peak:
        t0, c0 = time.perf_counter(), time.process_time()
        report = prunelab.prune(lm, cfg, calib, batch_size=8)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    prunelab.save(lm, spec["save_dir"], overwrite=True)
    rep = {}
    for k, v in dict(report).items():
        try:
            json.dumps(v)
            rep[k] = v
        except TypeError:
            rep[k] = repr(v)[:200]
    out = {"side": "prunelab", "ids_sha256": sha, "config": repr(cfg), "seconds": seconds,
           "cpu_seconds": cpu, "extra_peak": peak.peak - base, "report": rep,
           "params_after": sum(p.numel() for p in lm.model.parameters()),
           "save_dir": spec["save_dir"]}
    result.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
