"""PruneMe + mergekit side of the depth comparison (one fresh process, mergekit's venv).

PruneMe (arcee-ai, after Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper
Layers"): run the calibration windows with ``output_hidden_states=True``; for every start
``l`` the angular distance ``arccos(cos(h_l, h_{l+n})) / pi`` between the hidden states
entering block ``l`` and leaving block ``l + n - 1``, at the last token of each window,
averaged over the windows (``h`` as transformers returns them: the last one is after the
final norm, as in PruneMe); the span ``[l, l + n)`` with the smallest distance is cut by
mergekit's ``passthrough`` merge (slices ``[0, l)`` and ``[l + n, L)``), run as
``mergekit-yaml config.yml OUT`` (float32, tokenizer copied). No recovery.

Spec: ``model_dir``, ``ids`` / ``ids_sha256`` (the calibration windows), ``remove`` (n),
``save_dir``. Result: the distances, the span, wall / CPU time and peak RSS of the
similarity pass (this process) and of the merge (the child's ``ru_maxrss``).
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def main(argv=None) -> None:
    spec, result = common.worker_io(argv)
    common.one_thread()
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    ids = torch.from_numpy(common.load_ids(spec["ids"], spec["ids_sha256"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"],
                                                              dtype=torch.float32)
    model.eval()
    n, layers = spec["remove"], model.config.num_hidden_layers
    common.trim_heap()
    base = common.rss()
    with common.peak_rss_class()() as peak:
        t0, c0 = time.perf_counter(), time.process_time()
        dist = [0.0] * (layers - n + 1)
        with torch.no_grad():
            for i in range(len(ids)):
                hs = model(input_ids=ids[i:i + 1], output_hidden_states=True,
                           use_cache=False).hidden_states
                for start in range(layers - n + 1):
                    a, b = hs[start][0, -1].double(), hs[start + n][0, -1].double()
                    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
                    dist[start] += math.acos(max(-1.0, min(1.0, cos))) / math.pi / len(ids)
        sim_seconds, sim_cpu = time.perf_counter() - t0, time.process_time() - c0
    start = min(range(len(dist)), key=dist.__getitem__)
    del model
    out_dir = Path(spec["save_dir"])
    config = {"slices": [s for s in ({"sources": [{"model": spec["model_dir"],
                                                   "layer_range": [0, start]}]},
                                     {"sources": [{"model": spec["model_dir"],
                                                   "layer_range": [start + n, layers]}]})
                         if s["sources"][0]["layer_range"][0] < s["sources"][0]["layer_range"][1]],
              "merge_method": "passthrough", "dtype": "float32"}
    cfg_path = out_dir.parent / f"{out_dir.name}.yml"
    cfg_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    exe = Path(sys.executable).parent / "mergekit-yaml"
    cmd = [sys.executable, str(exe), str(cfg_path), str(out_dir), "--copy-tokenizer"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    merge_seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"mergekit-yaml failed: {proc.stderr[-800:]}")
    from importlib.metadata import version

    out = {"side": "mergekit", "ids_sha256": common.ids_sha256(ids), "distances": dist,
           "start": start, "removed": list(range(start, start + n)), "config": config,
           "similarity_seconds": sim_seconds, "similarity_cpu_seconds": sim_cpu,
           "similarity_extra_peak": peak.peak - base, "merge_seconds": merge_seconds,
           "merge_cpu_seconds": (after.ru_utime - before.ru_utime)
           + (after.ru_stime - before.ru_stime),
           "merge_peak_rss": after.ru_maxrss * 1024, "save_dir": str(out_dir),
           "command": " ".join(cmd[1:]),
           "versions": {"mergekit": version("mergekit"), "torch": torch.__version__,
                        "transformers": transformers.__version__}}
    result.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
