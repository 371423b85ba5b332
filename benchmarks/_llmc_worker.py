"""llm-compressor side of ``benchmarks/sparsity_vs_llmcompressor.py`` (one job per process).

Runs in the llm-compressor virtual environment that the main script creates (it pins an
older ``transformers`` than prunelab's), so it must not import prunelab. It loads the
prunelab-converted float32 checkpoint, the calibration token ids that the main script
saved, runs ``llmcompressor.oneshot`` with ``WandaPruningModifier`` or
``SparseGPTModifier`` through the sequential pipeline, and writes a JSON result plus a
dense checkpoint (pruned weights as zeros) that the main script scores with prunelab.

Wall time is that of the ``oneshot`` call; peak memory is the process RSS sampled every
2 ms during it (prunelab's own ``PeakRSS``, loaded from the source file so both sides are
measured by the same code), minus the RSS just before the call.

Not meant to be run by hand; see the main script for the arguments it passes.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import threading
import time
from pathlib import Path

SPEED_PY = Path(__file__).resolve().parents[1] / "src" / "prunelab" / "eval" / "speed.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def peak_rss_class():
    """prunelab's ``PeakRSS`` (by file, no package import), else an equivalent sampler."""
    if SPEED_PY.is_file():
        spec = importlib.util.spec_from_file_location("_prunelab_speed", SPEED_PY)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod.PeakRSS

    import psutil

    class PeakRSS:
        def __init__(self, interval: float = 0.002):
            self.proc = psutil.Process()
            self.interval = interval
            self.peak = self.proc.memory_info().rss
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)

        def _sample(self):
            while not self._stop.is_set():
                self.peak = max(self.peak, self.proc.memory_info().rss)
                time.sleep(self.interval)

        def __enter__(self):
            self._thread.start()
            return self

        def __exit__(self, *exc):
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.proc.memory_info().rss)
            return False

    return PeakRSS


def _vmhwm() -> int | None:
    """Peak RSS of this process in bytes (``VmHWM``), None where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def zero_fraction(t) -> float:
    return float((t == 0).sum()) / t.numel()


def block_linear_sparsity(model) -> tuple[float, int]:
    """Zero fraction over the ``nn.Linear`` weights inside the decoder blocks."""
    import torch

    zeros = total = 0
    for layer in model.model.layers:
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                zeros += int((m.weight == 0).sum())
                total += m.weight.numel()
    return zeros / max(total, 1), total


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="llm-compressor oneshot pruning job")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--calib", required=True, help=".pt file with int64 ids [samples, seqlen]")
    ap.add_argument("--method", choices=("wanda", "sparsegpt"), required=True)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--mask-structure", default="0:0", help='"0:0" unstructured or "2:4"')
    ap.add_argument("--ignore", default="lm_head", help="comma-separated ignore list")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)

    import llmcompressor
    import psutil
    import torch
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier

    transformers.logging.set_verbosity_error()
    PeakRSS = peak_rss_class()

    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    layer_class = type(model.model.layers[0]).__name__  # LlamaDecoderLayer, Qwen2DecoderLayer
    ids = torch.load(args.calib)
    samples, seqlen = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(),
                            "attention_mask": torch.ones_like(ids).tolist()})
    tied_before = model.lm_head.weight is model.model.embed_tokens.weight
    embed_zero_before = zero_fraction(model.model.embed_tokens.weight)
    with torch.no_grad():  # page in the mmapped weights so the baseline holds them
        for t in list(model.parameters()) + list(model.buffers()):
            t.sum()

    ignore = [s for s in args.ignore.split(",") if s]
    cls = WandaPruningModifier if args.method == "wanda" else SparseGPTModifier
    modifier = cls(sparsity=args.sparsity, mask_structure=args.mask_structure,
                   targets=["Linear"], ignore=ignore)
    call = {"recipe": [repr(modifier)], "num_calibration_samples": samples,
            "max_seq_length": seqlen, "pipeline": "sequential",
            "sequential_targets": [layer_class], "batch_size": args.batch_size,
            "shuffle_calibration_samples": False}
    gc.collect()
    try:  # as the prunelab side: loading's free heap pages go back first
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    baseline = psutil.Process().memory_info().rss
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        model = oneshot(model=model, dataset=ds, recipe=[modifier],
                        num_calibration_samples=samples, max_seq_length=seqlen,
                        pipeline="sequential", sequential_targets=[layer_class],
                        batch_size=args.batch_size, shuffle_calibration_samples=False)
        seconds = time.perf_counter() - t0

    sparsity, linear_params = block_linear_sparsity(model)
    result = {
        "side": "llm-compressor", "method": args.method, "sparsity_target": args.sparsity,
        "mask_structure": args.mask_structure, "ignore": ignore, "seconds": seconds,
        "baseline_rss": baseline, "peak_rss": rss.peak, "extra_peak": rss.peak - baseline,
        "vmhwm": _vmhwm(),  # the whole process's peak RSS (load + oneshot), Linux
        "achieved_sparsity": sparsity, "pruned_linear_params": linear_params,
        "embed_zero_fraction": zero_fraction(model.model.embed_tokens.weight),
        "embed_zero_fraction_before": embed_zero_before,
        "lm_head_zero_fraction": zero_fraction(model.lm_head.weight),
        "tied_before": tied_before,
        "tied_after": model.lm_head.weight is model.model.embed_tokens.weight,
        "samples": samples, "seqlen": seqlen, "threads": torch.get_num_threads(),
        "dtype": args.dtype, "cuda_peak_bytes": (torch.cuda.max_memory_allocated()
                                                 if torch.cuda.is_available() else None),
        "versions": {"llmcompressor": llmcompressor.__version__,
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "call": call, "save_dir": args.save_dir,
    }
    # llm-compressor wraps the instance's save_pretrained to write its compressed format;
    # the class method writes plain dense safetensors that any transformers can load.
    transformers.PreTrainedModel.save_pretrained(model, args.save_dir)
    for name in TOKENIZER_FILES:
        src = Path(args.model_dir) / name
        if src.is_file() and not (Path(args.save_dir) / name).exists():
            shutil.copy(src, Path(args.save_dir) / name)
    Path(args.result).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
