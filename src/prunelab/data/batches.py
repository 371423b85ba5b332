"""Token windows: turn a text source into fixed-length ``[N, seqlen]`` token batches.

The one rule, used for both evaluation and calibration data:

1. Join the source's documents with its joiner (``"\\n\\n"``, or ``" "`` for ``c4:test``).
2. Tokenize the whole text once with ``tokenizer(text, add_special_tokens=False)``. (The
   too-long-sequence warning is silenced with ``verbose=False``; the text is not chunked.)
3. Special tokens (``specials="auto"``, the default): every window is framed exactly as the
   tokenizer frames one sequence. The frame is found by encoding a probe string with and
   without ``add_special_tokens``: the ids before the plain ids are the ``prefix`` (Gemma's
   ``<bos>``, BERT's ``[CLS]``), those after are the ``suffix`` (BERT's ``[SEP]``). SmolLM2's
   tokenizer adds nothing, so its windows are pure text. Gemma is trained with a BOS at the
   start of every sequence and is far worse without one. ``specials="none"`` adds nothing.
4. Cut the token ids into non-overlapping bodies of ``seqlen - len(prefix) - len(suffix)``
   tokens from the start (the incomplete tail is dropped) and frame each:
   ``window = prefix + body + suffix`` is exactly ``seqlen`` tokens.
   ``total_windows = len(ids) // body_len``.
5. Pick windows:

   * ``test`` mode (the default unless the spec contains ``:calib``): the first ``samples``
     windows in order, or all of them when ``samples`` is None.
   * ``calib`` mode (the default when the spec contains ``:calib``): ``samples`` windows
     (default 128) drawn without replacement with
     ``torch.randperm(total_windows, generator=torch.Generator().manual_seed(seed))[:samples]``
     and then sorted ascending, so the result is deterministic and in text order.

The same source, tokenizer, seqlen, samples, seed, mode and specials always give identical
tokens; their sha256 (of the contiguous little-endian int64 tensor bytes) identifies the
data in manifests.
Asking for more windows than the text holds is a :class:`~prunelab.errors.DataError`.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from prunelab.data.sources import TextSource, load_text_source
from prunelab.errors import ConfigError, DataError
from prunelab.io.fingerprint import tensor_sha256

__all__ = [
    "DEFAULT_CALIB_SAMPLES",
    "TokenBatches",
    "make_batches",
    "special_frame",
    "tensor_sha256",
    "tokenize_source",
]

DEFAULT_CALIB_SAMPLES = 128
MODES = ("test", "calib")
_CACHE_SIZE = 4
# (id(tokenizer), name_or_path, sha256(text)) -> (weakref to the tokenizer, 1-D int64 ids)
_TOKEN_CACHE: OrderedDict[tuple, tuple[Any, torch.Tensor]] = OrderedDict()


@dataclass(frozen=True)
class TokenBatches:
    """Token windows ``input_ids`` of shape ``[samples, seqlen]`` and how they were made."""

    input_ids: torch.Tensor = field(repr=False, compare=False)
    spec: str
    seqlen: int
    samples: int
    seed: int | None
    mode: str
    total_windows: int
    sha256: str
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """Number of tokens in all windows (``samples * seqlen``)."""
        return self.samples * self.seqlen

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Yield ``[<=batch_size, seqlen]`` slices of :attr:`input_ids` in order."""
        _check_int("--batch-size", batch_size, 1)
        for start in range(0, self.samples, batch_size):
            yield self.input_ids[start : start + batch_size]

    def to_dict(self) -> dict[str, Any]:
        """Everything but the tokens themselves, for manifests."""
        return {
            "spec": self.spec,
            "mode": self.mode,
            "seqlen": self.seqlen,
            "samples": self.samples,
            "seed": self.seed,
            "total_windows": self.total_windows,
            "tokens": self.tokens,
            "sha256": self.sha256,
            "special_prefix": list(self.prefix),
            "special_suffix": list(self.suffix),
        }


def _check_int(option: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{option} must be an integer >= {minimum} (got {value!r})")


def _encode(tokenizer: Any, text: str, special: bool = False) -> torch.Tensor:
    try:
        out = tokenizer(text, add_special_tokens=special, verbose=False)
    except TypeError as exc:  # a minimal tokenizer without the ``verbose`` keyword
        if "verbose" not in str(exc):
            raise
        out = tokenizer(text, add_special_tokens=special)
    ids = out["input_ids"] if isinstance(out, Mapping) or hasattr(out, "keys") else out
    return torch.as_tensor(ids, dtype=torch.int64).reshape(-1)


_PROBE_TEXT = "The frame of one sequence."


def special_frame(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prefix, suffix)``: the special token ids the tokenizer puts around one sequence
    (step 3 of the rule), e.g. ``((2,), ())`` for Gemma, ``((101,), (102,))`` for BERT."""
    plain = _encode(tokenizer, _PROBE_TEXT).tolist()
    full = _encode(tokenizer, _PROBE_TEXT, special=True).tolist()
    if not plain:
        return (), ()
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(full[:start]), tuple(full[start + len(plain):])
    raise DataError("the tokenizer changes the text tokens when it adds special tokens; "
                    "cannot frame windows (use specials='none')")


def tokenize_source(tokenizer: Any, source: TextSource) -> torch.Tensor:
    """1-D int64 token ids of the joined source text (steps 1-2 of the rule), cached.

    A few recent results are kept in memory, keyed by the tokenizer object (held weakly),
    its ``name_or_path`` and the sha256 of the text; callers must not modify the result.
    """
    text = source.joiner.join(source.documents)
    if not text.strip():
        raise DataError(f"{source.name} has no text")
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    key = (id(tokenizer), str(getattr(tokenizer, "name_or_path", "")), digest)
    hit = _TOKEN_CACHE.get(key)
    if hit is not None and hit[0]() is tokenizer:
        _TOKEN_CACHE.move_to_end(key)
        return hit[1]
    ids = _encode(tokenizer, text)
    try:
        ref = weakref.ref(tokenizer)
    except TypeError:  # not weak-referenceable: do not cache
        return ids
    _TOKEN_CACHE[key] = (ref, ids)
    while len(_TOKEN_CACHE) > _CACHE_SIZE:
        _TOKEN_CACHE.popitem(last=False)
    return ids


def make_batches(
    tokenizer: Any,
    source: TextSource | str,
    seqlen: int = 512,
    samples: int | None = None,
    seed: int = 0,
    mode: str | None = None,
    specials: str = "auto",
) -> TokenBatches:
    """Token windows of ``source`` by the rule in the module docstring (``specials``:
    ``"auto"`` frames every window as the tokenizer frames a sequence, ``"none"`` not)."""
    _check_int("--seqlen", seqlen, 2)
    if samples is not None:
        _check_int("--samples", samples, 1)
    if specials not in ("auto", "none"):
        raise ConfigError(f"specials must be 'auto' or 'none' (got {specials!r})")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"mode must be 'test' or 'calib' (got {mode!r})")
    if isinstance(source, str):
        source = load_text_source(source)
    if mode is None:
        mode = "calib" if ":calib" in source.name else "test"
    if mode == "calib":
        _check_int("--seed", seed, 0)
        if samples is None:
            samples = DEFAULT_CALIB_SAMPLES

    ids = tokenize_source(tokenizer, source)
    prefix, suffix = special_frame(tokenizer) if specials == "auto" else ((), ())
    body = seqlen - len(prefix) - len(suffix)
    if body < 1:
        raise ConfigError(f"--seqlen {seqlen} leaves no room for text after the "
                          f"{len(prefix) + len(suffix)} special tokens of each window")
    total = ids.numel() // body
    if total == 0:
        raise DataError(f"{source.name} gives {ids.numel()} tokens, less than one window of "
                        f"{seqlen} tokens; use a shorter --seqlen or more text")
    if samples is None:
        samples = total
    if samples > total:
        raise DataError(f"{source.name} gives only {total} windows of {seqlen} tokens; ask for "
                        f"--samples {total} or fewer (or a shorter --seqlen)")
    windows = ids[: total * body].view(total, body)
    if prefix or suffix:
        windows = torch.cat([torch.tensor(prefix, dtype=torch.int64).expand(total, -1),
                             windows,
                             torch.tensor(suffix, dtype=torch.int64).expand(total, -1)], dim=1)
    if mode == "test":
        chosen = windows[:samples].clone()
        used_seed = None
    else:
        gen = torch.Generator().manual_seed(seed)
        picks = torch.randperm(total, generator=gen)[:samples].sort().values
        chosen = windows[picks]
        used_seed = seed
    chosen = chosen.contiguous()
    return TokenBatches(
        input_ids=chosen,
        spec=source.name,
        seqlen=seqlen,
        samples=samples,
        seed=used_seed,
        mode=mode,
        total_windows=total,
        sha256=tensor_sha256(chosen),
        prefix=prefix,
        suffix=suffix,
    )
