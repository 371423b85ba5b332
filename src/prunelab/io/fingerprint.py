"""Fingerprints of resumable outputs: what a result was computed from.

A resumable output (a probe's ``NAME.partial.json``, a depth sweep's ``sweep.json``)
records a fingerprint, and a rerun resumes only when its own fingerprint matches;
otherwise it refuses in one line naming what differs (:class:`ResumeMismatchError`),
or, with ``overwrite=True``, the caller discards the stale state and starts afresh.

A fingerprint is a JSON dict of parts. Each part holds the values that are *compared*
and, beside them, descriptions kept only to explain a mismatch:

- ``prunelab``: the library version (compared: an algorithm may change between versions).
- ``model``: ``config_blake2b`` (the model config's ``to_dict()`` without volatile keys:
  private ``_*`` keys such as ``_name_or_path``, ``transformers_version``, the dtype) and
  ``weights_blake2b`` (every ``state_dict`` tensor's name, dtype, shape and bytes), both
  compared; ``spec``, ``source`` and ``model_type`` describe it. The same weights loaded
  under another path therefore resume, and a model modified in memory does not.
- ``dtype``: the parameters' dtype (compared).
- ``data`` (and ``test_data`` for a sweep): ``sha256`` of the token windows themselves
  (compared; it fixes spec, samples, seqlen and seed), with ``spec``, ``samples``,
  ``seqlen``, ``seed`` from the batches' ``to_dict()`` to describe a mismatch.
- ``options``: every option that changes the result (a probe's config dict; a sweep's
  strategy, window, seed), compared key by key.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prunelab._version import __version__
from prunelab.errors import ResumeMismatchError

FORMAT = "prunelab-fingerprint/1"
# parts compared, in the order a mismatch message lists them
PARTS = ("prunelab", "model", "dtype", "data", "test_data", "options")
MODEL_KEYS = ("config_blake2b", "weights_blake2b")
DATA_DESCRIPTORS = ("spec", "mode", "samples", "seqlen", "seed")
_VOLATILE = {"transformers_version", "torch_dtype", "dtype", "use_cache", "return_dict",
             "output_attentions", "output_hidden_states"}


def _blake2b_json(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def config_digest(config: Any) -> str:
    """blake2b of a model config's ``to_dict()`` without volatile keys (private ``_*``
    keys such as ``_name_or_path``, ``transformers_version``, the dtype, output flags)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return _blake2b_json(_strip(d))


def _strip(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _strip(v) for k, v in d.items()
                if not str(k).startswith("_") and k not in _VOLATILE}
    return d


def _tensor_bytes(t: torch.Tensor) -> memoryview | bytes:
    t = t.detach()
    if t.device.type == "meta":  # no values to hash (offloaded to disk by accelerate)
        return b""
    t = t.reshape(-1).contiguous().cpu()
    try:
        return memoryview(t.view(torch.uint8).numpy())
    except (RuntimeError, TypeError):  # dtypes without a byte view (quantized...)
        return t.to(torch.float64).numpy().tobytes()


def weights_digest(model: torch.nn.Module) -> str:
    """blake2b of every ``state_dict`` tensor: name, dtype, shape and raw bytes, in order.

    A tensor shared under several names (tied embeddings) is hashed once, later names
    record the alias. About 1 GB/s on one CPU core (SmolLM2-135M in float32: ~0.5 s).
    """
    h = hashlib.blake2b(digest_size=16)
    seen: dict[tuple, str] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        h.update(f"{name}|{str(t.dtype)}|{tuple(t.shape)}|".encode())
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() and t.device.type != "meta" and key in seen:
            h.update(f"alias:{seen[key]}|".encode())
            continue
        seen[key] = name
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def model_part(lm) -> dict[str, Any]:
    """The ``model`` part of a fingerprint for a :class:`~prunelab.models.loading.LoadedModel`."""
    cfg = lm.model.config
    return {"config_blake2b": config_digest(cfg), "weights_blake2b": weights_digest(lm.model),
            "spec": str(lm.spec), "source": str(getattr(lm, "source", lm.spec)),
            "model_type": getattr(cfg, "model_type", None)}


def data_part(input_ids: torch.Tensor, info: dict | None = None) -> dict[str, Any]:
    """The ``data`` part: sha256 of the windows ``[N, T]`` plus their description."""
    info = info or {}
    part = {"sha256": tensor_sha256(input_ids)}
    part.update({k: info.get(k) for k in DATA_DESCRIPTORS})
    part["samples"] = int(input_ids.shape[0])
    part["seqlen"] = int(input_ids.shape[-1])
    return part


def dtype_name(lm) -> str:
    return str(lm.dtype).replace("torch.", "")


def make_fingerprint(lm, input_ids: torch.Tensor, data_info: dict | None = None, *,
                     options: dict | None = None, model: dict | None = None,
                     **parts: Any) -> dict[str, Any]:
    """The fingerprint of a result computed from ``lm`` on ``input_ids`` with ``options``.

    ``model``: a precomputed :func:`model_part` (hashing weights costs ~1 s per GB).
    ``parts``: further parts (e.g. ``test_data=data_part(test_ids, info)``).
    """
    fp = {"format": FORMAT, "prunelab": __version__,
          "model": model if model is not None else model_part(lm),
          "dtype": dtype_name(lm), "data": data_part(input_ids, data_info),
          "options": json.loads(json.dumps(options or {}, default=list))}
    fp.update(parts)
    return fp


def differences(old: Any, new: dict) -> list[tuple[str, str]]:
    """``[(part, detail)]`` for every compared part where ``old`` and ``new`` differ;
    ``[]`` when they match. ``old`` may be anything read from a file."""
    if not isinstance(old, dict) or old.get("format") != FORMAT:
        return [("fingerprint", "none recorded: made by an older prunelab or not by "
                                "prunelab")]
    out: list[tuple[str, str]] = []
    for part in PARTS:
        a, b = old.get(part), new.get(part)
        if part == "model":
            a = a if isinstance(a, dict) else {}
            keys = [k for k in MODEL_KEYS if a.get(k) != b.get(k)]
            if old.get("dtype") != new.get("dtype") and keys == ["weights_blake2b"]:
                continue  # the dtype alone changes the bytes: reported as dtype
            if keys:
                what = " and ".join(k.split("_")[0] for k in keys)
                who = (f"of {b.get('spec')!r} differ" if a.get("spec") == b.get("spec")
                       else f"differ: {a.get('spec')!r} vs {b.get('spec')!r}")
                out.append(("model", f"model {what} {who}"))
        elif part in ("data", "test_data"):
            a = a if isinstance(a, dict) else {}
            b = b or {}
            if a.get("sha256") != b.get("sha256"):
                detail = _keys_diff(a, b, DATA_DESCRIPTORS) or "other tokens"
                label = part.replace("_", " ")
                out.append((label, f"{label}: {detail}"))
        elif part == "options":
            a = a if isinstance(a, dict) else {}
            if a != b:
                out.append(("options", "options: " + _keys_diff(a, b, sorted(set(a) | set(b)))))
        elif a != b:
            label = part if part != "prunelab" else "prunelab version"
            out.append((label, f"{label} {a} vs {b}"))
    return out


def _keys_diff(a: dict, b: dict, keys) -> str:
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))


def mismatch_message(path: Path | str, diffs: list[tuple[str, str]]) -> str:
    """One line: what ``path`` was made with and how to start afresh."""
    kinds = " / ".join(dict.fromkeys(p for p, _ in diffs))
    detail = "; ".join(d for _, d in diffs)
    return (f"{path} was made with another {kinds} ({detail}); pass --overwrite "
            "(overwrite=True) to start afresh")


def check_match(path: Path | str, stored: Any, current: dict, overwrite: bool) -> bool:
    """True when ``stored`` matches ``current``; False on a mismatch with ``overwrite``
    (the caller starts afresh); otherwise raise :class:`ResumeMismatchError`."""
    diffs = differences(stored, current)
    if not diffs:
        return True
    if overwrite:
        return False
    raise ResumeMismatchError(mismatch_message(path, diffs))


def same_source(a: Any, b: dict) -> bool:
    """Whether two fingerprints share prunelab version, model, dtype and data (options
    aside): results that may be compared side by side."""
    return not [p for p, _ in differences(a, b) if p not in ("options",)]


def tensor_sha256(ids: torch.Tensor) -> str:
    """Hex sha256 of a tensor's values as contiguous little-endian int64 bytes."""
    arr = np.ascontiguousarray(ids.detach().cpu().numpy(), dtype="<i8")
    return hashlib.sha256(arr.tobytes()).hexdigest()
