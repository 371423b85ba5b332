"""Save a streamed model (:mod:`prunelab.models.streaming`) shard by shard.

The checkpoint is assembled in a temporary folder beside the target, one safetensors shard
per block (``model-00001-of-000NN.safetensors``: the block read from its staged or source
shard, renamed to its current index, written, freed) and a last shard with the resident
parameters (embeddings, final norm, head), plus ``model.safetensors.index.json``, the
config, the tokenizer and ``manifest.json``; then it is fsynced and renamed into place
under the output lock like :func:`prunelab.io.save.save` (no partial folder on failure).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from prunelab.io.lock import clean_leftovers, fsync_tree, output_lock, temp_prefix
from prunelab.io.save import (
    _check_target,
    _install,
    _os_errors,
    build_manifest,
    write_json,
)


def _tied(model) -> set[str]:
    keys: set[str] = set()
    for attr in ("_tied_weights_keys", "all_tied_weights_keys"):
        keys |= set(getattr(model, attr, None) or ())
    return keys


def write_shards(lm, folder: Path) -> dict[str, str]:
    """Write every block and then the resident parameters as shards of ``folder``; return
    the weight map (tensor name -> shard file). At most one block is resident at a time."""
    from safetensors.torch import save_file

    st = lm.streamer
    blocks = list(lm.adapter.blocks())
    n = len(blocks) + 1
    weight_map: dict[str, str] = {}
    total = 0
    for i, blk in enumerate(blocks):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        with st.hold(blk):
            state = {f"{st.prefix}.{i}.{k}": v.detach().contiguous()
                     for k, v in blk.state_dict().items()}
            save_file(state, str(folder / name), metadata={"format": "pt"})
        st.release()
        total += sum(v.numel() * v.element_size() for v in state.values())
        weight_map.update(dict.fromkeys(state, name))
        del state
    name = f"model-{n:05d}-of-{n:05d}.safetensors"
    tied = _tied(lm.model) if getattr(lm.model.config, "tie_word_embeddings", False) else set()
    rest, seen = {}, set()
    for k, v in lm.model.state_dict().items():
        if k.startswith(st.prefix + ".") or k in tied or id(v) in seen:
            continue
        seen.add(id(v))
        rest[k] = v.detach().contiguous()
    save_file(rest, str(folder / name), metadata={"format": "pt"})
    total += sum(v.numel() * v.element_size() for v in rest.values())
    weight_map.update(dict.fromkeys(rest, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return weight_map


def save_streamed(lm, out_dir: str | Path, manifest: dict | None = None,
                  overwrite: bool = False) -> Path:
    """Save a streamed (possibly pruned) model as a plain ``transformers`` checkpoint plus
    ``manifest.json``, atomically; the config follows the pruned shapes like
    :func:`prunelab.io.save.save` (per-block widths get the generated modeling file)."""
    from prunelab.io.remote import has_bridges, has_custom_modules, load_hint, write_remote_code

    out = Path(out_dir)
    _check_target(out, overwrite, "checkpoint")
    widths = bool(lm.adapter.vanilla_problems()) and any(
        op.get("operation") == "prune-width" for op in getattr(lm, "history", []))
    if widths:
        lm.model.config.num_hidden_layers = lm.adapter.num_blocks
    else:
        lm.adapter.sync_config()
    remote = has_bridges(lm.model) or has_custom_modules(lm.model) or widths
    with _os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        with output_lock(out):
            clean_leftovers(out)
            _check_target(out, overwrite, "checkpoint")
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=temp_prefix(out)))
            try:
                write_shards(lm, tmp)
                lm.model.config.save_pretrained(tmp)
                gen = getattr(lm.model, "generation_config", None)
                if gen is not None:
                    gen.save_pretrained(tmp)
                if lm.tokenizer is not None:
                    lm.tokenizer.save_pretrained(tmp)
                man = dict(manifest) if manifest is not None else build_manifest(lm)
                man["streamed"] = True
                if remote:
                    man["remote_code"] = write_remote_code(lm.model, tmp)
                man["loads_with"] = (load_hint(lm.model) if remote
                                     else "plain transformers (no remote code)")
                write_json(tmp / "manifest.json", man)
                os.chmod(tmp, 0o755)
                fsync_tree(tmp)
                _install(tmp, out, overwrite, "checkpoint")
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return out
