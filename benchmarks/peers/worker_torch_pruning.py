"""Torch-Pruning side of the width comparison (one fresh process, its own venv).

Settings are those of Torch-Pruning's LLM example (``examples/LLMs/prune_llm.py``, v1.6):
``MetaPruner`` with ``GroupNormImportance(p=2, group_reduction="mean")`` (named
``GroupMagnitudeImportance`` in the 1.6.1 wheel; data-free: the L2 norm of each channel
group's weights), ``global_pruning=False`` (every layer loses the
same fraction), ``pruning_ratio = head_pruning_ratio = ratio``, ``prune_num_heads=True``,
``prune_head_dims=False`` (RoPE stays intact), ``num_heads`` of ``q_proj`` / ``k_proj`` /
``v_proj`` from the config, ``round_to=4``, the LM head ignored; an example input of the
first 16 calibration tokens (the example traces the graph on "Hello world."), run with
``use_cache=False`` and the logits as the traced output (with transformers 5 the model's
output also holds a ``DynamicCache``, which Torch-Pruning's tracer cannot walk). One change,
stated in the page: the example also shrinks the hidden size (the residual stream); the
comparison here is on heads and FFN channels, so ``embed_tokens``, every ``o_proj`` and
``down_proj`` are ignored as roots too (they only lose input channels, with their heads and
FFN channels). After pruning, the config's head counts and ``intermediate_size`` are
updated as the example does, and the model is saved with ``save_pretrained``. Eager
attention (``repeat_kv`` in the graph). If pruning heads fails (Torch-Pruning couples the
9 query heads with the 3 key / value heads of SmolLM2's grouped-query attention), the
error is recorded (``attempts``) and the run is repeated on FFN channels alone (q / k / v
ignored too).

Spec: ``model_dir``, ``ids`` / ``ids_sha256`` (calibration windows: only the example input
is used), ``ratio``, ``save_dir``. Result: wall time and peak RSS (prunelab's ``PeakRSS``)
of building the pruner and pruning, parameters before / after, the new shapes.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


def calib_perplexity(model, ids) -> float:
    """Perplexity of ``model`` on the calibration windows, inside this venv (so the page
    can tell a weak pruned model from a checkpoint that reloads wrongly)."""
    import math

    import torch

    nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(len(ids)):
            logits = model(input_ids=ids[i:i + 1], use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[:-1], dim=-1)
            nll -= float(logp.gather(-1, ids[i, 1:, None]).sum())
            n += ids.shape[1] - 1
    return math.exp(nll / n)


def main(argv=None) -> None:
    spec, result = common.worker_io(argv)
    common.one_thread()
    import torch
    import torch_pruning as tp
    import transformers

    transformers.logging.set_verbosity_error()
    ids = torch.from_numpy(common.load_ids(spec["ids"], spec["ids_sha256"]))
    # the example's GroupNormImportance is GroupMagnitudeImportance in the 1.6.1 wheel
    importance_cls = getattr(tp.importance, "GroupNormImportance", None) \
        or tp.importance.GroupMagnitudeImportance
    ratio = spec["ratio"]
    attempts = []
    for heads_too in (True, False):  # heads + FFN as the example; FFN alone if that fails
        model = transformers.AutoModelForCausalLM.from_pretrained(
            spec["model_dir"], dtype=torch.float32, attn_implementation="eager")
        model.eval()
        cfg = model.config
        params_before = sum(p.numel() for p in model.parameters())
        example = ids[:1, :16]
        with torch.no_grad():
            for t in model.parameters():
                t.sum()
        common.trim_heap()
        base = common.rss()
        try:
            with common.peak_rss_class()() as peak:
                t0, c0 = time.perf_counter(), time.process_time()
                num_heads, ignored = {}, [model.lm_head, model.model.embed_tokens]
                for layer in model.model.layers:
                    att = layer.self_attn
                    num_heads[att.q_proj] = cfg.num_attention_heads
                    num_heads[att.k_proj] = cfg.num_key_value_heads
                    num_heads[att.v_proj] = cfg.num_key_value_heads
                    ignored += [att.o_proj, layer.mlp.down_proj]
                    if not heads_too:
                        ignored += [att.q_proj, att.k_proj, att.v_proj]
                pruner = tp.pruner.MetaPruner(
                    model, example_inputs={"input_ids": example, "use_cache": False},
                    output_transform=lambda out: out.logits,
                    importance=importance_cls(p=2, group_reduction="mean"),
                    global_pruning=False, pruning_ratio=ratio, ignored_layers=ignored,
                    num_heads=num_heads if heads_too else {}, prune_num_heads=heads_too,
                    prune_head_dims=False, head_pruning_ratio=ratio if heads_too else 0.0,
                    round_to=4)
                with torch.no_grad():
                    for group in pruner.step(interactive=True):
                        group.prune()
                seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        except Exception as exc:  # noqa: BLE001 -- recorded; the FFN-only run follows
            attempts.append({"heads": heads_too, "error": f"{type(exc).__name__}: {exc}"[:400]})
            del model
            continue
        attempts.append({"heads": heads_too, "ok": True})
        break
    del pruner
    att0, mlp0 = model.model.layers[0].self_attn, model.model.layers[0].mlp
    heads = att0.q_proj.out_features // att0.head_dim
    kv_heads = att0.k_proj.out_features // att0.head_dim
    shapes = sorted({(layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
                      layer.mlp.gate_proj.out_features) for layer in model.model.layers})
    for layer in model.model.layers:  # the example's attribute updates
        layer.self_attn.num_key_value_groups = heads // kv_heads
    cfg.num_attention_heads, cfg.num_key_value_heads = heads, kv_heads
    cfg.intermediate_size = mlp0.gate_proj.out_features
    cfg.head_dim = att0.head_dim
    pruned_calib_ppl = calib_perplexity(model, ids)  # before saving: a round-trip check
    params_after = sum(p.numel() for p in model.parameters())
    transformers.PreTrainedModel.save_pretrained(model, spec["save_dir"])
    for name in TOKENIZER_FILES:
        src = Path(spec["model_dir"]) / name
        if src.is_file():
            shutil.copy(src, Path(spec["save_dir"]) / name)
    out = {"side": "torch-pruning", "ids_sha256": common.ids_sha256(ids), "ratio": ratio,
           "seconds": seconds, "cpu_seconds": cpu, "extra_peak": peak.peak - base,
           "params_before": params_before, "params_after": params_after,
           "heads": heads, "kv_heads": kv_heads, "intermediate": cfg.intermediate_size,
           "uniform": len(shapes) == 1,
           "importance": importance_cls.__name__,
           "pruned_calib_ppl_in_venv": pruned_calib_ppl, "attempts": attempts, "shapes": shapes,
           "save_dir": spec["save_dir"],
           "versions": {"torch_pruning": getattr(tp, "__version__", "?"),
                        "torch": torch.__version__, "transformers": transformers.__version__}}
    result.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
