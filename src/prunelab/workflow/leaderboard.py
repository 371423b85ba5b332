"""Leaderboards of a study (markdown + CSV), its plots, and the HTML report.

Rows are ``{"method": label, **metrics}``; the columns are fixed (missing values are left
empty) plus one per downstream task. Plots: quality against parameters kept (test
perplexity, log scale, and KL to dense) and speed against parameters kept. The HTML page
comes from :func:`prunelab.report.html.write_report` when that module is installed; the
leaderboard and plots are written either way.
"""

from __future__ import annotations

import csv
import inspect
import io
from pathlib import Path
from typing import Any

from prunelab import log
from prunelab.io.files import write_json
from prunelab.workflow.evaluate import task_scores, zero_shot_average

#: (column, metric key, format)
COLUMNS = (("method", "method", "{}"), ("achieved", "achieved", "{}"),
           ("params", "params", "{:,}"), ("params_kept", "params_kept", "{:.3f}"),
           ("bytes", "bytes", "{:,}"), ("perplexity", "perplexity", "{:.3f}"),
           ("kl_to_dense", "kl_to_reference", "{:.4f}"),
           ("top1_agreement", "top1_agreement", "{:.4f}"),
           # under a press: the tokens scored on the compressed cache (the columns above
           # are then the whole window's; empty columns are not shown)
           ("continuation_perplexity", "continuation_perplexity", "{:.3f}"),
           ("continuation_kl", "continuation_kl_to_reference", "{:.4f}"),
           ("continuation_top1", "continuation_top1_agreement", "{:.4f}"))
TAIL = (("prefill_tok_s", "prefill_tokens_per_s", "{:.0f}"),
        ("decode_tok_s", "decode_tokens_per_s", "{:.1f}"),
        ("prefill_x_dense", "prefill_x_dense", "{}"),
        ("decode_x_dense", "decode_x_dense", "{}"),
        ("prune_seconds", "prune_seconds", "{:.1f}"),
        ("prune_peak_memory_bytes", "prune_peak_memory_bytes", "{:,}"),
        ("peak_memory_bytes", "peak_memory_bytes", "{:,}"))


def table(rows: list[dict], dense: dict | None = None) -> tuple[list[str], list[list]]:
    """Header and raw values of the leaderboard (``params_kept`` against ``dense``). A
    ``budget`` column follows ``method`` when rows carry one (a comparison at several
    budgets); the downstream tasks are followed by ``zero-shot avg`` (the mean of a row's
    task scores, :func:`~prunelab.workflow.evaluate.zero_shot_average`)."""
    tasks: list[str] = []
    for r in rows:
        tasks += [t for t in task_scores(r) if t not in tasks]
    budget = any("budget" in r for r in rows)
    avg = ["zero-shot avg"] if tasks else []
    head = [c for c, _, _ in COLUMNS]
    header = head[:1] + (["budget"] if budget else []) + head[1:] + tasks + avg + \
        [c for c, _, _ in TAIL]
    dense = dense or {}
    base = dense.get("nonzero_params") or dense.get("params")
    values = []
    for r in rows:
        r = dict(r)
        if base and r.get("params") and "params_kept" not in r:
            r["params_kept"] = r.get("nonzero_params", r["params"]) / base
        for short in ("prefill", "decode"):  # interleaved with dense: median [range]
            med = r.get(f"{short}_x_dense")
            if isinstance(med, (int, float)):
                r[f"{short}_x_dense"] = (
                    f"{med:.2f} [{r.get(f'{short}_x_dense_min', med):.2f}-"
                    f"{r.get(f'{short}_x_dense_max', med):.2f}]"
                    + (" noisy" if r.get(f"{short}_x_dense_noisy",
                                         r.get("speed_noisy")) else ""))
        ts = task_scores(r)
        cols = [r.get(k) for _, k, _ in COLUMNS]
        values.append(cols[:1] + ([r.get("budget")] if budget else []) + cols[1:]
                      + [ts.get(t) for t in tasks]
                      + ([zero_shot_average(r)] if tasks else [])
                      + [r.get(k) for _, k, _ in TAIL])
    return header, values


def _formats(header: list[str]) -> list[str]:
    fmts = {c: f for c, _, f in COLUMNS + TAIL}
    return [fmts.get(h, "{}" if h == "budget" else "{:.4f}") for h in header]


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return ""
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def display_rows(rows: list[dict], dense: dict | None = None) -> list[dict[str, str]]:
    """The leaderboard as text cells, each number at its column's precision, without the
    columns that are empty in every row (what the markdown and the HTML report show; the
    CSV keeps every column and the raw values)."""
    header, values = table(rows, dense)
    fmts = _formats(header)
    cells = [[_fmt(x, f) for x, f in zip(v, fmts, strict=True)] for v in values]
    keep = [j for j in range(len(header)) if any(c[j] for c in cells)]
    return [{header[j]: c[j] for j in keep} for c in cells]


def markdown(rows: list[dict], dense: dict | None = None) -> str:
    shown = display_rows(rows, dense)
    if not shown:
        return "(no evaluations)\n"
    header = list(shown[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in shown:
        lines.append("| " + " | ".join(r[h] for h in header) + " |")
    note = ""
    if any("noisy" in r.get(h, "") for r in shown for h in ("prefill_x_dense",
                                                            "decode_x_dense")):
        note = ("\nSpeed ratios are medians over rounds interleaved with the dense model "
                "[range]; noisy: a range wider than 20 % of its median, too wide to rank "
                "close models.\n")
    return "\n".join(lines) + "\n" + note


def csv_text(rows: list[dict], dense: dict | None = None) -> str:
    header, values = table(rows, dense)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    for v in values:
        w.writerow(["" if x is None else x for x in v])
    return buf.getvalue()


def plot_leaderboard(rows: list[dict], dense: dict | None, out: Path) -> list[Path]:
    """quality_vs_params.png (perplexity and KL against parameters kept) and
    speed_vs_params.png (prefill / decode tokens/s) when the rows have those metrics."""
    from matplotlib.figure import Figure

    from prunelab.probes.plots import save_figure

    header, values = table(rows, dense)
    col = {h: i for i, h in enumerate(header)}
    pts = [v for v in values if v[col["params_kept"]] is not None]
    written: list[Path] = []
    for name, keys, labels in (
            ("quality_vs_params.png", ("perplexity", "kl_to_dense"),
             ("test perplexity", "KL to dense (nats/token)")),
            ("speed_vs_params.png", ("prefill_tok_s", "decode_tok_s"),
             ("prefill tokens/s", "decode tokens/s"))):
        if not any(v[col[k]] is not None for v in pts for k in keys):
            continue
        fig = Figure(figsize=(10, 4))
        for ax, key, label in zip(fig.subplots(1, 2), keys, labels, strict=True):
            for v in pts:
                if v[col[key]] is None:
                    continue
                ax.scatter(v[col["params_kept"]], v[col[key]])
                text = f"{v[0]} {v[col['budget']]}" if "budget" in col and \
                    v[col["budget"]] else str(v[0])
                ax.annotate(text, (v[col["params_kept"]], v[col[key]]), fontsize=7,
                            xytext=(3, 3), textcoords="offset points")
            if key == "perplexity":
                ax.set_yscale("log")
            ax.set_xlabel("parameters kept (fraction of dense)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(save_figure(fig, out / name))
    return written


#: x axis of the budget curves: (row key, label) per budget kind
CURVE_AXES = {"remove-blocks": ("achieved_value", "blocks removed (parameter-equivalent)"),
              "keep-params": ("achieved_value", "parameters kept (fraction of dense)"),
              "remove-weights": ("achieved_value", "sparsity of the blocks' linear maps")}


def plot_curves(rows: list[dict], kind: str, out: Path) -> Path | None:
    """``budget_curves.png``: test perplexity (log scale) against the budget reached, one
    line per method over its budgets (``remove-blocks``: the depth pruning curve;
    ``keep-params`` / ``remove-weights``: quality against parameters kept / sparsity of the
    linears); the dense model is a dashed
    line. ``None`` when no row has both."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    from prunelab.probes.plots import save_figure

    key, xlabel = CURVE_AXES[kind]
    lines: dict[str, list[tuple[float, float]]] = {}
    dense = None
    for r in rows:
        if r.get("perplexity") is None:
            continue
        if "budget" not in r:
            dense = r["perplexity"] if r.get("method") == "dense" else dense
        elif r.get(key) is not None:
            lines.setdefault(str(r["method"]), []).append((r[key], r["perplexity"]))
    if not lines:
        return None
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for name, pts in lines.items():
        pts.sort()
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    if dense is not None:
        ax.axhline(dense, color="grey", linestyle="--", linewidth=1, label="dense")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:.4g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test perplexity (log scale)")
    ax.set_title("depth pruning curve" if kind == "blocks" else
                 f"quality against {'parameters kept' if kind == 'params' else 'sparsity'}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out / "budget_curves.png")


def write_study(out: Path, rows: list[dict], *, dense: dict | None = None,
                title: str = "prunelab", recipe: dict | None = None,
                probes: dict | None = None, commands: list[str] | None = None,
                summary: dict | None = None, curves: str | None = None,
                sections: dict[str, str] | None = None) -> dict:
    """Write ``leaderboard.md``, ``leaderboard.csv``, the plots (``curves``: the budget
    kind of a comparison at several budgets, adds ``budget_curves.png``) and (when
    available) ``report.html`` into ``out``; returns the paths written."""
    out = Path(out)
    extra = "".join(f"\n## {head}\n\n{text}" for head, text in (sections or {}).items())
    (out / "leaderboard.md").write_text(f"# {title}\n\n" + markdown(rows, dense) + extra)
    (out / "leaderboard.csv").write_text(csv_text(rows, dense))
    write_json(out / "leaderboard.json", rows, overwrite=True)
    plots = plot_leaderboard(rows, dense, out)
    if curves is not None:  # a comparison at several budgets of kind ``curves``
        curve = plot_curves(rows, curves, out)
        plots = ([curve] if curve is not None else []) + plots
    res = {"leaderboard": str(out / "leaderboard.md"), "csv": str(out / "leaderboard.csv"),
           "plots": [str(p) for p in plots]}
    html = _html_report(out, title=title, leaderboard=display_rows(rows, dense) or None,
                        plots={p.stem.replace("_", " "): p for p in plots},
                        probes=_probe_results(probes or {}),
                        probe_summary=_probe_summary(probes or {}), recipe=recipe,
                        commands=commands or None, summary=summary,
                        sections=sections or None)
    res["report"] = html
    return res


def _probe_results(paths: dict) -> dict:
    from prunelab.probes import ProbeResult

    return {name: ProbeResult.load(p) for name, p in paths.items() if Path(p).is_file()}


def _probe_summary(paths: dict) -> str | None:
    for p in paths.values():
        md = Path(p).parent / "summary.md"
        if md.is_file():
            return md.read_text()
    return None


def _html_report(out: Path, **kw) -> str | None:
    """``report.html`` through :func:`prunelab.report.html.write_report` (the keyword
    arguments it takes are passed); ``None`` with a warning when it is not installed."""
    try:
        from prunelab.report.html import write_report
    except ImportError:
        log.warn("report.html skipped: prunelab.report.html is not in this install "
                 "(leaderboard.md and the plots were written)")
        return None
    params = inspect.signature(write_report).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    args = {k: v for k, v in kw.items() if takes_all or k in params}
    path = write_report(out, **args)
    return str(path if path is not None else out / "report.html")
