"""Peer: NVIDIA ModelOpt (``nvidia-modelopt`` 0.47.0), Minitron-style width / depth pruning.

Installs ModelOpt in ``.bench/peers/modelopt-venv`` (torch 2.13.0 CPU, transformers below
5.15 as its ``hf`` extra asks, and ``requests``, which ``modelopt.torch`` imports without
declaring it) and runs ``worker_modelopt.py``, which tries
``mtp.prune(model, mode="mcore_minitron", ...)`` on the Hugging Face Llama (SmolLM2) on CPU
at the Torch-Pruning budgets (80 % and 50 % of the parameters kept) with the calibration
windows as the forward loop. If it runs, the checkpoints would go through the same
evaluator as the other peers; if not, the page gives the error seen and why.
"""

from __future__ import annotations

import time
from pathlib import Path

import common

NAME = "modelopt"
PIN = "nvidia-modelopt==0.47.0"
HERE = Path(__file__).resolve().parent


def run(ctx) -> tuple[str, dict]:
    import prunelab
    from prunelab.data import make_batches

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    head = ["## NVIDIA ModelOpt: Minitron-style width / depth pruning", "",
            f"Run {started}, commit `{ctx.commit}`, {ctx.machine}; command: `{ctx.command}`.",
            ""]
    try:
        # modelopt.torch imports requests without declaring it (0.47.0)
        py, versions = common.ensure_venv("modelopt", [PIN, "transformers>=4.57,<5.15",
                                                       "psutil", "requests"],
                                          ["modelopt.torch.prune", "torch", "transformers",
                                           "psutil"])
    except RuntimeError as exc:
        return "\n".join(head + [f"Could not be installed here: `{exc}`"]), {"error": str(exc)}
    lm = prunelab.load(ctx.model, dtype="float32", device="cpu")
    calib = make_batches(lm.tokenizer, "wiki-vital:calib", seqlen=128, samples=4, seed=0)
    model_dir = str(lm.source)
    del lm
    workdir = ctx.workdir / NAME
    workdir.mkdir(parents=True, exist_ok=True)
    sha = common.save_ids(workdir / "calib.ids.npy", calib.input_ids)
    raw = {}
    for keep in (0.8, 0.5):
        res = common.run_worker(py, HERE / "worker_modelopt.py",
                                {"model_dir": model_dir, "ids": str(workdir / "calib.ids.npy"),
                                 "ids_sha256": sha, "keep": keep}, workdir, f"modelopt-{keep}")
        if "error" not in res or "outcome" in res:
            common.check_result_ids(res, sha, "modelopt")
        raw[str(keep)] = res
    return section(head, raw), raw


def section(head: list[str], raw: dict) -> str:
    lines = list(head)
    for keep, res in raw.items():
        if res.get("outcome") == "ok":
            lines.append(f"- keep {keep}: ran, {res['params_after']:,} parameters kept "
                         "(scoring not wired: it did not run when this page was written).")
        elif res.get("outcome") == "error":
            lines.append(f"- keep {keep}: `mtp.prune(model, mode=\"mcore_minitron\", ...)` on "
                         f"the Hugging Face `LlamaForCausalLM`, CPU: `{res['error']}`")
        else:
            lines.append(f"- keep {keep}: the worker failed: `{res.get('error')}`")
    first = next(iter(raw.values()), {})
    if "versions" in first:
        lines += ["", f"Versions: {first['versions']}; `import megatron.core`: "
                  f"{first.get('megatron_core')}."]
    lines += ["", "Why: ModelOpt's Minitron pruning (`mcore_minitron`) is written for "
              "NVIDIA Megatron-Core GPT / Mamba models: its plugin "
              "(`modelopt/torch/prune/plugins/mcore_minitron.py`) imports `megatron.core` "
              "and Transformer Engine, and the mode is registered only when they import; its "
              "layer-dropping path moves tensors to CUDA. A Hugging Face Llama has to be "
              "converted to a Megatron-Core model first (Megatron-Bridge / NeMo), which needs "
              "those CUDA packages. The other prune mode of 0.47.0, `fastnas`, is documented "
              "for computer-vision models, not Minitron's width and depth axes. So "
              "there is no ModelOpt row at the Torch-Pruning budgets on this CPU machine."]
    return "\n".join(lines)
