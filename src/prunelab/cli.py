"""prunelab command line: a thin face over :mod:`prunelab.api`.

Errors a user can cause print one line (``error: ...``) and exit with code 2; ``--verbose``
shows the traceback. Layer indices are 0-based everywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from prunelab import log
from prunelab.errors import ConfigError, OutputExistsError, PrunelabError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Measure where a transformer is redundant and remove it.")
out = Console(highlight=False)
_opts = {"verbose": False}

ModelOpt = typer.Option("smollm2-135m", "--model", "-m",
                        help="smollm2-135m | minilm-l6 | gemma3-270m | DIR | FILE.gguf | hub id")
DtypeOpt = typer.Option("auto", help="float32 (CPU default), bfloat16 (CUDA default), float16")
DeviceOpt = typer.Option("cpu", help="cpu, cuda[:N] or auto")
RemoteOpt = typer.Option(False, "--trust-remote-code", help="allow model code from the checkpoint")
OffloadOpt = typer.Option(False, "--offload", help="keep the weights on the CPU; calibration "
                          "moves one block at a time to --device")


@app.callback()
def main(quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress or status"),
         verbose: bool = typer.Option(False, "--verbose", "-v", help="tracebacks on errors")):
    """prunelab: probes, pruning and evaluation of transformers (0-based layer indices)."""
    log.set_quiet(quiet)
    _opts["verbose"] = verbose


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _load(model: str, dtype: str, device: str, trust_remote_code: bool,
          offload: bool = False):
    from prunelab import api

    return api.load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                    offload=offload)


@app.command()
def info(model: str = ModelOpt, dtype: str = DtypeOpt, device: str = DeviceOpt,
         trust_remote_code: bool = RemoteOpt,
         json_path: Optional[Path] = typer.Option(None, "--json", help="also write JSON here"),
         overwrite: bool = typer.Option(False, help="replace an existing --json file")):
    """Print the architecture: blocks, heads, KV groups, FFN width, sizes, projections."""
    from prunelab import api
    from prunelab.io.save import write_json

    if json_path is not None and json_path.exists() and not overwrite:
        raise OutputExistsError(f"{json_path} exists; pass --overwrite to replace it")
    d = api.info(_load(model, dtype, device, trust_remote_code))
    t = Table(title=f"{d['model']} ({d['model_type']}, family {d['family']})", show_header=False)
    rows = [("blocks", d["blocks"]), ("hidden size", d["hidden_size"]),
            ("query heads", d["heads"]), ("KV heads (GQA groups)", d["kv_heads"]),
            ("query heads per group", d["gqa_group_size"]), ("head dim", d["head_dim"]),
            ("FFN width", f"{d['ffn']} ({'gated' if d['gated_mlp'] else 'plain'})"),
            ("vocabulary", d["vocab_size"]), ("tied embeddings", d["tied_embeddings"]),
            ("encoder", d["encoder"]), ("parameters", f"{d['params']:,}"),
            ("bytes", f"{d['bytes']:,} ({_fmt_bytes(d['bytes'])}, {d['dtype']})")]
    for k, v in rows:
        t.add_row(k, str(v))
    out.print(t)
    bt = Table(title="blocks (0-based): attention and MLP projections [d_out, d_in]")
    for col in ("blocks", "type", "heads/kv", "attention", "mlp"):
        bt.add_column(col, overflow="fold")
    for first, last, b in _group_blocks(d["block_details"]):
        att = " ".join(f"{k}{v}" for k, v in b["attention"].items()).replace(", ", "x")
        mlp = " ".join(f"{k}{v}" for k, v in b["mlp"].items()).replace(", ", "x")
        span = str(first) if first == last else f"{first}-{last}"
        bt.add_row(span, b["attention_type"], f"{b['heads']}/{b['kv_heads']}", att, mlp)
    out.print(bt)
    if json_path is not None:
        write_json(json_path, d, overwrite=overwrite)


def _group_blocks(blocks: list[dict]):
    """Consecutive blocks with identical shapes and type as ``(first, last, block)``."""
    groups: list[tuple[int, int, dict]] = []
    for b in blocks:
        key = {k: v for k, v in b.items() if k != "index"}
        if groups and {k: v for k, v in groups[-1][2].items() if k != "index"} == key:
            groups[-1] = (groups[-1][0], b["index"], groups[-1][2])
        else:
            groups.append((b["index"], b["index"], b))
    return groups


@app.command("eval")
def eval_cmd(model: str = ModelOpt,
             data: str = typer.Option("wiki-vital:test", help="wiki-vital:test | wikitext2 | "
                                      "c4 | text:PATH | jsonl:PATH[:field]"),
             seqlen: int = typer.Option(512, help="window length in tokens"),
             samples: Optional[int] = typer.Option(None, help="windows to score (default all); "
                                                   "encoders: sentences (default 512)"),
             batch_size: int = typer.Option(4, help="windows per forward pass"),
             kl_reference: Optional[str] = typer.Option(
                 None, "--kl-reference", "--reference",
                 help="reference (dense) model spec: KL and top-1 agreement for causal LMs, "
                 "embedding cosine and nearest-neighbour agreement for encoders"),
             speed: bool = typer.Option(False, "--speed", help="also measure prefill/decode "
                                        "tokens/s and peak memory"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write results"),
             overwrite: bool = typer.Option(False, help="replace an existing --json file"),
             dtype: str = DtypeOpt, device: str = DeviceOpt,
             trust_remote_code: bool = RemoteOpt):
    """Perplexity on held-out windows (plus KL to a reference and speed on request).

    Encoders: mean-pooled embeddings of held-out sentences (--samples sentences, default
    512, of at most --seqlen tokens): same-document nearest neighbour, and with --reference
    mean cosine and nearest-neighbour agreement to the reference."""
    from prunelab import api
    from prunelab.io.save import write_json

    if json_path is not None and json_path.exists() and not overwrite:
        raise OutputExistsError(f"{json_path} exists; pass --overwrite to replace it")
    lm = _load(model, dtype, device, trust_remote_code)
    res = api.evaluate(lm, data=data, seqlen=seqlen, samples=samples, batch_size=batch_size,
                       reference=kl_reference, speed=speed)
    t = Table(title=f"eval {model} on {res['data']['spec']}", show_header=False)
    shown = _encoder_rows(res) if lm.is_encoder else _decoder_rows(res, speed)
    for k, v in shown:
        t.add_row(k, v)
    out.print(t)
    if json_path is not None:
        write_json(json_path, res, overwrite=overwrite)
        log.info(f"wrote {json_path}")


def _decoder_rows(res: dict, speed: bool) -> list[tuple[str, str]]:
    shown = [("perplexity", f"{res['perplexity']:.4f}"),
             ("windows x seqlen", f"{res['samples']} x {res['seqlen']}"),
             ("scored tokens", f"{res['tokens']:,}"),
             ("parameters", f"{res['params']:,}"),
             ("bytes", f"{res['bytes']:,} ({_fmt_bytes(res['bytes'])})"),
             ("eval tokens/s", f"{res['eval_tokens_per_s']:.0f}")]
    if "kl_to_reference" in res:
        shown += [("KL to reference", f"{res['kl_to_reference']:.5f}"),
                  ("top-1 agreement", f"{res['top1_agreement']:.4f}")]
    if speed:
        shown += [("prefill tokens/s", f"{res['prefill_tokens_per_s']:.0f}"),
                  ("decode tokens/s", f"{res['decode_tokens_per_s']:.1f}"),
                  ("peak memory", _fmt_bytes(res["peak_memory_bytes"]))]
    return shown


def _encoder_rows(res: dict) -> list[tuple[str, str]]:
    shown = [("sentences (max tokens)", f"{res['sentences']} ({res['max_length']})"),
             ("documents", str(res["data"]["documents"])),
             ("same-document nearest neighbour", f"{res['same_document_nn']:.4f}"),
             ("parameters", f"{res['params']:,}"),
             ("bytes", f"{res['bytes']:,} ({_fmt_bytes(res['bytes'])})"),
             ("sentences/s", f"{res['sentences_per_s']:.0f}")]
    if "mean_cosine_to_reference" in res:
        shown += [("mean cosine to reference", f"{res['mean_cosine_to_reference']:.5f}"),
                  ("nearest-neighbour agreement", f"{res['nn_agreement']:.4f}")]
    return shown


def _parse_pairs(text: str | None) -> list[tuple[int, int]]:
    if not text:
        return []
    pairs = []
    for item in text.split(","):
        parts = item.strip().split("-")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ConfigError(f"--pairs takes i-j,i-j,... (0-based), got {item.strip()!r}")
        pairs.append((int(parts[0]), int(parts[1])))
    return pairs


@app.command()
def probe(model: str = ModelOpt,
          data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
          probe_names: str = typer.Option(..., "--probe", help="comma-separated: "
                                          "block-influence, span-angular, cka, contraction, "
                                          "leave-one-out, sublayer-ablation, replacement, "
                                          "interchange, weight-redundancy, interval"),
          out_dir: Path = typer.Option(..., "--out", help="output directory"),
          window: Optional[int] = typer.Option(None, help="swap probes: pairs with |i-j| <= W "
                                               "(default: all pairs)"),
          pairs: Optional[str] = typer.Option(None, help="swap probes: explicit pairs i-j,..."),
          span: int = typer.Option(1, help="span-angular: span length n"),
          max_length: int = typer.Option(4, help="interval: longest interval measured"),
          max_remove: int = typer.Option(5, help="summary: removal sets for n = 1..N"),
          samples: int = typer.Option(16, help="calibration windows"),
          seqlen: int = typer.Option(256, help="window length in tokens"),
          seed: int = typer.Option(0, help="window sampling and noise seed"),
          batch_size: int = typer.Option(8, help="windows per block call"),
          states: str = typer.Option("memory", help="boundary cache: memory or disk"),
          overwrite: bool = typer.Option(False, help="replace finished results in --out"),
          dtype: str = DtypeOpt, device: str = DeviceOpt,
          trust_remote_code: bool = RemoteOpt,
          offload: bool = OffloadOpt):
    """Measure layer redundancy under several protocols, side by side (0-based layers)."""
    from prunelab import api
    from prunelab.probes import probe_names as known

    names = [n.strip() for n in probe_names.split(",") if n.strip()]
    unknown = [n for n in names if n not in known()]
    if unknown or not names:
        raise ConfigError(f"unknown probe {', '.join(unknown) or '(none)'}; "
                          f"available: {', '.join(known())}")
    if states not in ("memory", "disk"):
        raise ConfigError(f"--states must be memory or disk, got {states!r}")
    lm = _load(model, dtype, device, trust_remote_code, offload)
    results = api.probe(lm, names, data=data, seqlen=seqlen, samples=samples, seed=seed,
                        batch_size=batch_size, out_dir=out_dir, overwrite=overwrite,
                        states=states, window=window, pairs=_parse_pairs(pairs), span=span,
                        max_length=max_length, max_remove=max_remove)
    t = Table(title=f"probes on {model} (0-based blocks; most removable first)")
    for col in ("probe", "most removable", "block evals", "seconds"):
        t.add_column(col, overflow="fold")
    for name, res in results.items():
        rank = res.ranking()[:8]
        t.add_row(name, ", ".join(map(str, rank)) if rank else "-",
                  f"{res.meta.get('block_evaluations', 0):.0f}",
                  f"{res.meta.get('seconds', 0):.1f}")
    out.print(t)
    log.info(f"wrote {out_dir}/ (NAME.json, NAME.csv, NAME.png, summary.md)")


prune_app = typer.Typer(no_args_is_help=True, help="Prune a model and save a checkpoint.")
sweep_app = typer.Typer(no_args_is_help=True, help="Pruning curves over several settings.")
app.add_typer(prune_app, name="prune")
app.add_typer(sweep_app, name="sweep")


def _blocks(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"--blocks takes 0-based indices like 3,5,9, got {text!r}") from exc


@prune_app.command("depth")
def prune_depth_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        remove: Optional[int] = typer.Option(None, help="number of blocks to remove"),
        target_params: Optional[float] = typer.Option(None, help="parameters to keep: a "
                                                      "fraction (<= 1) or a count"),
        probe_name: str = typer.Option("block-influence", "--probe", help="probe that ranks "
                                       "blocks (run on the calibration data)"),
        from_probe: Optional[Path] = typer.Option(None, help="a saved DIR/NAME.json instead"),
        strategy: Optional[str] = typer.Option(None, help="one-shot | no-adjacent | span | "
                                               "iterative | beam | blend | last-n | random "
                                               "(default from the probe kind)"),
        recovery: str = typer.Option("none", help="none | foldable | boundary | ghost | lra"),
        rank: Optional[int] = typer.Option(None, help="lra: rank of the adapter"),
        token_aware: bool = typer.Option(False, "--token-aware", help="ghost/lra: separate "
                                         "map for the first position"),
        blocks: Optional[str] = typer.Option(None, help="explicit 0-based blocks, e.g. 3,5"),
        window: int = typer.Option(1, help="pair probes: |i - j| <= W"),
        blend_probe: Optional[str] = typer.Option(None, help="blend: the second probe "
                                                  "(default contraction)"),
        beam_width: Optional[int] = typer.Option(None, help="beam: width (default 3)"),
        beam_seeds: Optional[int] = typer.Option(None, help="beam: candidate blocks "
                                                 "(default 12)"),
        beam_score: Optional[str] = typer.Option(None, help="beam: kl or perplexity "
                                                 "(default kl)"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="window length in tokens"),
        seed: int = typer.Option(0, help="window sampling / random strategy seed"),
        batch_size: int = typer.Option(8, help="windows per block call"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        offload: bool = OffloadOpt):
    """Remove whole blocks chosen by a probe, repair the cut in closed form, save."""
    from prunelab import api
    from prunelab.pruning import depth_from_cli

    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"{out_dir} exists; pass --overwrite to replace it")
    cfg = depth_from_cli(remove=remove, target_params=target_params, probe=probe_name,
                         from_probe=str(from_probe) if from_probe else None,
                         strategy=strategy, recovery=recovery, rank=rank,
                         token_aware=token_aware, blocks=_blocks(blocks), window=window,
                         blend_probe=blend_probe, beam_width=beam_width,
                         beam_seeds=beam_seeds, beam_score=beam_score, seed=seed)
    lm = _load(model, dtype, device, trust_remote_code, offload)
    rep = api.prune(lm, cfg, data=data, seqlen=seqlen, samples=samples, seed=seed,
                    batch_size=batch_size)
    api.save(lm, out_dir, overwrite=overwrite, data=rep["data"], before=rep["size_before"],
             metrics={k: rep[k] for k in ("calib_kl_before_recovery",
                                          "calib_kl_after_recovery")},
             extra={"report": rep.to_dict()})
    t = Table(title=f"depth pruning of {model}", show_header=False)
    div = "1 - cos (pooled)" if lm.is_encoder else "KL"
    b, a = rep["size_before"], rep["size_after"]
    rows = [("removed blocks (0-based, original numbering)", str(rep["removed_blocks"])),
            ("blocks", f"{rep['num_blocks_before']} -> {rep['num_blocks_after']}"),
            ("selection", ", ".join(f"{k}={v}" for k, v in rep["selection"].items()
                                    if v is not None and k != "beam")),
            ("recovery", rep["recovery"]),
            ("parameters", f"{b['params']:,} -> {a['params']:,} "
                           f"({a['params'] / b['params']:.1%})"),
            ("bytes", f"{_fmt_bytes(b['bytes'])} -> {_fmt_bytes(a['bytes'])}"),
            (f"calibration {div} before recovery", f"{rep['calib_kl_before_recovery']:.5f}"),
            (f"calibration {div} after recovery", f"{rep['calib_kl_after_recovery']:.5f}"),
            ("checkpoint", str(out_dir))]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)
    if rep["needs_remote_code"]:
        from prunelab.io.remote import load_hint

        out.print(f"note: {recovery} adds linear bridges: load the checkpoint with "
                  f"{load_hint(lm.model)}")


def _patterns(text: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


@prune_app.command("sparsity")
def prune_sparsity_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        method: str = typer.Option("wanda", help="magnitude | wanda | sparsegpt | rose | "
                                   "qk-wanda"),
        sparsity: float = typer.Option(0.5, help="unstructured target (mean over layers)"),
        pattern: Optional[str] = typer.Option(None, help="N:M pattern, e.g. 2:4"),
        allocation: str = typer.Option("uniform", help="uniform | owl | pals | ramp"),
        owl_m: float = typer.Option(5.0, help="owl: outlier threshold M"),
        owl_lambda: float = typer.Option(0.08, help="owl: lambda"),
        pals_delta: float = typer.Option(0.05, help="pals: delta"),
        ramp_span: float = typer.Option(0.1, help="ramp: +- span around the target"),
        ramp_down: bool = typer.Option(False, "--ramp-down", help="ramp: sparsity falls "
                                       "with depth"),
        group: str = typer.Option("row", help="unstructured comparison group: row or layer"),
        targets: Optional[str] = typer.Option(None, help="glob patterns of linears to prune"),
        ignore: Optional[str] = typer.Option(None, help="glob patterns of linears to keep"),
        propagate: Optional[str] = typer.Option(
            None, help="modified or dense block outputs passed on (default: dense for "
            "wanda, modified otherwise)"),
        within_block: Optional[str] = typer.Option(
            None, help="sequential (each sublayer group calibrated after the earlier ones "
            "were pruned) or dense (the whole block calibrated dense); default: dense for "
            "wanda, sequential otherwise"),
        scope: str = typer.Option("qk", help="qk-wanda: qk or block"),
        qk_variant: str = typer.Option("unmasked", help="qk-wanda: unmasked (every "
                                       "query-key pair) or causal (pairs the mask keeps)"),
        no_reorder: bool = typer.Option(False, "--no-reorder", help="rose: no reordering"),
        hessian_alpha: float = typer.Option(0.0, help="sparsegpt/rose: Taylor blend "
                                            "(MOONSHOT)"),
        samples: int = typer.Option(64, help="calibration windows"),
        seqlen: int = typer.Option(512, help="window length in tokens"),
        seed: int = typer.Option(0, help="window sampling seed"),
        batch_size: int = typer.Option(8, help="windows per block call"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        offload: bool = OffloadOpt):
    """Unstructured or N:M sparsity (Wanda, SparseGPT, ROSE, QK-Wanda, magnitude)."""
    from prunelab import api
    from prunelab.pruning.sparsity.config import CLASSES, Owl, Pals, Ramp, Uniform

    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"{out_dir} exists; pass --overwrite to replace it")
    if method not in CLASSES:
        raise ConfigError(f"--method must be one of {', '.join(CLASSES)}, got {method!r}")
    allocs = {"uniform": lambda: Uniform(), "owl": lambda: Owl(m=owl_m, lam=owl_lambda),
              "pals": lambda: Pals(delta=pals_delta),
              "ramp": lambda: Ramp(span=ramp_span, increasing=not ramp_down)}
    if allocation not in allocs:
        raise ConfigError(f"--allocation must be one of {', '.join(allocs)}, "
                          f"got {allocation!r}")
    kw = dict(sparsity=sparsity, pattern=pattern, allocation=allocs[allocation](),
              group=group, targets=_patterns(targets), ignore=_patterns(ignore),
              **{k: v for k, v in (("propagate", propagate), ("within_block", within_block))
                 if v is not None})
    if method in ("sparsegpt", "rose"):
        kw["hessian_alpha"] = hessian_alpha
    if method == "rose":
        kw["reorder"] = not no_reorder
    if method == "qk-wanda":
        kw["scope"] = scope
        kw["variant"] = qk_variant
    cfg = CLASSES[method](**kw)
    lm = _load(model, dtype, device, trust_remote_code, offload)
    rep = api.prune(lm, cfg, data=data, seqlen=seqlen, samples=samples, seed=seed,
                    batch_size=batch_size)
    api.save(lm, out_dir, overwrite=overwrite, data=rep["data"], before=rep["size_before"],
             metrics={"achieved_sparsity": rep["achieved_sparsity"]}, extra={"report": rep.to_dict()})
    t = Table(title=f"{method} sparsity of {model} (blocks 0-based)")
    for col in ("block", "target", "achieved (mean over linears)"):
        t.add_column(col)
    for layer in rep["layers"]:
        vals = list(layer["linears"].values())
        t.add_row(str(layer["block"]), f"{layer['target']:.4f}",
                  f"{sum(vals) / max(len(vals), 1):.4f}")
    out.print(t)
    out.print(f"achieved sparsity over pruned linears: {rep['achieved_sparsity']:.4f}; "
              f"{rep['seconds']:.1f} s; checkpoint {out_dir} (plain transformers)")


@prune_app.command("width")
def prune_width_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        out_dir: Path = typer.Option(..., "--out", help="checkpoint directory to write"),
        unit: str = typer.Option("ffn", help="heads | ffn | joint"),
        score: str = typer.Option("wanda-sp", help="heads: wanda-sp | magnitude-profile | flap "
                                  "| ablation-kl | putri; ffn: wanda-sp | flap | putri | "
                                  "ablation-kl | magnitude-profile; joint: cocurve"),
        ratio: Optional[float] = typer.Option(None, help="fraction of the unit's parameters "
                                              "removed"),
        target_params: Optional[float] = typer.Option(None, help="parameters the model keeps: "
                                                      "a fraction (<= 1) or a count"),
        allocation: str = typer.Option("uniform", help="uniform (plain config) | global "
                                       "(per-block widths, needs trust_remote_code)"),
        heads: str = typer.Option("groups", help="groups (KV groups; heads without GQA) | "
                                  "query (query heads inside every group)"),
        compensate: bool = typer.Option(False, "--compensate", help="least-squares refit of "
                                        "o_proj / down_proj, block by block"),
        no_bias_compensation: bool = typer.Option(False, "--no-bias-compensation",
                                                  help="no FLAP bias compensation"),
        round_to: int = typer.Option(8, help="FFN widths kept are multiples of this"),
        damp: float = typer.Option(1.0, help="refit ridge (times mean diag of X^T X), "
                                   "shrinking towards plain slicing"),
        ablation_samples: Optional[int] = typer.Option(None, help="windows for ablation-kl "
                                                       "/ cocurve (default 4)"),
        channel_group: Optional[int] = typer.Option(None, help="FFN channels per ablation / "
                                                    "cocurve unit (default 64)"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="window length in tokens"),
        seed: int = typer.Option(0, help="window sampling seed"),
        batch_size: int = typer.Option(8, help="windows per block call"),
        overwrite: bool = typer.Option(False, help="replace an existing --out"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        offload: bool = OffloadOpt):
    """Structured width pruning: KV groups / heads / query heads and FFN channels removed
    physically (0-based blocks)."""
    from prunelab import api
    from prunelab.pruning import width_from_cli

    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"{out_dir} exists; pass --overwrite to replace it")
    cfg = width_from_cli(unit=unit, score=score, ratio=ratio, target_params=target_params,
                         allocation=allocation, heads=heads, compensate=compensate,
                         bias_compensation=not no_bias_compensation, round_to=round_to,
                         damp=damp, ablation_samples=ablation_samples,
                         channel_group=channel_group)
    lm = _load(model, dtype, device, trust_remote_code, offload)
    rep = api.prune(lm, cfg, data=data, seqlen=seqlen, samples=samples, seed=seed,
                    batch_size=batch_size)
    api.save(lm, out_dir, overwrite=overwrite, data=rep["data"], before=rep["size_before"],
             metrics={"removed_params": rep["removed_params"]}, extra={"report": rep.to_dict()})
    t = Table(title=f"width pruning of {model}: {unit} by {score}, {allocation} "
                    "(blocks 0-based)")
    for col in ("block", "heads (q/kv)", "ffn", "removed"):
        t.add_column(col, overflow="fold")
    for b in rep["blocks"]:
        gone = []
        if b.get("removed_groups"):
            gone.append("groups " + ",".join(map(str, b["removed_groups"])))
        if "kept_query_heads" in b:
            gone.append("kept q heads " + str(b["kept_query_heads"]))
        if b.get("removed_channels") is not None:
            gone.append(f"{len(b['removed_channels'])} channels")
        t.add_row(str(b["block"]), f"{b['heads_before']}/{b['kv_heads_before']} -> "
                  f"{b['heads_after']}/{b['kv_heads_after']}",
                  f"{b['ffn_before']} -> {b['ffn_after']}", "; ".join(gone) or "-")
    out.print(t)
    bf, af = rep["size_before"], rep["size_after"]
    out.print(f"parameters {bf['params']:,} -> {af['params']:,} "
              f"({af['params'] / bf['params']:.1%}); bytes {_fmt_bytes(bf['bytes'])} -> "
              f"{_fmt_bytes(af['bytes'])}; compensation: "
              f"{len(rep['compensation']['least_squares'])} least-squares refits, "
              f"{len(rep['compensation']['bias'])} bias updates; {rep['seconds']:.1f} s")
    if rep["needs_remote_code"]:
        from prunelab.io.remote import load_hint

        out.print(f"note: per-block widths ({'; '.join(rep['vanilla_problems'])}): load "
                  f"{out_dir} with {load_hint(lm.model)}")
    else:
        out.print(f"checkpoint {out_dir} (plain transformers)")


@sweep_app.command("depth")
def sweep_depth_cmd(
        model: str = ModelOpt,
        data: str = typer.Option("wiki-vital:calib", help="calibration data spec"),
        test: str = typer.Option("wiki-vital:test", help="test data spec"),
        probes: str = typer.Option("block-influence", help="comma-separated probes; "
                                   "last-n and random are baselines"),
        remove: str = typer.Option("1..4", help="N..M or a list N,M,..."),
        recovery: str = typer.Option("none,foldable", help="comma-separated recoveries"),
        out_dir: Path = typer.Option(..., "--out", help="output directory (resumable)"),
        strategy: Optional[str] = typer.Option(None, help="override the per-probe default"),
        window: int = typer.Option(1, help="pair probes: |i - j| <= W"),
        samples: int = typer.Option(32, help="calibration windows"),
        seqlen: int = typer.Option(256, help="calibration window length"),
        test_samples: int = typer.Option(16, help="test windows"),
        test_seqlen: int = typer.Option(512, help="test window length"),
        seed: int = typer.Option(0, help="window sampling / random baseline seed"),
        batch_size: int = typer.Option(8, help="windows per block call"),
        dtype: str = DtypeOpt, device: str = DeviceOpt, trust_remote_code: bool = RemoteOpt,
        offload: bool = OffloadOpt):
    """Test perplexity and KL to dense against blocks removed, per probe x recovery."""
    from prunelab import api
    from prunelab.pruning.sweep import parse_range, sweep_depth

    removes = parse_range(remove)
    lm = _load(model, dtype, device, trust_remote_code, offload)
    calib = api.tokens_for(lm, data, seqlen=seqlen, samples=samples, seed=seed, mode="calib")
    test_b = api.tokens_for(lm, test, seqlen=test_seqlen, samples=test_samples, mode="test")
    points = sweep_depth(lm, [p.strip() for p in probes.split(",") if p.strip()], removes,
                         [r.strip() for r in recovery.split(",") if r.strip()],
                         calib.input_ids, test_b.input_ids, out_dir, batch_size=batch_size,
                         window=window, seed=seed, strategy=strategy,
                         data_info=calib.to_dict())
    print((out_dir / "curve.md").read_text())
    log.info(f"wrote {out_dir}/ (curve.png, curve.csv, curve.md, points.json); "
             f"{len(points)} points")


def run() -> None:
    """Console entry point: one-line errors, exit code 2, traceback only with --verbose."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        app(standalone_mode=False)
    except PrunelabError as exc:
        if _opts["verbose"]:
            raise
        log.console.print(f"error: {exc}", markup=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except (typer.Exit, SystemExit) as exc:
        code = getattr(exc, "exit_code", getattr(exc, "code", 0))
        sys.exit(code)
    except Exception as exc:  # click usage errors and friends
        usage, abort = _click_exceptions()
        if isinstance(exc, usage):
            exc.show()
            sys.exit(2)
        if isinstance(exc, abort):
            sys.exit(130)
        raise


def _click_exceptions() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """Usage-error and abort classes of click and of typer's vendored copy (typer >= 0.2x
    raises its own ``typer._click`` classes, which are not click's)."""
    import click

    usage, abort = [click.exceptions.ClickException], [click.exceptions.Abort]
    try:
        from typer._click import exceptions as vendored
    except ImportError:
        vendored = None
    if vendored is not None:
        usage.append(vendored.ClickException)
        if hasattr(vendored, "Abort"):
            abort.append(vendored.Abort)
    return tuple(usage), tuple(abort)


def dump(obj) -> str:
    return json.dumps(obj, indent=2)


if __name__ == "__main__":
    run()
