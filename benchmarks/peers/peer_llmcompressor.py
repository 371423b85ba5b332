"""Peer: llm-compressor (0.14.0.1), Wanda / SparseGPT at 50 % and 2:4, against prunelab's.

Delegates to the existing benchmark, ``benchmarks/sparsity_vs_llmcompressor.py`` (with its
worker ``benchmarks/_llmc_worker.py``; both stay where they are for now), run as a
subprocess with ``--json`` and ``--keep`` and its venv at ``.bench/peers/llmc-venv``: it
prunes with both libraries on the same calibration windows (each job a fresh process),
reports wall time and peak RSS of the pruning call and the test perplexity. This module
adds the KL to the dense model: it rebuilds the test ``TokenBatches`` with the script's
arguments, checks that their sha256 is the one the script reported, and scores both
sides' kept checkpoints with :func:`scoring.score_dirs` (one evaluator, one reference).

Full protocol: the script's defaults (64 x 512 calibration tokens, 32 x 512 test tokens,
wanda-0.5, sparsegpt-0.5, wanda-2:4, sparsegpt-2:4). ``--quick``: 8 x 128 calibration,
4 x 128 test, wanda-0.5 and sparsegpt-2:4.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
import scoring
from table import fmt, gap, markdown_table, ratio

NAME = "llm-compressor"
HERE = Path(__file__).resolve().parent
SCRIPT = common.ROOT / "benchmarks" / "sparsity_vs_llmcompressor.py"


def arguments(quick: bool) -> list[str]:
    if quick:
        return ["--samples", "8", "--seqlen", "128", "--test-samples", "4", "--settings",
                "wanda-0.5,sparsegpt-2:4"]
    return []


def run(ctx) -> tuple[str, dict]:
    import prunelab
    from prunelab.data import make_batches

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    workdir = ctx.workdir / "llm-compressor"
    workdir.mkdir(parents=True, exist_ok=True)
    out_json = workdir / "sparsity.json"
    cmd = [sys.executable, str(SCRIPT), "--model", ctx.model, *arguments(ctx.quick),
           "--venv", str(common.BENCH / "llmc-venv"), "--keep", "--skip-lower-bound",
           "--json", str(out_json)]
    log = workdir / "sparsity.log"
    env = {**os.environ, **common.ONE_THREAD}
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    shown = " ".join(["python", str(SCRIPT.relative_to(common.ROOT)), *cmd[2:]])
    if rc != 0 or not out_json.is_file():
        tail = " | ".join(log.read_text(errors="replace").splitlines()[-6:])
        return _head(ctx, started, shown) + f"\n\nFailed (exit {rc}): `{tail}`", {"rc": rc}
    res = json.loads(out_json.read_text())
    lm = prunelab.load(ctx.model, dtype="float32", device="cpu")
    test = make_batches(lm.tokenizer, "wiki-vital:test", seqlen=res["seqlen"],
                        samples=res["test_samples"])
    del lm
    if test.sha256 != res["test"]["sha256"]:
        raise common.IdsMismatch(f"llm-compressor: test windows {test.sha256[:12]} != the "
                                 f"script's {res['test']['sha256'][:12]}")
    dirs = {}
    for s, sides in res["results"].items():
        for side in ("prunelab", "llmc"):
            if "save_dir" in sides[side]:
                dirs[f"{s}/{side}"] = sides[side]["save_dir"]
    scores = scoring.score_dirs(ctx.model, test, dirs)
    for path in dirs.values():
        shutil.rmtree(path, ignore_errors=True)
    res["scores"] = scores
    return section(ctx, started, shown, res), res


def _head(ctx, started, shown) -> str:
    return "\n".join([
        "## llm-compressor: Wanda, SparseGPT, 2:4", "",
        f"Run {started}, commit `{ctx.commit}`, {ctx.machine}; command: `{ctx.command}`, "
        f"which runs `{shown}`."])


def section(ctx, started, shown, res) -> str:
    sc = res["scores"]
    lines = [_head(ctx, started, shown), "",
             f"{res['model']}, {res['dtype']}, CPU; calibration {res['samples']} x "
             f"{res['seqlen']} tokens of `wiki-vital:calib` (sha256 "
             f"`{res['calib']['sha256'][:16]}`, the same ids on both sides), test "
             f"{res['test_samples']} x {res['seqlen']} of `wiki-vital:test` (sha256 "
             f"`{res['test']['sha256'][:16]}`, rebuilt and checked here); both sides' pruned "
             "checkpoints scored by prunelab's evaluator against the dense model "
             f"(dense perplexity {fmt(sc['dense']['perplexity'], '.3f')}). Wall time and "
             "peak RSS (over the RSS before the call) of the pruning call alone, each in a "
             f"fresh process; llm-compressor {_version(res)} in its own venv.", ""]
    headers = ["setting", "ppl prunelab", "ppl llmc", "KL prunelab", "KL llmc", "KL ratio",
               "wall s pl / llmc (ratio)", "peak MiB pl / llmc (ratio)",
               "sparsity pl / llmc", "gap"]
    rows = []
    for s, sides in res["results"].items():
        a, b = sides["prunelab"], sides["llmc"]
        sa, sb = sc.get(f"{s}/prunelab", {}), sc.get(f"{s}/llmc", {})
        g = " ".join(x for x in (gap(sa.get("perplexity"), sb.get("perplexity"), 0.001),
                                 gap(sa.get("kl"), sb.get("kl"), 0.02)) if x)
        rows.append([s, fmt(sa.get("perplexity"), ".3f"), fmt(sb.get("perplexity"), ".3f"),
                     fmt(sa.get("kl"), ".4f"), fmt(sb.get("kl"), ".4f"),
                     ratio(sa.get("kl"), sb.get("kl")),
                     f"{fmt(a.get('seconds'), '.1f')} / {fmt(b.get('seconds'), '.1f')} "
                     f"({ratio(a.get('seconds'), b.get('seconds'))})",
                     f"{fmt(a.get('extra_peak_mib'), '.0f')} / "
                     f"{fmt(b.get('extra_peak_mib'), '.0f')} "
                     f"({ratio(a.get('extra_peak_mib'), b.get('extra_peak_mib'))})",
                     f"{fmt(a.get('achieved_sparsity'), '.3f')} / "
                     f"{fmt(b.get('achieved_sparsity'), '.3f')}", g or "-"])
        for side, r in (("prunelab", a), ("llm-compressor", b)):
            if "error" in r:
                lines.append(f"{s}: the {side} job failed ({r['error']}, log `{r.get('log')}`).")
    lines.append(markdown_table(headers, rows))
    lines += ["", "Wall times on one core shared with other jobs during this run: read "
              "them as orders of magnitude; the quality columns do not depend on it."]
    return "\n".join(lines)


def _version(res) -> str:
    for sides in res["results"].values():
        v = sides["llmc"].get("versions")
        if v:
            return f"{v.get('llmcompressor')} (transformers {v.get('transformers')})"
    return "(version not reported)"
