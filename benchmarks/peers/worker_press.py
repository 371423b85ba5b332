"""prunelab side of the KV-cache press comparison (one fresh process, prunelab's env).

Spec (JSON, see ``common.py``): ``model`` (a prunelab spec), ``ids`` / ``ids_sha256``
(``[N, T]`` windows), ``continuation`` (C), ``jobs``: ``[[press name, ratio, options]]``
(an optional fourth item labels the row instead of the press name).
Loads the model with ``prunelab.load`` (float32, CPU, eager attention as prunelab sets
it), runs :func:`continuation.run_presses` with ``prunelab.press(lm, press_for(name,
ratio, **options))`` as the context, and writes the rows plus the ids' hash.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import continuation  # noqa: E402


def main(argv=None) -> None:
    spec, result = common.worker_io(argv)
    common.one_thread()
    import torch
    import transformers

    import prunelab
    import prunelab.log
    from prunelab.eval.speed import PeakRSS
    from prunelab.inference import press, press_for

    transformers.logging.set_verbosity_error()
    prunelab.log.set_quiet(True)
    ids = torch.from_numpy(common.load_ids(spec["ids"], spec["ids_sha256"]))
    lm = prunelab.load(spec["model"], dtype="float32", device="cpu")
    jobs = []
    for name, ratio, options, *label in spec["jobs"]:
        cfg = press_for(name, ratio, **{k: tuple(v) if isinstance(v, list) else v
                                        for k, v in options.items()})
        jobs.append((label[0] if label else name, ratio, lambda cfg=cfg: press(lm, cfg)))
    needles = None
    if spec.get("needles"):
        needles = [torch.from_numpy(a) for a in common.load_ragged(
            spec["needles"], spec["needles_sha256"], spec["needle_lengths"])]
    common.trim_heap()
    rows = continuation.run_presses(lm.model, ids, spec["continuation"], jobs,
                                    explicit_positions=False, peak_rss_cls=PeakRSS,
                                    rss_fn=common.rss,
                                    needles=needles, new_tokens=spec.get("new_tokens", 8),
                                    needle_ratios=spec.get("needle_ratios"),
                                    stepwise=tuple(spec.get("stepwise", ())))
    out = {"needles_sha256": spec.get("needles_sha256"),
           "side": "prunelab", "ids_sha256": common.ids_sha256(ids), "rows": rows,
           "attn_implementation": lm.model.config._attn_implementation,
           "versions": {"prunelab": prunelab.__version__, "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "threads": torch.get_num_threads()}
    result.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
