"""Resolve a model spec and load model + tokenizer + adapter.

Specs: an embedded name (``smollm2-135m``, ``minilm-l6``, ``gemma3-270m``), a local
checkpoint directory, a ``.gguf`` file, or a Hugging Face hub id. GGUF files are
de-quantized once by ``transformers`` and written to the cache as a normal safetensors
checkpoint (a model loaded from GGUF carries a quantizer and refuses ``save_pretrained``;
rebuilding it from its config and loading the state dict gives a plain model), so later
loads are fast and the model saves like any other.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError
from torch import nn

from prunelab import interrupts
from prunelab.errors import (
    ConfigError,
    CorruptCheckpointError,
    MissingWeightsError,
    ModelNotFoundError,
    PickleRefusedError,
    UnsupportedArchitectureError,
    UnsupportedOperationError,
)
from prunelab.io.hub import offline_reason
from prunelab.log import info, is_quiet, warn
from prunelab.models import gguf_stream
from prunelab.models.adapters import Adapter, get_adapter
from prunelab.models.conversion import GGUF_ERRORS, first_line, publish_checkpoint, short_names
from prunelab.models.embedded import EMBEDDED, sha256_file
from prunelab.models.families import family_for_model_type, supported_model_types
from prunelab.models.gguf_llama import gguf_architecture, load_deci
from prunelab.models.resolve import resolve_embedded
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
    # Set (``--calib-dtype bfloat16``): calibration runs the blocks' matmuls in this dtype
    # (BlockRunner); weights, statistics and the saved model keep the model's dtype.
    calib_dtype: torch.dtype | None = None

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
    if name == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:\d+)?", name):
        raise ConfigError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available on this machine")
    dev = torch.device(name)
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"--device {device}: this machine has {count} CUDA device"
                          f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``float32`` by default on CPU, ``bfloat16`` by default on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
    return DTYPES[dtype]


def resolve_calib_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``--calib-dtype``: ``float32`` (or None: the model's own dtype, the default) or
    ``bfloat16`` (the blocks' matmuls in bfloat16 during calibration)."""
    if name is None or name in ("float32", torch.float32):
        return None
    if name in ("bfloat16", torch.bfloat16):
        return torch.bfloat16
    raise ConfigError(f"--calib-dtype must be float32 or bfloat16, got {name!r}")


def _looks_like_path(spec: str) -> bool:
    return (spec.startswith((".", "/", "~")) or os.sep in spec and not _is_hub_id(spec)
            or spec.endswith(".gguf") or Path(spec).exists())


def _is_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not Path(spec).exists()




def _deci_file(spec: str) -> Path | None:
    """The path of ``spec`` when it is a ``.gguf`` file of llama.cpp's ``deci``
    architecture (per-block widths: :mod:`prunelab.models.gguf_llama`)."""
    if not isinstance(spec, str) or not spec.endswith(".gguf"):
        return None

    path = Path(spec).expanduser()
    return path.resolve() if path.is_file() and gguf_architecture(path) == "deci" else None


def convert_gguf(path: Path, name: str | None = None) -> Path:
    """De-quantize a GGUF file once into a normal checkpoint in the cache; return its dir.

    The checkpoint is written to a temp folder and renamed into place; a complete copy
    that appeared meanwhile (another process converting the same file) is kept and this
    one discarded, so a reader never sees the cached checkpoint vanish. An unreadable
    file (empty, garbage, unsupported) is a one-line CorruptCheckpointError.
    """
    try:
        key = name or f"gguf-{sha256_file(path)[:16]}"
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read {path}: {first_line(exc)}") from exc
    target = cache_dir() / "converted" / key
    if (target / "config.json").is_file():
        return target

    if gguf_architecture(path) == "deci":
        raise UnsupportedOperationError(
            f"{path.name} is a deci GGUF file (per-block widths): it loads in memory only, "
            "not streamed or converted; drop --stream")
    info(f"prunelab: converting {path.name} to a float checkpoint in {target} (once)")
    start = time.time()
    if gguf_stream.convert_gguf_streamed(path, target):  # one tensor at a time
        info(f"prunelab: converted in {time.time() - start:.1f} s")
        return target
    kw = dict(gguf_file=path.name)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, **kw)
        quant, loading_info = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=torch.float32, output_loading_info=True, **kw)
    except GGUF_ERRORS as exc:
        raise CorruptCheckpointError(
            f"{path.name} is not a readable GGUF model: {first_line(exc)}") from exc
    lost = sorted(set(loading_info["missing_keys"]) - _tied_keys(quant))
    if lost:
        raise CorruptCheckpointError(
            f"{path.name} lacks {len(lost)} weights its metadata declares ({short_names(lost)})")
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):  # no second float copy: the tensors are moved over
        plain = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quant.state_dict(), strict=False, assign=True)
    del quant
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise CorruptCheckpointError(
            f"GGUF conversion of {path.name} lost weights: {short_names(missing + unexpected)}")
    plain.tie_weights()

    def write(tmp: Path) -> None:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    publish_checkpoint(target, write)
    info(f"prunelab: converted in {time.time() - start:.1f} s")
    return target


def _tied_keys(model: nn.Module) -> set[str]:
    keys = set()
    for attr in ("_tied_weights_keys", "all_tied_weights_keys"):
        keys |= set(getattr(model, attr, None) or ())
    return keys


def check_model_path(spec: str) -> None:
    """The one-line error :func:`resolve_source` gives for a path-like ``spec`` that names
    nothing on disk, without resolving anything (for commands that check an optional
    dependency before loading: the missing model is said first)."""
    if spec not in EMBEDDED and _looks_like_path(spec) and \
            not Path(spec).expanduser().exists():
        raise ModelNotFoundError(f"model path {spec!r} does not exist")


def resolve_source(spec: str) -> Path | str:
    """A local checkpoint directory for ``spec``, or the hub id unchanged."""
    if spec in EMBEDDED:
        kind, path = resolve_embedded(spec)
        return convert_gguf(path, name=spec) if kind == "gguf" else path
    if _looks_like_path(spec):
        check_model_path(spec)
        path = Path(spec).expanduser()
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelNotFoundError(f"{spec!r} is a file but not a .gguf model")
            return convert_gguf(path.resolve())
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{spec!r} has no config.json (not a checkpoint directory)")
        return path
    offline_reason()  # a hub id: offline (decided once), the hub libraries read the cache only
    return spec


def _load_config(source, trust_remote_code: bool):
    """The model's config, checked (:func:`check_config_fields`) before any model is built:
    the raw ``config.json`` of a local checkpoint, then the parsed config of any source."""
    if isinstance(source, Path):
        check_config_fields(_read_config_json(source / "config.json"),
                            str(source / "config.json"))
    try:
        cfg = transformers.AutoConfig.from_pretrained(source,
                                                      trust_remote_code=trust_remote_code)
    except _config_validation_errors() as exc:  # transformers' typed, validated configs
        raise CorruptCheckpointError(
            f"{_config_name(source)}: {_validation_reason(exc)}") from exc
    except (OSError, ValueError) as exc:
        if isinstance(source, Path):
            raise ModelNotFoundError(
                f"cannot read the config in {source}: {first_line(exc)}") from exc
        offline = offline_reason()
        if offline is not None:
            raise ModelNotFoundError(
                f"model {source!r} is not an embedded model, a local checkpoint or in the hub "
                f"cache, and this machine is offline ({offline}); embedded models: "
                f"{', '.join(EMBEDDED)}") from exc
        raise ModelNotFoundError(
            f"cannot find model {source!r} locally, in the hub cache or on the hub "
            f"({first_line(exc)}); embedded models: {', '.join(EMBEDDED)}"
        ) from exc
    check_config_fields(cfg.to_dict(), _config_name(source))
    return cfg


#: Config fields that hold a count or a size: a positive integer (or null where a family
#: allows it), never a string, a float or a list, at any depth of the config.
SIZE_FIELDS = frozenset({
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "vocab_size", "head_dim",
    "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "n_ctx", "ffn_dim",
    "word_embed_proj_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "sliding_window",
    "encoder_layers", "decoder_layers", "d_model", "encoder_attention_heads",
    "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "num_mel_bins",
    "max_source_positions", "max_target_positions", "image_size", "patch_size",
    "num_channels", "query_pre_attn_scalar", "type_vocab_size", "mlp_ratio"})
_MAY_BE_FLOAT = frozenset({"mlp_ratio", "query_pre_attn_scalar"})


def _read_config_json(path: Path) -> dict:
    """The raw ``config.json`` (Python's reader keeps ``NaN`` / ``Infinity``): a JSON object,
    else a one-line :class:`~prunelab.errors.CorruptCheckpointError`."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"{path} is not UTF-8 text ({exc.reason} at byte "
                                     f"{exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({exc.msg}, line "
                                     f"{exc.lineno})") from exc
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read {path}: {first_line(exc)}") from exc
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(
            f"{path} must hold a JSON object, got a {type(raw).__name__}")
    return raw


def check_config_fields(cfg: dict, where: str, prefix: str = "") -> None:
    """Refuse, in one line naming the field, a config whose sizes and counts
    (:data:`SIZE_FIELDS`) are not positive integers (``"4"``, ``4.0``, ``[32]``, ``-48``,
    ``true``), or that holds a NaN or infinite number anywhere (``rms_norm_eps: NaN``
    would make every output NaN). Nested configs (``text_config``, ...) are checked too."""
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            check_config_fields(value, where, f"{name}.")
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise CorruptCheckpointError(f"{where}: {name} is {value}; a model needs finite "
                                         "numbers")
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, float) and not math.isfinite(v):
                    raise CorruptCheckpointError(f"{where}: {name}[{i}] is {v}; a model "
                                                 "needs finite numbers")
        if key not in SIZE_FIELDS or value is None:
            continue
        number = (int, float) if key in _MAY_BE_FLOAT else (int,)
        if isinstance(value, bool) or not isinstance(value, number):
            kind = "a positive number" if key in _MAY_BE_FLOAT else "a positive integer"
            raise CorruptCheckpointError(
                f"{where}: {name} must be {kind}, got {json_repr(value)} "
                f"({type(value).__name__})")
        if value < 0 or value == 0 and key not in ("sliding_window", "num_hidden_layers"):
            raise CorruptCheckpointError(f"{where}: {name} must be positive, got {value}")


def model_positions(config) -> int | None:
    """The positions a model was trained on (``max_position_embeddings``, GPT-2's
    ``n_positions``, ``n_ctx``; the text config of a multimodal one), or ``None``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(text, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def json_repr(value) -> str:
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def _config_validation_errors() -> tuple[type, ...]:
    """The errors of transformers' strict config dataclasses: a field of the wrong type
    (``TypeError``) or a class validator refusing the shapes (huggingface_hub's
    ``StrictDataclassError``, e.g. a hidden size no multiple of the heads)."""
    try:
        from huggingface_hub.errors import StrictDataclassError  # noqa: PLC0415 - optional
    except ImportError:
        return (TypeError,)
    return (TypeError, StrictDataclassError)


def _validation_reason(exc: BaseException) -> str:
    """The reason of a config validation error in one line: the cause's message
    (``The hidden size (33) is not a multiple of ...``), else the last line of the text."""
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        return first_line(cause)
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1][:200] if lines else type(exc).__name__


def load(spec: str, dtype: str | torch.dtype | None = "auto", device: str | None = "cpu",
         trust_remote_code: bool = False, allow_pickle: bool = False,
         allow_missing_weights: bool = False) -> LoadedModel:
    """Load the model named by ``spec`` with its tokenizer and adapter (eval mode).

    ``trust_remote_code`` stays off unless asked for. Weights stored only as a pickle
    (``pytorch_model.bin``) are refused unless ``allow_pickle`` (then torch's restricted
    weights-only loader reads them). A checkpoint whose weights do not match its config
    (missing, unexpected or mis-shaped tensors; tied weights excepted) is an error unless
    ``allow_missing_weights``: transformers would fill the gaps with random values.
    Unreadable files raise :class:`~prunelab.errors.CorruptCheckpointError` in one line.
    """
    if is_quiet():
        transformers.utils.logging.disable_progress_bar()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    deci = _deci_file(spec)
    if deci is not None:  # llama.cpp's per-block form: no transformers reader, built here

        model, tok, operations = load_deci(deci, dt)
        lm = LoadedModel(model=model.to(dev), tokenizer=tok, spec=spec, source=str(deci),
                         dtype=dt, device=dev)
        lm.history.extend(op for op in operations if isinstance(op, dict))
        return lm
    source = resolve_source(spec)
    cfg = _load_config(source, trust_remote_code)
    fam = family_for_model_type(getattr(cfg, "model_type", None))
    if fam is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {getattr(cfg, 'model_type', None)!r}; supported: "
            + ", ".join(supported_model_types())
        )
    _check_blocks(cfg, source)
    if isinstance(source, Path):
        _check_weight_files(source, allow_pickle)
    tok = None if fam.modality == "vision" else \
        _load_tokenizer(source, spec, trust_remote_code)
    cls = transformers.AutoModel if fam.encoder else transformers.AutoModelForCausalLM
    cls = getattr(transformers, fam.model_class) if fam.model_class else cls
    model, loading_info = _load_weights(cls, source, spec, dt, trust_remote_code, allow_pickle)
    _check_loading_info(model, loading_info, spec, fam.encoder, allow_missing_weights)
    model.to(dev).eval()
    interrupts.check()  # a Ctrl-C the lazy imports of the model's code swallowed
    return LoadedModel(model=model, tokenizer=tok, spec=spec, source=str(source),
                       dtype=dt, device=dev)


# ---------------------------------------------------------------- load boundary checks

_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_PICKLE_WHY = ("a pickle can run code when it is loaded, so prunelab refuses it: convert it "
               "to safetensors, or pass --allow-pickle (allow_pickle=True) to read it with "
               "torch's restricted weights-only loader")


def _check_blocks(cfg, source) -> None:
    """A config that declares no blocks is refused."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(text, "num_hidden_layers", None)
    if isinstance(n, int) and n < 1:
        raise CorruptCheckpointError(
            f"{_config_name(source)} declares {n} blocks (num_hidden_layers); a model needs "
            "at least one")


def _config_name(source) -> str:
    return str(source / "config.json") if isinstance(source, Path) else f"{source}'s config"


def _check_weight_files(path: Path, allow_pickle: bool) -> None:
    """A local checkpoint has safetensors weights, or pickle weights and ``allow_pickle``."""
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return
    pickles = [n for n in _PICKLE_WEIGHTS if (path / n).is_file()]
    if pickles and not allow_pickle:
        raise PickleRefusedError(f"{path} stores its weights only as a pickle ({pickles[0]}): "
                                 + _PICKLE_WHY)
    if not pickles:
        raise ModelNotFoundError(f"{path} holds no weights (no model.safetensors)")


def _load_tokenizer(source, spec: str, trust_remote_code: bool):
    """The tokenizer of ``source``; missing or unreadable files are one-line errors."""
    try:
        return transformers.AutoTokenizer.from_pretrained(
            source, trust_remote_code=trust_remote_code)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        if type(exc) is not Exception and not isinstance(exc, _TOKENIZER_ERRORS):
            raise
        err = CorruptCheckpointError if isinstance(source, Path) else ModelNotFoundError
        raise err(f"cannot load the tokenizer of {spec!r} (missing or corrupt tokenizer "
                  f"files): {first_line(exc)}") from exc


_TOKENIZER_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError)


def _load_weights(cls, source, spec: str, dt: torch.dtype, trust_remote_code: bool,
                  allow_pickle: bool):
    """``(model, loading_info)``; shape mismatches are reported, not raised, by
    transformers here (``ignore_mismatched_sizes``) and judged by the caller."""
    kw = dict(dtype=dt, trust_remote_code=trust_remote_code, output_loading_info=True,
              ignore_mismatched_sizes=True)
    if not allow_pickle:
        kw["use_safetensors"] = True  # never fall back to pytorch_model.bin
    try:
        return cls.from_pretrained(source, **kw)
    except torch.OutOfMemoryError:
        raise
    except OSError as exc:
        if not isinstance(source, Path):
            if not allow_pickle and "safetensors" in str(exc):
                raise PickleRefusedError(
                    f"{spec!r} has no safetensors weights (only pickle weights?): "
                    + _PICKLE_WHY) from exc
            raise ModelNotFoundError(f"cannot load {spec!r}: {first_line(exc)}") from exc
        raise CorruptCheckpointError(f"cannot read the weights in {source}: "
                                     f"{first_line(exc)}") from exc
    except pickle.UnpicklingError as exc:
        raise CorruptCheckpointError(
            f"{_weights_name(source)} of {spec!r} was refused by torch's restricted "
            f"(weights-only) loader: it holds more than tensors or is corrupt "
            f"({first_line(exc)[:80]})") from exc
    except (SafetensorError, EOFError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"cannot read the weights of {spec!r} "
                                     f"({_weights_name(source)}): {first_line(exc)}") from exc


def _weights_name(source) -> str:
    if isinstance(source, Path):
        names = sorted(p.name for p in source.iterdir()
                       if p.suffix in (".safetensors", ".bin") and p.is_file())
        if len(names) == 1:
            return names[0]
        if names:
            return f"{names[0]} (and {len(names) - 1} more weight files)"
    return "the weight files"


def _check_loading_info(model: nn.Module, loading_info: dict, spec: str, encoder: bool,
                        allow: bool) -> None:
    """Refuse missing, unexpected or mis-shaped weights (transformers would leave them
    random), naming them; tied weights are not missing. For encoders loaded without a
    task head, the checkpoint's heads (``cls.*``, ``classifier.*``) are not unexpected
    and a missing pooler is only noted (prunelab mean-pools and never uses it)."""
    if loading_info.get("error_msgs"):
        raise CorruptCheckpointError(f"cannot load the weights of {spec!r}: "
                                     f"{first_line(Exception(loading_info['error_msgs'][0]))}")
    missing = sorted(set(loading_info["missing_keys"]) - _tied_keys(model))
    unexpected = sorted(loading_info["unexpected_keys"])
    mismatched = sorted(loading_info["mismatched_keys"])
    if encoder:
        children = {name for name, _ in model.named_children()}
        unexpected = [k for k in unexpected if k.split(".")[0] in children]
        if any(k.startswith("pooler.") for k in missing):
            info(f"prunelab: {spec} has no pooler weights; prunelab mean-pools and does not "
                 "use the pooler (it stays random)")
            missing = [k for k in missing if not k.startswith("pooler.")]
    known = set(model.state_dict())
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing ({short_names(missing, known, whole=True)})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected ({short_names(unexpected, known)})")
    if mismatched:
        shown = ", ".join(f"{k} is {list(a)} in the checkpoint but {list(b)} in the config"
                          for k, a, b in mismatched[:2])
        more = f" and {len(mismatched) - 2} more" if len(mismatched) > 2 else ""
        problems.append(f"{len(mismatched)} of the wrong shape ({shown}{more})")
    if not problems:
        return
    text = f"{spec}: the weights do not match the config: " + "; ".join(problems)
    if allow:
        warn(f"{text}; they were initialised at random (allow_missing_weights)")
        return
    raise MissingWeightsError(f"{text}; they would be random values: pass "
                              "--allow-missing-weights (allow_missing_weights=True) to load anyway")


def wrap(model: nn.Module, tokenizer: Any = None, spec: str | None = None) -> LoadedModel:
    """Wrap an in-memory Hugging Face model so prunelab functions accept it."""
    param = next(model.parameters())
    name = spec or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return LoadedModel(model=model, tokenizer=tokenizer, spec=name, source=name,
                       dtype=param.dtype, device=param.device)
