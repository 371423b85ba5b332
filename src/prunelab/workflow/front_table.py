"""The served front as rows, a Markdown table and a CSV (from ``front.json``)."""

from __future__ import annotations

import csv
import io
import math
import statistics

from prunelab.workflow.front_grid import parse_point
from prunelab.workflow.front_select import mark_fronts

COLUMNS = ("file", "model", "type", "mib", "ppl", "ppl_lo", "ppl_hi", "gen", "gen_x",
           "gen_x_lo", "gen_x_hi", "prompt", "prompt_x", "prompt_x_lo", "prompt_x_hi",
           "fallbacks", "front_size", "front_speed", "made")


def _ratio_stats(runs: list, base: list, j: int) -> tuple[float, float, float] | None:
    """Median, min and max over rounds of ``runs[r][j] / base[r][j]`` (rounds where both
    were measured)."""
    rs = [a[j] / b[j] for a, b in zip(runs, base, strict=False)
          if a is not None and b is not None and b[j] > 0]
    return (statistics.median(rs), min(rs), max(rs)) if rs else None


def paired(front: dict, a: str, b: str) -> tuple[float, float] | None:
    """The perplexity ratio of file ``a`` to file ``b`` (keys of ``front["files"]``) and
    the standard error of its log over the windows both were scored on (paired: the windows'
    own spread cancels); None when the per-window figures are missing."""
    wa = front["files"][a].get("nll_windows")
    wb = front["files"][b].get("nll_windows")
    if not wa or not wb or len(wa) != len(wb):
        return None
    d = [x - y for x, y in zip(wa, wb, strict=True)]
    mean = statistics.fmean(d)
    sem = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
    return math.exp(mean), sem


def made(front: dict, rec: dict) -> str:
    """How a file was made, in words."""
    model = rec["model"]
    if model == "dense":
        what = "the dense model"
    elif model == "dense-heal":
        what = ("the dense model fine-tuned as the healed points are (the control of a heal "
                "that fits the calibration text)")
    else:
        what = parse_point(front["models"][model]["spec"]).describe()
        heal = front.get("settings", {}).get("heal") or {}
        loss = heal.get("loss", "kd")
        how = "full fine-tune" if heal.get("full") else "LoRA"
        length = f"{heal['steps']} steps" if heal.get("steps") else \
            f"{heal['tokens']} tokens" if heal.get("tokens") else "100 steps"
        if loss != "kd":  # the heal fitted the calibration text, not the dense model
            what = what.replace("healed by distillation",
                                f"healed by fine-tuning ({loss}; {how}, {length})")
        else:
            what = what.replace("healed by distillation",
                                f"healed by distillation ({how}, {length})")
    if rec["type"] in ("f16", "f32", "bf16"):
        return f"{what}, {rec['type']}"
    im = "with" if rec.get("imatrix") else "without"
    return f"{what}, quantized {rec['type']} by llama.cpp {im} an importance matrix"


def front_rows(front: dict) -> list[dict]:
    """One row per measured file (see :data:`COLUMNS`), Pareto flags set."""
    rounds = front.get("speed", {}).get("rounds", [])
    rows = []
    for key, rec in front["files"].items():
        if rec.get("ppl") is None:
            continue
        runs = [r.get(key) for r in rounds]
        dense_key = f"dense.{rec['type']}"
        base = [r.get(dense_key) for r in rounds]
        sem = rec.get("nll_sem")
        nll = rec.get("nll", math.log(rec["ppl"]))
        row = {"file": rec["path"], "model": rec["model"], "type": rec["type"],
               "mib": rec["bytes"] / 2**20, "ppl": rec["ppl"],
               "ppl_lo": math.exp(nll - sem) if sem and math.isfinite(sem) else None,
               "ppl_hi": math.exp(nll + sem) if sem and math.isfinite(sem) else None,
               "fallbacks": len(rec.get("fallbacks") or []), "made": made(front, rec)}
        measured = [x for x in runs if x is not None]
        row["prompt"] = statistics.median(x[0] for x in measured) if measured else None
        row["gen"] = statistics.median(x[1] for x in measured) if measured else None
        for j, name in ((0, "prompt_x"), (1, "gen_x")):
            st = _ratio_stats(runs, base, j) if any(b is not None for b in base) else None
            row[name], row[f"{name}_lo"], row[f"{name}_hi"] = st or (None, None, None)
        rows.append(row)
    mark_fronts(rows)
    return rows


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(front: dict, rows: list[dict]) -> str:
    """The table: every file, sorted by size, front members in bold."""
    s = front["settings"]
    lines = ["| file | type | MiB | perplexity [± 1 s.e.] | generation tok/s | x dense "
             "[range] | prompt tok/s | x dense [range] | front | how it was made |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["mib"], r["ppl"])):
        mark = "/".join(m for m, k in (("size", "front_size"), ("speed", "front_speed"))
                        if r[k])
        bold = "**" if r["front_size"] else ""
        ppl = f"{bold}{r['ppl']:.3f}{bold}"
        if r["ppl_lo"] is not None:
            ppl += f" [{r['ppl_lo']:.2f}-{r['ppl_hi']:.2f}]"
        cells = []
        for name in ("gen", "prompt"):
            cells.append(_f(r[name], ".1f"))
            x = r[f"{name}_x"]
            cells.append("-" if x is None else
                         f"{x:.2f} [{r[f'{name}_x_lo']:.2f}-{r[f'{name}_x_hi']:.2f}]")
        fb = f" ({r['fallbacks']} weights fell back)" if r["fallbacks"] else ""
        lines.append(f"| {r['file'].split('/')[-1]} | {r['type']} | {r['mib']:.1f} | {ppl} | "
                     f"{cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {mark or ''} | "
                     f"{r['made']}{fb} |")
    head = (f"Model {s['model']}; perplexity inside llama.cpp on {s['windows']} windows of "
            f"{s['test_seqlen']} tokens of {s['test']} (s.e. over windows); speeds: median of "
            f"{len(front.get('speed', {}).get('rounds', []))} rounds, {s['prompt']}-token "
            f"prompt, {s['gen']} generated tokens, ratios to the dense file of the same type "
            "taken within a round. Every file is scored on the same windows, so a difference "
            "between two files is far more certain than these intervals, which show how the "
            "windows differ from each other (the answers above give paired errors). Bold: on "
            "the size / perplexity front; the front column names the Pareto fronts a file is "
            "on.\n\n")
    return head + "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    return buf.getvalue()
