"""Public verbs: ``load``, ``info``, ``tokens_for``, ``evaluate``, ``probe``, ``prune``,
``heal``, ``save``.

The CLI is a thin face over these functions; everything it does can be done from Python.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

import prunelab.pruning  # noqa: F401 - the methods' custom modules and save hooks register
from prunelab.calib.streamed import check_streamed_eval, score_windows_streamed, streamed_prune
from prunelab.checkpoint.save import build_manifest
from prunelab.checkpoint.save import save as _save
from prunelab.checkpoint.stream_save import save_streamed
from prunelab.data import TokenBatches, make_batches
from prunelab.data.images import ImageBatches, images_for
from prunelab.data.speech import feature_batches
from prunelab.errors import ConfigError, UnsupportedOperationError
from prunelab.eval.embedding import SentenceBatch, score_sentences, sentence_batch
from prunelab.eval.gradient_alignment import gradient_alignment
from prunelab.eval.perplexity import check_continuation, score_windows
from prunelab.eval.speech import evaluate_speech
from prunelab.eval.speed import measure_speed
from prunelab.eval.tasks import check_tasks, evaluate_tasks
from prunelab.eval.vision import evaluate_vision
from prunelab.heal import heal as run_heal
from prunelab.io.manifest import source_manifest
from prunelab.models.custom import flops_per_token
from prunelab.models.linear import in_out_features
from prunelab.models.loading import LoadedModel, resolve_calib_dtype, resolve_device, wrap
from prunelab.models.loading import load as _load
from prunelab.models.size import model_size
from prunelab.models.streaming import load_streamed
from prunelab.models.vocab import check_token_ids
from prunelab.models.whisper import use_stack
from prunelab.probes import run_probes
from prunelab.probes.base import check_streamable_probes
from prunelab.pruning import pruner_for
from prunelab.pruning.base import PruneReport, check_composable, config_dict, method_name
from prunelab.pruning.factor.config import factorized_modules
from prunelab.train.config import HealConfig


def load(spec: str, dtype: str | torch.dtype | None = "auto", device: str | None = "cpu",
         trust_remote_code: bool = False, offload: bool = False, allow_pickle: bool = False,
         allow_missing_weights: bool = False, stream: bool = False,
         stack: str | None = None, calib_dtype: str | None = None) -> LoadedModel:
    """Load a model by spec: ``smollm2-135m``, ``minilm-l6``, ``gemma3-270m``, a local
    checkpoint directory, a ``.gguf`` file or a hub id. Returns a :class:`LoadedModel`
    (``.model``, ``.tokenizer``, ``.adapter``).

    ``offload=True``: the weights are loaded on the CPU and stay there; calibration (every
    probe's and pruner's block runner, and the pruning maths of the block in turn) moves
    one block at a time to ``device``, so a model larger than the accelerator can be
    probed and pruned. Whole-model evaluations then run on the CPU.

    ``allow_pickle=True`` reads weights stored only as a pickle (``pytorch_model.bin``)
    with torch's restricted loader (refused by default: a pickle can run code).
    ``allow_missing_weights=True`` loads a checkpoint whose weights do not match its
    config (missing, unexpected or mis-shaped tensors), leaving those weights random
    (an error by default).

    ``stream=True``: layer-wise loading from disk (:mod:`prunelab.models.streaming`): the
    blocks stay in the safetensors shards and are read one at a time when needed.
    ``stack``: ``encoder`` / ``decoder`` for Whisper (which stack probes and pruning act
    on; default encoder). ``calib_dtype="bfloat16"``: every calibration of this model runs
    the blocks' matmuls in bfloat16 (see :func:`prune`)."""
    calib = resolve_calib_dtype(calib_dtype)  # a bad value before the model loads
    lm = _load_any(spec, dtype, device, trust_remote_code, offload, allow_pickle,
                   allow_missing_weights, stream, stack)
    lm.calib_dtype = calib
    return lm


def _load_any(spec, dtype, device, trust_remote_code, offload, allow_pickle,
              allow_missing_weights, stream, stack) -> LoadedModel:
    if stream:
        if allow_missing_weights or allow_pickle:
            raise ConfigError("--stream reads complete safetensors shards: it does not take "
                              "--allow-missing-weights or --allow-pickle")
        if stack is not None:
            raise ConfigError("--stream streams causal LMs; it does not take --stack")
        return load_streamed(spec, dtype=dtype, device=device,
                             trust_remote_code=trust_remote_code)

    target = resolve_device(device) if offload else None
    lm = _load(spec, dtype=dtype, device="cpu" if offload else device,
               trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
               allow_missing_weights=allow_missing_weights)
    lm.offload_to = target
    lm.size_before = model_size(lm.model)
    if stack is not None:  # multi-stack models (Whisper): encoder or decoder
        use_stack(lm, stack)
    return lm


def _as_loaded(model, tokenizer=None) -> LoadedModel:
    return model if isinstance(model, LoadedModel) else wrap(model, tokenizer)


def info(model) -> dict[str, Any]:
    """Architecture summary: family, blocks, hidden size, heads, KV heads, head dim, FFN
    width, parameters and bytes, FLOPs per token (linear maps only), per block its
    attention/MLP projection shapes (``[d_out, d_in]``; a factorized projection shows the
    shape it stands for) and attention type, and ``factorized``: every prunelab custom
    module (factors, shared dictionaries, shortcut maps) with its kind and shapes."""
    lm = _as_loaded(model)
    ad = lm.adapter
    geo = ad.head_geometry(ad.first_block_with("attention"))
    types = ad.layer_types()
    blocks = []
    for i in range(ad.num_blocks):  # a removed branch (sub-block pruning) shows as such
        attn, mlp = ad.has_branch(i, "attention"), ad.has_branch(i, "mlp")
        g = ad.head_geometry(i) if attn else None
        blocks.append({
            "index": i,
            "attention_type": types[i] if types else "full_attention",
            "heads": g.num_heads if g else 0, "kv_heads": g.num_kv_heads if g else 0,
            "ffn": ad.ffn_width(i) if mlp else 0,
            "attention": {r: list(in_out_features(m))[::-1]
                          for r, m in ad.attn_projections(i).items()} if attn else "removed",
            "mlp": {r: list(in_out_features(m))[::-1]
                    for r, m in ad.mlp_projections(i).items()} if mlp else "removed",
        })
    size = model_size(lm.model)
    return {
        "flops_per_token": flops_per_token(lm.model),
        "factorized": factorized_modules(lm.model),
        "model": lm.spec, "source": lm.source, "family": ad.family,
        "model_type": lm.model.config.model_type, "encoder": ad.is_encoder,
        "blocks": ad.num_blocks, "hidden_size": ad.hidden_size(),
        "heads": geo.num_heads, "kv_heads": geo.num_kv_heads, "gqa_group_size": geo.group_size,
        "head_dim": geo.head_dim, "ffn": ad.ffn_width(ad.first_block_with("mlp")),
        "gated_mlp": ad.is_gated(),
        "vocab_size": int(getattr(lm.model.config, "vocab_size", 0) or 0),
        "tied_embeddings": bool(getattr(lm.model.config, "tie_word_embeddings", False)),
        "dtype": str(lm.dtype).replace("torch.", ""), "device": str(lm.device),
        "params": size["params"], "bytes": size["bytes"], "block_details": blocks,
    }


def tokens_for(lm: LoadedModel, data, seqlen: int = 512, samples: int | None = None,
               seed: int = 0, mode: str | None = None) -> TokenBatches:
    """Token windows for ``data`` (a spec string or :class:`TokenBatches`); ids the model
    cannot embed are a one-line :class:`ConfigError` (:func:`check_token_ids`)."""
    if isinstance(data, TokenBatches):
        check_token_ids(lm, data.input_ids, "the token batches")
        return data
    if lm.adapter.is_vision:  # pixel batches: images:calib|test, lfw:calib|test
        if isinstance(data, str) and data.startswith("wiki-vital"):  # the text default
            data = f"images:{mode or 'calib'}"
        return data if isinstance(data, ImageBatches) else \
            images_for(data, samples=samples, seed=seed, mode=mode)
    if getattr(lm.adapter.spec, "entry", None) is not None:  # speech encoder: log-mel inputs
        return feature_batches(lm, data, samples=samples, seed=seed, mode=mode)
    if lm.tokenizer is None:
        raise ConfigError("this model has no tokenizer: pass token batches instead of a spec")
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if isinstance(seqlen, int) and isinstance(limit, int) and 0 < limit < seqlen:
        raise ConfigError(f"--seqlen {seqlen} is beyond the {limit} positions of {lm.spec}")
    batches = make_batches(lm.tokenizer, data, seqlen=seqlen, samples=samples, seed=seed,
                           mode=mode)
    check_token_ids(lm, batches.input_ids, f"--data {data}")
    return batches


def evaluate(model, data="wiki-vital:test", seqlen: int = 512, samples: int | None = None,
             batch_size: int = 4, reference=None, speed: bool = False, seed: int = 0,
             tokenizer=None, reference_cache: dict | None = None,
             trust_remote_code: bool = False, allow_pickle: bool = False,
             allow_missing_weights: bool = False, gradient_reference=None,
             gradient_params: str = "down_proj", tasks: str | list[str] | None = None,
             limit: int | None = None, continuation: int | None = None) -> dict[str, Any]:
    """Evaluate a model on held-out data.

    Causal LMs (protocol in :mod:`prunelab.eval.perplexity`): ``perplexity``, ``tokens``
    (scored tokens), ``seqlen``, ``samples``, ``params``, ``bytes``; with ``reference`` (a
    loaded model or spec) also ``kl_to_reference`` and ``top1_agreement``; with ``speed``
    also ``prefill_tokens_per_s``, ``decode_tokens_per_s`` and ``peak_memory_bytes``.

    Speech models (Whisper; :mod:`prunelab.eval.speech`): ``wer`` (greedy decoding),
    ``real_time_factor``...; ``data`` a speech spec or folder (default ``speech``).

    Encoders (protocol in :mod:`prunelab.eval.embedding`): ``samples`` held-out sentences
    (default 512) truncated to ``seqlen`` tokens, mean-pooled; ``same_document_nn``, and
    with ``reference`` ``mean_cosine_to_reference`` and ``nn_agreement``.
    ``reference_cache``: a dict keeping the reference's outputs between calls.
    ``trust_remote_code``, ``allow_pickle``, ``allow_missing_weights``: passed to
    :func:`load` when ``reference`` is a spec. ``gradient_reference`` (a loaded causal LM
    or spec; may be ``reference``): also ``gradient_alignment`` and
    ``gradient_alignment_per_block``, the per-window gradient cosine with respect to each
    block's ``gradient_params`` linear (:mod:`prunelab.eval.gradient_alignment`).
    ``tasks`` (causal LMs; names, ``.jsonl`` files or folders, comma-separated) adds
    ``tasks``: per task ``acc``, ``acc_norm``, their ``_stderr`` and ``n`` over at most
    ``limit`` items each (:mod:`prunelab.eval.tasks`).

    Under an inference-time press (called inside ``with prunelab.press(lm, ...)``) the
    figures of the continuation, the positions each window scores on the pressed cache
    (the last ``T - session.split(T)``), are added beside the whole-window ones:
    ``continuation`` (positions per window), ``continuation_perplexity``,
    ``continuation_nll``, ``continuation_tokens``, and with ``reference``
    ``continuation_kl_to_reference`` and ``continuation_top1_agreement``
    (:mod:`prunelab.eval.perplexity`). ``continuation=N`` scores the last ``N`` positions
    so without a press too (the dense baseline of the same positions); under a press it
    must equal the press' continuation.
    """
    lm = _as_loaded(model, tokenizer)
    if tasks is not None:
        check_tasks(lm, tasks, limit)  # user errors before any scoring
    elif limit is not None:
        raise ConfigError("--limit counts task items: it needs --tasks")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if getattr(lm, "streamer", None) is not None:
        check_streamed_eval(speed=speed, gradient_alignment=gradient_reference)
    if lm.adapter.is_vision:  # photos + LFW probe + images/s (prunelab.eval.vision)
        return _evaluate_vision(lm, data, samples, batch_size, reference, reference_cache,
                                dict(trust_remote_code=trust_remote_code,
                                     allow_pickle=allow_pickle,
                                     allow_missing_weights=allow_missing_weights))
    if getattr(lm.model.config, "model_type", None) == "whisper":  # speech: WER, RTF
        return evaluate_speech(lm, "speech" if data == "wiki-vital:test" else data,
                               samples=samples, batch_size=batch_size)
    ref = None
    if reference is not None:
        ref = reference if isinstance(reference, LoadedModel) else \
            load(reference, dtype=lm.dtype, device=str(lm.device),
                 trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                 allow_missing_weights=allow_missing_weights,
                 stream=getattr(lm, "streamer", None) is not None)  # streamed: both
        if ref.is_encoder != lm.is_encoder:
            raise ConfigError("the reference must be of the same kind (encoder or causal LM) "
                              "as the model")
        if int(ref.model.config.vocab_size) != int(lm.model.config.vocab_size):
            raise ConfigError("the reference must share the model's vocabulary")
    if lm.is_encoder and gradient_reference is not None:
        raise UnsupportedOperationError(f"{lm.spec} is an encoder: gradient alignment needs "
                                        "the LM loss")
    if lm.is_encoder:
        return _evaluate_encoder(lm, data, seqlen, samples, batch_size, ref, speed,
                                 reference_cache)
    batches = tokens_for(lm, data, seqlen=seqlen, samples=samples, seed=seed, mode="test")
    score = score_windows if getattr(lm, "streamer", None) is None else _streamed_score
    continuation = _continuation(lm, continuation, batches.input_ids.shape[1])
    extra = {} if continuation is None else {"continuation": continuation}
    result = score(lm, batches.input_ids, batch_size=batch_size, reference=ref,
                   reference_cache=reference_cache, **extra)
    result.update(model_size(lm.model))
    result["data"] = batches.to_dict()
    result["model"] = lm.spec
    if ref is not None:
        result["reference"] = ref.spec
    if gradient_reference is not None:
        result.update(_gradient_alignment(lm, gradient_reference, batches.input_ids,
                                          batch_size, gradient_params, trust_remote_code,
                                          allow_pickle, allow_missing_weights))
    if speed:
        result.update(measure_speed(lm))
    if tasks is not None:
        result["tasks"] = evaluate_tasks(lm, tasks, limit=limit)
    return result


def _streamed_score(lm, input_ids, **kw):
    if kw.pop("continuation", None) is not None:
        raise ConfigError("a streamed evaluation scores whole windows only (no continuation)")
    return score_windows_streamed(lm, input_ids, **kw)


def _continuation(lm, continuation: int | None, t: int) -> int | None:
    """The continuation scored on its own in ``t``-token windows: the active press'
    (checked against ``continuation`` when given), else ``continuation``."""
    pressing = sys.modules.get("prunelab.inference.press")  # not imported: no press active
    session = None if pressing is None else pressing.active_session(lm)
    if session is not None:
        pressed = t - session.split(t)
        if continuation is not None and continuation != pressed:
            raise ConfigError(f"continuation {continuation} differs from the {pressed} tokens "
                              "the active press scores on its cache in each window")
        continuation = pressed
    if continuation is not None:
        check_continuation(continuation, t)
    return continuation


def _gradient_alignment(lm, reference, input_ids, batch_size, params, trust_remote_code,
                        allow_pickle, allow_missing_weights) -> dict[str, Any]:
    ref = reference if isinstance(reference, LoadedModel) else \
        load(reference, dtype=lm.dtype, device=str(lm.device),
             trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
             allow_missing_weights=allow_missing_weights)
    out = gradient_alignment(lm, ref, input_ids, batch_size=batch_size, params=params)
    out["gradient_reference"] = ref.spec
    return out


def _evaluate_vision(lm, data, samples, batch_size, reference, reference_cache,
                     load_kw) -> dict[str, Any]:
    ref = reference if reference is None or isinstance(reference, LoadedModel) else \
        load(reference, dtype=lm.dtype, device=str(lm.device), **load_kw)
    photos = data if isinstance(data, str) and data.startswith("images") else None
    result = evaluate_vision(lm, photos, ref, samples=samples or 32, batch_size=batch_size,
                             reference_cache=reference_cache)
    result.update(model_size(lm.model))
    return result


def _evaluate_encoder(lm, data, seqlen, samples, batch_size, ref, speed,
                      reference_cache) -> dict[str, Any]:
    if speed:
        raise UnsupportedOperationError(
            f"{lm.spec} is an encoder: --speed measures prefill and decoding of causal LMs")
    if isinstance(data, SentenceBatch):
        batch = data
    else:
        if lm.tokenizer is None:
            raise ConfigError("this model has no tokenizer: pass a SentenceBatch instead")
        if not isinstance(data, str):
            raise ConfigError("an encoder is evaluated on sentences: pass a data spec or a "
                              "SentenceBatch")
        limit = getattr(lm.model.config, "max_position_embeddings", seqlen) or seqlen
        batch = sentence_batch(lm.tokenizer, data, samples=samples,
                               max_length=min(seqlen, int(limit)))
    result = score_sentences(lm, batch, batch_size=max(batch_size, 1), reference=ref,
                             reference_cache=reference_cache)
    result.update(model_size(lm.model))
    result["data"] = batch.to_dict()
    result["model"] = lm.spec
    result["samples"] = batch.samples
    result["seqlen"] = batch.max_length
    if ref is not None:
        result["reference"] = ref.spec
    return result


def probe(model, probes, data="wiki-vital:calib", seqlen: int = 256, samples: int | None = 16,
          seed: int = 0, batch_size: int = 8, out_dir: str | Path | None = None,
          overwrite: bool = False, states: str = "memory", tokenizer=None,
          calib_dtype: str | None = None, **options):
    """Run redundancy probes (see :mod:`prunelab.probes`) on calibration windows.

    ``probes``: a registered name or a typed config (returns a
    :class:`~prunelab.probes.ProbeResult`), or a list mixing both / comma-separated names
    (returns ``{name: ProbeResult}``). Options such as ``window``, ``pairs``, ``span``,
    ``max_length`` go to the probes given by name that take them; an option that none of
    them takes is a :class:`ConfigError`. ``seed`` samples the windows and seeds the probes
    that take a seed. Examples: ``prunelab.probe(lm, Interchange(window=1), data)``,
    ``prunelab.probe(lm, "interchange,cka", data, window=1)``.
    """
    lm = _as_loaded(model, tokenizer)
    single = not isinstance(probes, (str, list, tuple)) or (
        isinstance(probes, str) and "," not in probes)
    items = probes.split(",") if isinstance(probes, str) else [probes] if single else probes
    items = [p.strip() if isinstance(p, str) else p for p in items]
    items = [p for p in items if p != ""]
    if getattr(lm, "streamer", None) is not None:
        check_streamable_probes(items)
    batches = tokens_for(lm, data, seqlen=seqlen, samples=samples, seed=seed, mode="calib")
    with _calibrating_in(lm, calib_dtype):  # bfloat16 matmuls on request (see prune)
        results = run_probes(lm, items, batches.input_ids, data_info=batches.to_dict(),
                             batch_size=batch_size, out_dir=out_dir, overwrite=overwrite,
                             states=states, seed=seed, **options)
    return next(iter(results.values())) if single else results


def prune(model, config, data="wiki-vital:calib", seqlen: int = 256,
          samples: int | None = 32, seed: int = 0, batch_size: int = 8,
          tokenizer=None, calib_dtype: str | None = None):
    """Prune ``model`` in place with a method config, e.g.
    ``prunelab.prune(lm, Depth(remove=6, recovery="foldable"), "wiki-vital:calib")``.

    Returns a :class:`~prunelab.pruning.base.PruneReport` (a read-only mapping: the
    method's own fields -- removed units, calibration KL before and after recovery... --
    plus ``operation``, ``method``, ``config``, ``data``, ``size_before``, ``size_after``,
    ``seconds``); the operation is also recorded in the model's history for the manifest.
    ``calib_dtype="bfloat16"``: the calibration forward passes run the blocks' matmuls in
    bfloat16; statistics, masks and updates stay in float32 (default: the model's dtype).
    """
    lm = _as_loaded(model, tokenizer)
    with _calibrating_in(lm, calib_dtype):
        return _prune(lm, config, data, seqlen, samples, seed, batch_size)


@contextlib.contextmanager
def _calibrating_in(lm, calib_dtype):
    """``lm.calib_dtype`` set for the call when ``calib_dtype`` is given (else as is)."""
    if calib_dtype is None:
        yield
        return
    before = lm.calib_dtype
    lm.calib_dtype = resolve_calib_dtype(calib_dtype)
    try:
        yield
    finally:
        lm.calib_dtype = before


def _prune(lm, config, data, seqlen, samples, seed, batch_size):
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    pruner = pruner_for(config)
    check_composable(lm, pruner, method_name(config), config)  # custom modules it cannot prune
    pruner.precheck(lm, config)  # user errors before any tokenisation or calibration
    batches = tokens_for(lm, data, seqlen=seqlen, samples=samples, seed=seed, mode="calib") \
        if pruner.needs_data else None
    start = time.perf_counter()
    before = model_size(lm.model)
    with streamed_prune(lm, config):  # a streamed model: pruned blocks go to disk
        details = pruner.run(lm, config, None if batches is None else batches.input_ids,
                             batch_size=batch_size)
    report = PruneReport(operation=pruner.operation, method=method_name(config),
                         config=config_dict(config),
                         data=None if batches is None else batches.to_dict(),
                         size_before=before, size_after=model_size(lm.model),
                         seconds=time.perf_counter() - start, details=details)
    lm.history.append({"operation": pruner.operation, "method": report.method,
                       "config": report.config, **details.history()})
    if lm.calib_dtype is not None:
        lm.history[-1]["calib_dtype"] = str(lm.calib_dtype).removeprefix("torch.")
    lm.last_report = report
    return report


def heal(model, teacher=None, data="wiki-vital:calib", eval_data="wiki-vital:test",
         config=None, out_dir: str | Path | None = None, manifest: dict | None = None,
         train_samples: int | None = None, eval_samples: int | None = 32,
         load_options: dict | None = None, **options):
    """Heal a pruned model with a short fine-tune that keeps its structure (LoRA or full;
    ce / kd / hidden / mix losses; optional REP-LIE or CascadeFlow pruning while tuning):
    see :mod:`prunelab.heal`. ``config``: a :class:`~prunelab.heal.HealConfig` (or its
    fields as ``options``); ``out_dir``: the resumable state folder. Models and data may be
    specs or loaded objects: the windows are made here (``config.seqlen``; training: all
    windows of ``data`` or ``train_samples`` of them, shuffled by the run; evaluation: the
    first ``eval_samples`` windows of ``eval_data``, ``None`` for no evaluation), the
    student's manifest read from its checkpoint folder when there is one. Returns
    ``(lm, record)``; save with ``prunelab.save(lm, out, extra={"healing": record})``."""
    if getattr(model, "streamer", None) is not None:
        raise UnsupportedOperationError("heal trains through the whole model: load it "
                                        "without --stream (stream=False)")
    if config is not None and options:
        raise ConfigError("give config or options, not both")
    cfg = config or HealConfig(**options)
    if teacher is not None and not cfg.needs_teacher:
        raise ConfigError(f"--teacher is used by --loss kd, hidden and mix only (this run's "
                          f"loss is {cfg.loss})")
    load_options = load_options or {}
    lm = load(model, **load_options) if isinstance(model, str) else _as_loaded(model)
    ref = None
    if teacher is not None:
        ref = load(teacher, dtype=lm.dtype, device=str(lm.device), **{
            k: v for k, v in load_options.items() if k not in ("dtype", "device")}) \
            if isinstance(teacher, str) else _as_loaded(teacher)
    if manifest is None:
        manifest = source_manifest(lm)
    train = tokens_for(lm, data, seqlen=cfg.seqlen, samples=train_samples, mode="test")
    evals = None if eval_data is None else tokens_for(
        lm, eval_data, seqlen=cfg.seqlen, samples=eval_samples, mode="test")
    lm, record = run_heal(lm, ref, train.input_ids, None if evals is None else evals.input_ids,
                          cfg, out_dir=out_dir, manifest=manifest)
    record["data"] = {"train": train.to_dict(), "eval": None if evals is None else
                      evals.to_dict()}
    return lm, record


def save(model, out_dir: str | Path, manifest: dict | None = None, overwrite: bool = False,
         tokenizer=None, **manifest_fields) -> Path:
    """Write a checkpoint that plain ``transformers`` loads, with ``manifest.json``."""
    lm = _as_loaded(model, tokenizer)
    man = manifest if manifest is not None else build_manifest(lm, **manifest_fields)
    if getattr(lm, "streamer", None) is not None:
        return save_streamed(lm, out_dir, manifest=man, overwrite=overwrite)
    return _save(lm, out_dir, manifest=man, overwrite=overwrite)
