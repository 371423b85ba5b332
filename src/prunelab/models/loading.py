"""Resolve a model spec and load model + tokenizer + adapter.

Specs: an embedded name (``smollm2-135m``, ``minilm-l6``, ``gemma3-270m``), a local
checkpoint directory, a ``.gguf`` file, or a Hugging Face hub id. GGUF files are
de-quantized once by ``transformers`` and written to the cache as a normal safetensors
checkpoint (a model loaded from GGUF carries a quantizer and refuses ``save_pretrained``;
rebuilding it from its config and loading the state dict gives a plain model), so later
loads are fast and the model saves like any other.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prunelab.errors import ConfigError, ModelNotFoundError, UnsupportedArchitectureError
from prunelab.log import info
from prunelab.models.adapters import Adapter, get_adapter
from prunelab.models.embedded import EMBEDDED, resolve_embedded, sha256_file
from prunelab.models.families import family_for_model_type, supported_model_types
from prunelab.paths import cache_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready for prunelab: the HF module, its tokenizer and its adapter."""

    model: nn.Module
    tokenizer: Any
    spec: str
    source: str
    dtype: torch.dtype
    device: torch.device
    adapter: Adapter = field(init=False)
    history: list[dict] = field(default_factory=list)
    # Set (e.g. by ``load(..., offload=True)``): the weights stay where they are (the CPU)
    # and every BlockRunner built on this model computes block by block on this device.
    offload_to: torch.device | None = None

    def __post_init__(self) -> None:
        self.adapter = get_adapter(self.model)

    @property
    def is_encoder(self) -> bool:
        return self.adapter.is_encoder


def resolve_device(device: str | None) -> torch.device:
    """``cpu``, ``cuda[:N]`` or ``auto`` (cuda when available)."""
    name = (device or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: CUDA is not available on this machine")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"--device must be cpu, cuda or auto, got {device!r}")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``float32`` by default on CPU, ``bfloat16`` by default on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
    return DTYPES[dtype]


def _looks_like_path(spec: str) -> bool:
    return (spec.startswith((".", "/", "~")) or os.sep in spec and not _is_hub_id(spec)
            or spec.endswith(".gguf") or Path(spec).exists())


def _is_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not Path(spec).exists()


def convert_gguf(path: Path, name: str | None = None) -> Path:
    """De-quantize a GGUF file once into a normal checkpoint in the cache; return its dir."""
    import transformers

    key = name or f"gguf-{sha256_file(path)[:16]}"
    target = cache_dir() / "converted" / key
    if (target / "config.json").is_file():
        return target
    info(f"prunelab: converting {path.name} to a float checkpoint in {target} (once)")
    start = time.time()
    kw = dict(gguf_file=path.name)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
    quant = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **kw)
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quant.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise ModelNotFoundError(f"GGUF conversion of {path.name} lost weights: {missing[:3]}")
    plain.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key}-"))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info(f"prunelab: converted in {time.time() - start:.1f} s")
    return target


def _tied_keys(model: nn.Module) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if not isinstance(keys, dict) else set(keys)


def resolve_source(spec: str) -> Path | str:
    """A local checkpoint directory for ``spec``, or the hub id unchanged."""
    if spec in EMBEDDED:
        kind, path = resolve_embedded(spec)
        return convert_gguf(path, name=spec) if kind == "gguf" else path
    if _looks_like_path(spec):
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"model path {spec!r} does not exist")
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelNotFoundError(f"{spec!r} is a file but not a .gguf model")
            return convert_gguf(path.resolve())
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec!r} has no config.json (not a checkpoint directory)")
        return path
    return spec


def _load_config(source, trust_remote_code: bool):
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if isinstance(source, Path):
            raise ModelNotFoundError(
                f"cannot read the config in {source}: {_first_line(exc)}") from exc
        raise ModelNotFoundError(
            f"cannot find model {source!r} locally, in the hub cache or on the hub "
            f"({_first_line(exc)}); embedded models: {', '.join(EMBEDDED)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def load(spec: str, dtype: str | torch.dtype | None = "auto", device: str | None = "cpu",
         trust_remote_code: bool = False) -> LoadedModel:
    """Load the model named by ``spec`` with its tokenizer and adapter (eval mode).

    ``trust_remote_code`` stays off unless asked for.
    """
    import transformers

    from prunelab.log import is_quiet

    if is_quiet():
        transformers.utils.logging.disable_progress_bar()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    source = resolve_source(spec)
    cfg = _load_config(source, trust_remote_code)
    fam = family_for_model_type(getattr(cfg, "model_type", None))
    if fam is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {getattr(cfg, 'model_type', None)!r}; supported: "
            + ", ".join(supported_model_types())
        )
    cls = transformers.AutoModel if fam.encoder else transformers.AutoModelForCausalLM
    try:
        model = cls.from_pretrained(source, dtype=dt, trust_remote_code=trust_remote_code)
        tok = transformers.AutoTokenizer.from_pretrained(
            source, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load {spec!r}: {_first_line(exc)}") from exc
    model.to(dev).eval()
    return LoadedModel(model=model, tokenizer=tok, spec=spec, source=str(source),
                       dtype=dt, device=dev)


def wrap(model: nn.Module, tokenizer: Any = None, spec: str | None = None) -> LoadedModel:
    """Wrap an in-memory Hugging Face model so prunelab functions accept it."""
    param = next(model.parameters())
    name = spec or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return LoadedModel(model=model, tokenizer=tokenizer, spec=name, source=name,
                       dtype=param.dtype, device=param.device)
