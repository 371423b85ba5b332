"""NVIDIA ModelOpt side: try its Minitron-style pruning on a Hugging Face Llama on CPU.

ModelOpt's Minitron width / depth pruning is the ``mcore_minitron`` mode of
``modelopt.torch.prune.prune``; its plugin (``modelopt/torch/prune/plugins/
mcore_minitron.py``) imports Megatron-Core and Transformer Engine and is registered only
when they import. This worker records, on this machine: whether ``megatron.core`` imports,
which prune modes are registered, and what ``mtp.prune(model, mode="mcore_minitron",
constraints={"params": N}, dummy_input=..., config={"forward_loop": ...})`` does on the
Hugging Face ``LlamaForCausalLM`` (float32, CPU) with the calibration windows as the
forward loop. The result is the outcome (``ok`` and the parameter count, or the
exception's type and message); the page reports it as it is.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def main(argv=None) -> None:
    spec, result = common.worker_io(argv)
    common.one_thread()
    from importlib.metadata import version

    import torch
    import transformers

    ids = torch.from_numpy(common.load_ids(spec["ids"], spec["ids_sha256"]))
    out = {"side": "modelopt", "ids_sha256": common.ids_sha256(ids),
           "versions": {"nvidia-modelopt": version("nvidia-modelopt"),
                        "torch": torch.__version__, "transformers": transformers.__version__}}
    try:
        import megatron.core  # noqa: F401
        out["megatron_core"] = "imports"
    except Exception as exc:  # noqa: BLE001 -- any failure is the finding
        out["megatron_core"] = f"{type(exc).__name__}: {exc}"
    import modelopt.torch.prune as mtp

    try:
        from modelopt.torch.opt.mode import _ModeRegistryCls

        out["registered_modes"] = sorted(
            name for reg in _ModeRegistryCls._all_registries.values() for name in reg)[:50] \
            if hasattr(_ModeRegistryCls, "_all_registries") else "?"
    except Exception as exc:  # noqa: BLE001
        out["registered_modes"] = f"? ({type(exc).__name__})"
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model_dir"],
                                                              dtype=torch.float32)
    model.eval()
    params = sum(p.numel() for p in model.parameters())

    def forward_loop(m):
        with torch.no_grad():
            for i in range(len(ids)):
                m(input_ids=ids[i:i + 1])

    try:
        pruned, _ = mtp.prune(model, mode="mcore_minitron",
                              constraints={"params": int(params * spec["keep"])},
                              dummy_input=ids[:1, :16], config={"forward_loop": forward_loop})
        out["outcome"] = "ok"
        out["params_after"] = sum(p.numel() for p in pruned.parameters())
    except Exception as exc:  # noqa: BLE001 -- the error is what the page reports
        out["outcome"] = "error"
        out["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        out["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
    result.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
