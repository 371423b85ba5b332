"""The served front of a model in llama.cpp (``prunelab front``), timed, with the issue's
questions answered from its figures, written as one section of a results page.

    python benchmarks/served_front.py --model smollm2-135m --out out/front-smol \\
        --section smollm2 [--grid ...] [--types ...] [--grid-types ...] [--no-imatrix] \\
        [--heal-set steps=32] [--rounds 3] [--results benchmarks/results/served-front.md]

Runs (or resumes) the front exactly as the command does (same defaults), measures its
wall time (a resumed run reports the time of this run and says so), then writes, between
``<!-- section: NAME -->`` and ``<!-- end: NAME -->`` of the results page (created when
missing; other sections kept): date, commit, machine, command, wall time, the answers
(is a pruned file smaller than the dense q3_k_m with a lower perplexity? one at most the
size of the dense q2_k with a lower one, and by how much? the generation speed of the
pruned files on a front against the dense file of their type), the table, and the two
plots copied beside the page (``served-front/NAME-size.png``, ``NAME-speed.png``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import llama_cpp

from prunelab import log
from prunelab.workflow.front import build_front
from prunelab.workflow.front_state import make_settings
from prunelab.workflow.front_table import front_rows, markdown, paired


def _vs(front: dict, row: dict, base: dict) -> str:
    """`` (1.148x its perplexity, paired s.e. of the log 0.012)``: ``row`` against ``base``
    over the windows both were scored on."""
    got = paired(front, f"{row['model']}.{row['type']}", f"{base['model']}.{base['type']}")
    if got is None:
        return ""
    ratio, sem = got
    return f" ({ratio:.3f}x its perplexity, paired s.e. of the log ratio {sem:.3f})"


def answers(front: dict, rows: list[dict]) -> list[str]:
    """The issue's questions, answered yes or no with the figures."""
    dense = {r["type"]: r for r in rows if r["model"] == "dense"}
    pruned = [r for r in rows if not r["model"].startswith("dense")]
    out = []
    q3, q2 = dense.get("q3_k_m"), dense.get("q2_k")
    if q3 is not None:
        wins = sorted((r for r in pruned if r["mib"] < q3["mib"] and r["ppl"] < q3["ppl"]),
                      key=lambda r: r["ppl"])
        best = min((r for r in pruned if r["mib"] < q3["mib"]), key=lambda r: r["ppl"],
                   default=None)
        head = (f"- **Smaller than the dense q3_k_m ({q3['mib']:.1f} MiB, perplexity "
                f"{q3['ppl']:.3f}) with a lower perplexity: ")
        if wins:
            w = wins[0]
            out.append(head + f"yes**: {Path(w['file']).name}, {w['mib']:.1f} MiB, "
                       f"{w['ppl']:.3f}{_vs(front, w, q3)}; {len(wins)} such files.")
        else:
            near = "" if best is None else (f" (the best pruned file below its size: "
                                            f"{Path(best['file']).name}, {best['mib']:.1f} "
                                            f"MiB, {best['ppl']:.3f}{_vs(front, best, q3)})")
            out.append(head + f"no**{near}.")
    if q2 is not None:
        ok = sorted((r for r in pruned if r["mib"] <= q2["mib"]), key=lambda r: r["ppl"])
        head = (f"- **At most the size of the dense q2_k ({q2['mib']:.1f} MiB, perplexity "
                f"{q2['ppl']:.3f}), a lower perplexity: ")
        if ok and ok[0]["ppl"] < q2["ppl"]:
            w = ok[0]
            out.append(head + f"yes**: {Path(w['file']).name}, {w['mib']:.1f} MiB, "
                       f"{w['ppl']:.3f}{_vs(front, w, q2)}.")
        else:
            near = "" if not ok else (f" (the best pruned file at most that size: "
                                      f"{Path(ok[0]['file']).name}, {ok[0]['mib']:.1f} MiB, "
                                      f"{ok[0]['ppl']:.3f}{_vs(front, ok[0], q2)})")
            out.append(head + f"no**{near}.")
    on_front = [r for r in pruned if (r["front_size"] or r["front_speed"])
                and r.get("gen_x") is not None]
    if on_front:
        parts = [f"{Path(r['file']).name} {r['gen_x']:.2f}x [{r['gen_x_lo']:.2f}-"
                 f"{r['gen_x_hi']:.2f}]" for r in sorted(on_front, key=lambda r: r["mib"])]
        low = min(r["gen_x"] for r in on_front)
        out.append(f"- **Generation of the pruned files on a front against the dense file of "
                   f"their type** (median [range] of the rounds; goal 1.15x): "
                   f"{'; '.join(parts)}; the lowest {low:.2f}x.")
    for flag, key, what, unit, pick in (
            ("front_size", "mib", "smaller than", "MiB", min),
            ("front_speed", "gen", "generating faster than", "tokens/s", max)):
        dense_front = [r for r in rows if r[flag] and r["model"] == "dense"
                       and r.get(key) is not None]
        pruned_front = [r for r in rows if r[flag] and not r["model"].startswith("dense")]
        if dense_front and pruned_front:
            edge = pick(dense_front, key=lambda r: r[key])
            beyond = [r for r in pruned_front if pick(r[key], edge[key]) == r[key]
                      and r[key] != edge[key]]
            inside = len(pruned_front) - len(beyond)
            out.append(f"- **Where pruned files win on the {flag.split('_')[1]} front:** "
                       f"{what} the dense {edge['type']} ({edge[key]:.1f} {unit}, "
                       f"perplexity {edge['ppl']:.3f}) the front is {len(beyond)} pruned "
                       f"files and no dense one"
                       + (f"; {inside} more pruned files sit among the dense ones."
                          if inside else "; among the dense files, none."))
    size_front = [Path(r["file"]).name for r in sorted(rows, key=lambda r: r["mib"])
                  if r["front_size"]]
    out.append(f"- **On the size / perplexity front** (small to large): "
               f"{', '.join(size_front)}.")
    return out


def _cpu_seconds() -> tuple[float, float]:
    """``(busy CPU seconds of the whole machine since boot, CPU seconds of this process and
    its children)``: their difference over a run is what other work took."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle, iowait
    own = sum(getattr(resource.getrusage(who), f) for who in
              (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))
    return busy / os.sysconf("SC_CLK_TCK"), own


def _record_run(out: Path, seconds: float, resumed: bool, others: float) -> list[dict]:
    """Append this run's wall time and the CPU seconds other processes took meanwhile to
    ``OUT/bench.json``; return every run's record (a resumed front's time is the sum of its
    runs)."""
    path = out / "bench.json"
    runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    runs.append({"date": str(datetime.date.today()), "seconds": round(seconds, 1),
                 "resumed": resumed, "other_cpu_seconds": round(others, 1)})
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return runs


def _load_note(runs: list[dict]) -> str:
    """What the CPU time other processes took during the runs says about the machine:
    idle, or shared (wall times then longer than on an idle machine; speed ratios are
    taken within rounds, so they hold)."""
    timed = [r for r in runs if "other_cpu_seconds" in r]
    if not timed:
        return "Other work on the machine was not recorded."
    cores = sum(r["other_cpu_seconds"] for r in timed) / sum(r["seconds"] for r in timed)
    if cores < 0.1:
        return f"The machine was otherwise idle (other processes: {cores:.2f} cores on average)."
    return (f"The machine was shared: other processes took {cores:.2f} cores on average "
            f"during the timed runs, so wall times are longer and absolute tokens/s lower than "
            f"on an idle machine; ratios to the dense file are taken within rounds.")


def write_section(page: Path, name: str, body: str) -> None:
    start, end = f"<!-- section: {name} -->", f"<!-- end: {name} -->"
    text = page.read_text() if page.is_file() else "# The served front\n\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else \
        text.rstrip() + "\n\n" + block + "\n"
    page.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--section", required=True)
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/served-front.md"))
    ap.add_argument("--grid")
    ap.add_argument("--types")
    ap.add_argument("--grid-types")
    ap.add_argument("--no-imatrix", action="store_true")
    ap.add_argument("--heal-set", action="append", default=[])
    for name, default in (("samples", 32), ("seqlen", 256), ("windows", 8),
                          ("test-seqlen", 256), ("rounds", 3), ("threads", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    opts = ap.parse_args()

    heal = {}
    for item in opts.heal_set:  # KEY=VALUE: a JSON value (number, true / false) or a string
        key, _, value = item.partition("=")
        try:
            heal[key] = json.loads(value)
        except json.JSONDecodeError:
            heal[key] = value
    settings = make_settings(opts.model, grid=opts.grid, types=opts.types,
                             grid_types=opts.grid_types, imatrix=not opts.no_imatrix,
                             heal=heal or None, samples=opts.samples, seqlen=opts.seqlen,
                             windows=opts.windows, test_seqlen=opts.test_seqlen,
                             rounds=opts.rounds, threads=opts.threads)
    resumed = (opts.out / "front.json").is_file()
    start, (busy0, own0) = time.perf_counter(), _cpu_seconds()
    front = build_front(settings, opts.out)
    busy1, own1 = _cpu_seconds()
    runs = _record_run(opts.out, time.perf_counter() - start, resumed,
                       max(0.0, (busy1 - busy0) - (own1 - own0)))
    wall = sum(r["seconds"] for r in runs)
    rows = front_rows(front)
    models = front["models"]
    build = sum(m.get("seconds", 0) + m.get("prune", {}).get("seconds", 0)
                + m.get("heal", {}).get("seconds", 0) for m in models.values())
    heals = sum(m.get("heal", {}).get("seconds", 0) for m in models.values())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in
                Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    figures = opts.results.parent / "served-front"
    figures.mkdir(parents=True, exist_ok=True)
    links = []
    for kind in ("size", "speed"):
        src = opts.out / f"front_{kind}.png"
        if src.is_file():
            dst = figures / f"{opts.section}-{kind}.png"
            shutil.copyfile(src, dst)
            links.append(f"![{opts.section}: perplexity vs {kind}](served-front/{dst.name})")
    s = front["settings"]
    pruned_files = sum(1 for r in rows if not r["model"].startswith("dense"))
    body = [f"## {opts.model}: {len(rows)} files ({pruned_files} pruned), "
            f"{'with' if s['imatrix'] else 'without'} importance matrices", "",
            f"Measured {datetime.date.today()} at commit {commit} on {os.cpu_count()} cores "
            f"({cpu}), llama-cpp-python {llama_cpp.__version__}, "
            f"{s['threads'] or os.cpu_count()} llama.cpp threads.", "",
            f"Command: `python {' '.join(sys.argv)}` (the same front as `prunelab front "
            f"--model {opts.model} --out {opts.out}` with these options)", "",
            f"Wall time {wall / 60:.1f} min"
            + (f" over {len(runs)} runs of the command (resumed; each run's seconds in "
               f"{opts.out}/bench.json)" if len(runs) > 1 else "")
            + f"; building the models {build / 60:.1f} min of it, healing "
              f"{heals / 60:.1f} min. " + _load_note(runs), "",
            *answers(front, rows), "", *links, "", markdown(front, rows)]
    write_section(opts.results, opts.section, "\n".join(body))
    log.info(f"wrote section {opts.section} of {opts.results}")


if __name__ == "__main__":
    main()
