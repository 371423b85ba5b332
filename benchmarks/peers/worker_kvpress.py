"""kvpress side of the KV-cache press comparison (one fresh process, kvpress' own venv).

kvpress 0.5.5 pins ``transformers<5.3``, older than prunelab's, so it runs in
``.bench/peers/kvpress-venv`` and never imports prunelab. It loads the checkpoint that
prunelab converted (``model_dir``, float32, the attention implementation prunelab's load
chose, ``attn_implementation`` in the spec), and runs :func:`continuation.run_presses`
with kvpress' presses as the context (``with press(model):`` registers its forward
hooks, which compress the cache at the end of the prefill). kvpress leaves the
continuation's positions to the caller, so they are passed explicitly
(``T - C .. T - 1``), as its pipeline does for the question.

Presses (kvpress 0.5.5 class and settings): ``streaming-llm`` StreamingLLMPress (4 sink
tokens), ``snapkv`` SnapKVPress (window 64, kernel 5, mean pooling: its defaults),
``tova`` TOVAPress, ``knorm`` KnormPress, ``expected-attention`` ExpectedAttentionPress
(512 future positions, 4 sinks, covariance and value norms: its defaults), ``adakv``
AdaKVPress over SnapKVPress (alpha_safeguard 0.20), ``pyramidkv`` PyramidKVPress (window
64, kernel 5, beta 20).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import continuation  # noqa: E402


def make_press(name: str, ratio: float):
    import kvpress

    classes = {"streaming-llm": kvpress.StreamingLLMPress, "snapkv": kvpress.SnapKVPress,
               "tova": kvpress.TOVAPress, "knorm": kvpress.KnormPress,
               "expected-attention": kvpress.ExpectedAttentionPress,
               "pyramidkv": kvpress.PyramidKVPress}
    if name == "adakv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    return classes[name](compression_ratio=ratio)


def main(argv=None) -> None:
    spec, result = common.worker_io(argv)
    common.one_thread()
    from importlib.metadata import version

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    ids = torch.from_numpy(common.load_ids(spec["ids"], spec["ids_sha256"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec["model_dir"], dtype=torch.float32,
        attn_implementation=spec.get("attn_implementation", "eager"))
    model.eval()
    jobs = []
    for name, ratio, _options in spec["jobs"]:
        p = make_press(name, ratio)
        jobs.append((name, ratio, lambda p=p: p(model)))
    needles = None
    if spec.get("needles"):
        needles = [torch.from_numpy(a) for a in common.load_ragged(
            spec["needles"], spec["needles_sha256"], spec["needle_lengths"])]
    common.trim_heap()
    rows = continuation.run_presses(model, ids, spec["continuation"], jobs,
                                    explicit_positions=True,
                                    peak_rss_cls=common.peak_rss_class(), rss_fn=common.rss,
                                    needles=needles, new_tokens=spec.get("new_tokens", 8),
                                    needle_ratios=spec.get("needle_ratios"),
                                    stepwise=tuple(spec.get("stepwise", ())))
    out = {"needles_sha256": spec.get("needles_sha256"),
           "side": "kvpress", "ids_sha256": common.ids_sha256(ids), "rows": rows,
           "attn_implementation": model.config._attn_implementation,
           "versions": {"kvpress": version("kvpress"),
                        "torch": torch.__version__,
                        "transformers": transformers.__version__},
           "threads": torch.get_num_threads()}
    result.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
