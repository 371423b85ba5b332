"""Peer: NVIDIA kvpress 0.5.5, KV-cache presses, against prunelab's presses.

For every press both implement (streaming-llm, snapkv with kvpress' settings: window 64,
mean pooling; tova; knorm; expected-attention; the budget wrappers adakv and pyramidkv over
that SnapKV) at 0.25 / 0.5 / 0.75 of the prompt's cache
removed, on ``N`` windows of ``P + C`` tokens of ``wiki-vital:test`` (full: 6 x (1,024 +
64), the protocol of issue 42; ``--quick``: 2 x (256 + 16), ratio 0.5): the prompt is
prefilled under the press, the ``C`` continuation tokens run on the compressed cache, and
both sides score them with the same code (``continuation.py``): continuation perplexity,
KL(dense || pressed), top-1 agreement, kept cache length per layer, wall time of the
pressed runs, peak RSS over the RSS before them. Each side runs in one fresh process
(``worker_press.py`` in prunelab's environment, ``worker_kvpress.py`` in
``.bench/peers/kvpress-venv``: kvpress pins ``transformers<5.3``), both on the same
``.npy`` token ids whose sha256 each side checks, both with the attention implementation
prunelab's load chose; both under :data:`common.EXACT_RSS` so the peak RSS is reproducible.

Retrieval: pass-key prompts (``benchmarks/inference_pruning.py``'s, a key sentence at
relative depths of a haystack of ``wiki-vital:test``, then "What is the pass key? The pass
key is"; full: 2,048 and 4,096 tokens x depths 0.1 / 0.5 / 0.9 at 0.5 and 0.75 removed;
quick: 512 x 0.5), prefilled under each press and answered greedily (8 tokens) on the
compressed cache by the same code on both sides; a hit is the key's digits in the answer.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import common
from table import fmt, gap, markdown_table, ratio

NAME = "kvpress"
PIN = "kvpress==0.5.5"
PRESSES = ("streaming-llm", "snapkv", "tova", "knorm", "expected-attention", "adakv",
           "pyramidkv")
#: prunelab options that give kvpress' settings (SnapKV: window 64, mean pooling; the
#: budget wrappers over that SnapKV)
OPTIONS = {"snapkv": {"window": 64, "pooling": "mean"},
           "adakv": {"scorer_options": ["window=64", "pooling=mean"]},
           "pyramidkv": {"scorer_options": ["window=64", "pooling=mean"]}}
#: continuation one token per forward on both sides (kvpress' PyramidKV leaves blocks of
#: different lengths, and its one ``sdpa`` mask, built from block 0's, fails on the others)
STEPWISE = ("pyramidkv",)


def protocol(quick: bool) -> dict:
    if quick:
        return {"windows": 2, "prompt": 256, "continuation": 16, "ratios": (0.5,),
                "needle_lengths": (512,), "needle_depths": (0.5,), "needle_ratios": (0.5,)}
    return {"windows": 6, "prompt": 1024, "continuation": 64, "ratios": (0.25, 0.5, 0.75),
            "needle_lengths": (2048, 4096), "needle_depths": (0.1, 0.5, 0.9),
            "needle_ratios": (0.5, 0.75)}


def protocol_of(ctx) -> dict:
    """:func:`protocol` with the command line's ``--ratios`` / ``--windows``."""
    proto = protocol(ctx.quick)
    if ctx.ratios:
        proto["ratios"] = tuple(ctx.ratios)
    if ctx.windows:
        proto["windows"] = ctx.windows
    return proto


def needle_prompts(lm, lengths, depths) -> tuple[list, list[int]]:
    """Pass-key prompts (``[1, P]`` each) and their keys, ``benchmarks/inference_pruning``'s
    (its keys: ``10000 + 7919 (i + 1) mod 90000``, i over depths)."""
    sys.path.insert(0, str(common.ROOT / "benchmarks"))
    from inference_pruning import passkey_prompt

    prompts, keys = [], []
    for length in lengths:
        for i, depth in enumerate(depths):
            key = 10000 + 7919 * (i + 1) % 90000
            prompts.append(passkey_prompt(lm, length, depth, key))
            keys.append(key)
    return prompts, keys


def prepare(ctx, proto: dict, workdir: Path, jobs: list) -> tuple[dict, list[int], object]:
    """The test windows and pass-key prompts of ``proto`` saved in ``workdir`` (hashed);
    returns a worker spec running ``jobs`` on them, the keys and the tokenizer."""
    import prunelab
    from prunelab.data import make_batches

    lm = prunelab.load(ctx.model, dtype="float32", device="cpu")
    test = make_batches(lm.tokenizer, "wiki-vital:test",
                        seqlen=proto["prompt"] + proto["continuation"],
                        samples=proto["windows"])
    prompts, keys = needle_prompts(lm, proto["needle_lengths"], proto["needle_depths"])
    workdir.mkdir(parents=True, exist_ok=True)
    sha = common.save_ids(workdir / "test.ids.npy", test.input_ids)
    needle_sha, needle_lengths = common.save_ragged(workdir / "needles.ids.npy", prompts)
    spec = {"model": ctx.model, "model_dir": str(lm.source),
            "ids": str(workdir / "test.ids.npy"), "ids_sha256": sha,
            "continuation": proto["continuation"], "jobs": jobs,
            "attn_implementation": lm.model.config._attn_implementation,
            "needles": str(workdir / "needles.ids.npy"), "needles_sha256": needle_sha,
            "needle_lengths": needle_lengths, "new_tokens": 8,
            "needle_ratios": list(proto["needle_ratios"])}
    return spec, keys, lm.tokenizer


def score_needles(tokenizer, res: dict, keys: list[int]) -> None:
    """Add ``needle_hits`` (one bool per prompt) to every row of a side's result."""
    for row in res.get("rows", []):
        if "needle_tokens" in row:
            row["needle_hits"] = [str(k) in tokenizer.decode(t)
                                  for k, t in zip(keys, row["needle_tokens"], strict=True)]


def run(ctx) -> tuple[str, dict]:
    """Run both sides; returns the page section (markdown) and the raw results."""
    proto = protocol_of(ctx)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        py, versions = common.ensure_venv("kvpress", [PIN, "psutil"],
                                          ["kvpress", "torch", "transformers", "psutil"])
    except RuntimeError as exc:
        return section(ctx, proto, started, None, None, error=str(exc)), {"error": str(exc)}
    jobs = [[p, r, OPTIONS.get(p, {})] for r in proto["ratios"] for p in PRESSES]
    workdir = ctx.workdir / NAME
    spec, keys, tokenizer = prepare(ctx, proto, workdir, jobs)
    spec["stepwise"] = list(STEPWISE)
    sha, needle_sha = spec["ids_sha256"], spec["needles_sha256"]
    here = Path(__file__).resolve().parent
    print(f"kvpress: {len(jobs)} press settings x {proto['windows']} windows; ids sha256 "
          f"{sha[:12]}", flush=True)
    # the two sides run at the same time, each in its own process: on a core shared with
    # other jobs this halves the wall time of the run; CPU time and peak RSS are per process
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        f_ours = pool.submit(common.run_worker, sys.executable, here / "worker_press.py",
                             spec, workdir, "prunelab", env=common.EXACT_RSS)
        f_theirs = pool.submit(common.run_worker, py, here / "worker_kvpress.py", spec,
                               workdir, "kvpress", env=common.EXACT_RSS)
        ours, theirs = f_ours.result(), f_theirs.result()
    for side, res in (("prunelab", ours), ("kvpress", theirs)):
        if "error" not in res:
            common.check_result_ids(res, sha, side)
            if res.get("needles_sha256") != needle_sha:
                raise common.IdsMismatch(f"{side}: answered other pass-key prompts")
            score_needles(tokenizer, res, keys)
    earlier = merge_earlier(ctx, sha, ours, theirs)
    raw = {"protocol": proto, "ids_sha256": sha, "needles_sha256": needle_sha, "keys": keys,
           "prunelab": ours, "kvpress": theirs,
           "venv_versions": versions, "earlier": earlier, "started": started,
           "commit": ctx.commit}
    return section(ctx, proto, started, ours, theirs, sha=sha, earlier=earlier), raw


def merge_earlier(ctx, sha: str, ours: dict, theirs: dict) -> list[str]:
    """With ``--ratios``: rows of an earlier run on the same token ids (its raw JSON,
    ``.bench/peers/kvpress.json``) for the settings this run did not redo are kept, so the
    ratios can be run one at a time. Returns the earlier runs' descriptions."""
    path = common.BENCH / f"{NAME}{'-quick' if ctx.quick else ''}.json"
    if not ctx.ratios or not path.is_file() or "error" in ours or "error" in theirs:
        return []
    import json

    old = json.loads(path.read_text())
    if old.get("ids_sha256") != sha or "rows" not in old.get("prunelab", {}):
        return []
    done = {(r["press"], r["ratio"]) for r in ours["rows"]}
    kept = [r for r in old["prunelab"]["rows"] if (r["press"], r["ratio"]) not in done]
    if not kept:
        return []
    ours["rows"] = sorted(ours["rows"] + kept, key=lambda r: (r["ratio"], r["press"]))
    theirs_old = [r for r in old["kvpress"].get("rows", [])
                  if (r["press"], r["ratio"]) not in done]
    theirs["rows"] = sorted(theirs["rows"] + theirs_old, key=lambda r: (r["ratio"], r["press"]))
    ratios = sorted({r["ratio"] for r in kept})
    return [f"rows at {', '.join(f'{x:g}' for x in ratios)} from an earlier run on the same "
            f"token ids ({old.get('started', 'date in its JSON')}, commit "
            f"{old.get('commit', '?')})"] + old.get("earlier", [])


def _rows(ours: dict, theirs: dict) -> list[list]:
    key = {(r["press"], r["ratio"]): r for r in theirs.get("rows", [])}
    rows = []
    for a in ours.get("rows", []):
        if a["press"] == "dense":
            continue
        b = key.get((a["press"], a["ratio"]), {})
        if "error" in a or "error" in b:
            err = "; ".join(f"{side}: `{r['error']}`" for side, r in (("prunelab", a),
                                                                      ("kvpress", b))
                            if "error" in r)
            rows.append([a["press"], f"{a['ratio']:.2f}", f"failed: {err}"]
                        + ["-"] * 10)
            continue
        g = " ".join(x for x in (
            gap(a["continuation_perplexity"], b.get("continuation_perplexity"), 0.001),
            gap(a["continuation_kl"], b.get("continuation_kl"), 0.02)) if x)
        rows.append([
            a["press"], f"{a['ratio']:.2f}",
            f"{fmt(a['kept'], '.0f')} / {fmt(b.get('kept'), '.0f')}",
            fmt(a["continuation_perplexity"], ".3f"),
            fmt(b.get("continuation_perplexity"), ".3f"),
            fmt(a["continuation_kl"], ".4f"), fmt(b.get("continuation_kl"), ".4f"),
            ratio(a["continuation_kl"], b.get("continuation_kl")),
            f"{fmt(a['continuation_top1'], '.3f')} / {fmt(b.get('continuation_top1'), '.3f')}",
            f"{fmt(a['cpu_seconds'], '.1f')} / {fmt(b.get('cpu_seconds'), '.1f')} "
            f"({ratio(a['cpu_seconds'], b.get('cpu_seconds'))})",
            f"{fmt(a['seconds'], '.1f')} / {fmt(b.get('seconds'), '.1f')}",
            f"{fmt(a['extra_peak'] / common.MiB, '.0f')} / "
            f"{fmt(b['extra_peak'] / common.MiB if 'extra_peak' in b else None, '.0f')} "
            f"({ratio(a['extra_peak'], b.get('extra_peak'))})", g or "-"])
    return rows


def section(ctx, proto, started, ours, theirs, sha: str = "", error: str = "",
            earlier: list[str] | None = None) -> str:
    head = [f"## kvpress ({PIN.split('==')[1]}): KV-cache presses", "",
            f"Run {started}, commit `{ctx.commit}`, {ctx.machine}; command: "
            f"`{ctx.command}`" + "".join(f"; {e}" for e in earlier or []) + ".", ""]
    if error:
        return "\n".join(head + [f"Not run: {error}"])
    p = proto
    attn = (ours or {}).get("attn_implementation", "?")
    head += [f"{ctx.model}, float32, CPU, `{attn}` attention on both sides; {p['windows']} "
             f"windows of "
             f"{p['prompt']:,} prompt + {p['continuation']} continuation tokens of "
             f"`wiki-vital:test` (token ids sha256 `{sha[:16]}`, checked by both sides). "
             "The prompt is prefilled under the press, the continuation runs on the "
             "compressed cache; both sides score it with the same code "
             "(`benchmarks/peers/continuation.py`). SnapKV with kvpress' settings "
             "(prunelab `--press-window 64 --press-pooling mean`). prunelab's side as a "
             "CLI: `prunelab eval --model smollm2-135m --reference smollm2-135m --seqlen "
             f"{p['prompt'] + p['continuation']} --press-continuation {p['continuation']} "
             f"--samples {p['windows']} --press NAME --budget remove-cache:R`.", ""]
    for side, res in (("prunelab", ours), ("kvpress", theirs)):
        if res and "error" in res:
            head += [f"{side} side failed: `{res['error']}` (log `{res.get('log')}`)", ""]
    if not ours or "error" in ours:
        return "\n".join(head)
    theirs = theirs or {}
    dense = [next((r["dense_continuation_perplexity"] for r in res.get("rows", [])
                   if "dense_continuation_perplexity" in r), None) for res in (ours, theirs)]
    head.append("Dense continuation perplexity: prunelab's environment "
                f"{fmt(dense[0], '.3f')}, kvpress' "
                f"{fmt(dense[1] if len(dense) > 1 else None, '.3f')}. Versions: prunelab "
                f"side {ours.get('versions')}, kvpress side {theirs.get('versions')}.")
    head.append("")
    headers = ["press", "removed", "kept / prompt entries (pl / kv)", "ppl prunelab",
               "ppl kvpress", "KL prunelab", "KL kvpress", "KL ratio", "top-1 (pl / kv)",
               "CPU s pl / kv (ratio)", "wall s pl / kv", "peak MiB pl / kv (ratio)", "gap"]
    head.append(markdown_table(headers, _rows(ours, theirs)))
    head += ["", f"kept: cache entries per layer after the prefill, of {p['prompt']:,}. "
             "CPU s / wall s: the pressed runs (prefill, eviction, continuation) summed over "
             "the windows, process CPU time and wall time. The two sides ran at the same "
             "time, each in its own process with one thread, under the affinity above: "
             "where they share a core wall time counts the other's turns, so CPU time is "
             "the figure to compare. peak: RSS over the RSS before the pressed runs, per "
             "process, with glibc's mmap threshold at 64 KiB on both sides "
             "(`common.EXACT_RSS`: RSS then follows the live tensors; without it repeats "
             "of one press in one process varied by 50-70 MiB, the size of the memory "
             "'gap' an earlier run showed for SnapKV). adakv: prunelab pads every KV head "
             "of a block to its longest head (kept = that padded length), kvpress keeps the "
             "whole prompt and masks the evicted entries (kept = the prompt); pyramidkv: "
             "the mean over blocks of their different lengths."]
    head += ["", *retrieval_section(proto, ours, theirs)]
    return "\n".join(head)


def retrieval_section(proto, ours: dict, theirs: dict) -> list[str]:
    """The pass-key table: hits per press and ratio, both sides."""
    lengths, depths = proto["needle_lengths"], proto["needle_depths"]
    n = len(lengths) * len(depths)

    def hits(res, press, r):
        for row in res.get("rows", []):
            if row["press"] == press and (press == "dense" or row["ratio"] == r) \
                    and "needle_hits" in row:
                return row["needle_hits"]
        return None

    def cell(h):
        if h is None:
            return "-"
        per = " ".join("".join("x" if v else "." for v in h[i * len(depths):
                                                          (i + 1) * len(depths)])
                       for i in range(len(lengths)))
        return f"{sum(h)} / {len(h)} ({per})"

    out = ["### Retrieval: pass key at " + " and ".join(f"{x:,}" for x in lengths)
           + " tokens", "",
           f"{n} prompts (`benchmarks/inference_pruning.py`'s pass-key prompt: the key "
           "sentence at relative depths " + " / ".join(f"{d:g}" for d in depths) + " of a "
           "`wiki-vital:test` haystack, then the question), prefilled under the press and "
           "answered greedily (8 tokens) on the compressed cache by the same code on both "
           "sides (`continuation.needle_answer`); a hit is the key's digits in the answer. "
           "Pattern: one mark per depth (x found, . missed), one group per length.", ""]
    dense = (hits(ours, "dense", 0), hits(theirs, "dense", 0))
    rows = [["dense", "0", cell(dense[0]), cell(dense[1]), "-"]]
    for r in proto["ratios"]:
        if r not in proto.get("needle_ratios", proto["ratios"]):
            continue
        for press in PRESSES:
            a, b = hits(ours, press, r), hits(theirs, press, r)
            g = "**gap**" if a is not None and b is not None and sum(a) < sum(b) else "-"
            rows.append([press, f"{r:.2f}", cell(a), cell(b), g])
    out.append(markdown_table(["press", "removed", "prunelab hits", "kvpress hits", "gap"],
                              rows))
    return out
