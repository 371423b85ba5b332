"""``report.html``: one self-contained page for a probe run, a sweep, a comparison or a run.

The page holds no script, no stylesheet link and no remote resource: the CSS is inline
and every figure is a base64 PNG in a ``data:`` URI, so it opens offline, in a mail, or
from a cluster's shared disk. Sections (each optional, in this order): model summary,
notes, leaderboard, plots, probes (one figure and the top-10 ranking per probe, the swap
heatmaps on a log colour scale and the diagonals as lines, the blocks each protocol would
remove, rank agreement, the swap decision rule, and the full probe summary), further
Markdown sections, and how to reproduce (commands, recipe).

:func:`write_report` takes what a caller has in memory; :func:`report_inputs` collects the
same from a folder of prunelab's outputs (used by ``prunelab report DIR``, see
:mod:`prunelab.report.folder`).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import yaml

from prunelab._version import __version__
from prunelab.io.files import write_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from prunelab.probes.base import ProbeResult

Image = Union[str, Path, bytes, "Figure"]
MAX_REMOVE = 5
TOP = 10

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;
 background:#fafafa;color:#222;line-height:1.45}
main{max-width:1200px;margin:0 auto;padding:1.5em 2em;background:#fff}
h1{font-size:1.6em;margin:.2em 0 .6em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;
 margin-top:1.8em}h3{margin-top:1.3em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.9em;display:block;
 max-width:100%;overflow-x:auto}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:.85em;color:#555}
pre{background:#f6f8fa;padding:.8em;overflow-x:auto;font-size:.85em;border:1px solid #e4e4e4}
code{font-family:ui-monospace,Menlo,Consolas,monospace}
details{margin:.8em 0}summary{cursor:pointer;font-weight:600}
nav a{margin-right:1em}.meta{color:#666;font-size:.85em}
"""


# ---------------------------------------------------------------- small pieces
def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def fmt(v: Any) -> str:
    """A cell: 4 significant digits for floats, ``-`` for missing, lists joined."""
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 10000 else f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 10000:
        return f"{v:,}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True, default=str)
    return str(v)


def _is_num(v: Any) -> bool:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return True
    try:
        float(str(v).replace(",", "").split(" [")[0])
        return True
    except ValueError:
        return False


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """An HTML table of ``rows`` (columns: ``columns`` or the union of the rows' keys)."""
    if not rows:
        return "<p>No rows.</p>"
    cols = list(columns) if columns else list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cls = ' class="num"' if v is not None and _is_num(v) else ""
            cells.append(f"<td{cls}>{esc(fmt(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def markdown(text: str) -> str:
    """Markdown (CommonMark with tables; raw HTML escaped) as HTML, via markdown-it-py."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable("table").render(text)


def png_bytes(image: Image, dpi: int = 110) -> bytes:
    """PNG bytes of a figure, a PNG file or PNG bytes."""
    if isinstance(image, bytes):
        return image
    if isinstance(image, (str, Path)):
        return Path(image).read_bytes()
    buf = io.BytesIO()
    image.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def img(image: Image, caption: str = "") -> str:
    """A ``<figure>`` with the image inline as a base64 ``data:`` URI."""
    data = base64.b64encode(png_bytes(image)).decode("ascii")
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return (f'<figure><img alt="{esc(caption or "figure")}" '
            f'src="data:image/png;base64,{data}">{cap}</figure>')


# ---------------------------------------------------------------- sections
def _summary_section(summary: Mapping[str, Any]) -> str:
    rows = [{"": k, "value": v} for k, v in summary.items()]
    return table(rows, ["", "value"])


def _leaderboard_section(board) -> str:
    """The leaderboard: rows, or a CSV file whose numbers are read back as numbers (so
    they print at 4 significant digits, counts with thousands separators); columns empty
    in every row are left out."""
    if isinstance(board, (str, Path)):
        with open(board, newline="") as fh:
            board = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(fh)]
    rows = list(board)
    cols = [c for c in dict.fromkeys(k for r in rows for k in r)
            if any(r.get(c) not in (None, "") for r in rows)]
    return table(rows, cols)


def _number(text: str | None) -> Any:
    """A CSV cell as an int or a float when it is one, else unchanged."""
    if text is None:
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def _plots_section(plots) -> str:
    items = plots.items() if isinstance(plots, Mapping) else (
        (Path(p).stem if isinstance(p, (str, Path)) else f"figure {i + 1}", p)
        for i, p in enumerate(plots))
    return "".join(img(image, caption) for caption, image in items)


def _ranking_rows(result: ProbeResult) -> list[dict]:
    vals = result.layer_values()
    return [{"rank": k + 1, "block": i, "removability (lower = more removable)": vals[i]}
            for k, i in enumerate(result.ranking()[:TOP])]


def _probe_section(results: Mapping[str, ProbeResult], probe_summary: str | None) -> str:
    from prunelab.probes import comparison as ps
    from prunelab.probes.plots import plot_result, plot_swap_pair
    from prunelab.probes.swap_plots import plot_swap_diagonals

    parts = []
    rep, inter = results.get("replacement"), results.get("interchange")
    if rep is not None and inter is not None:
        parts.append("<h3>Swap protocols: replacement and interchange</h3>")
        parts.append(img(plot_swap_pair(rep, inter), "pair heatmaps, one colour scale "
                         "(log when the values span more than a decade)"))
        parts.append(img(plot_swap_diagonals({"replacement": rep, "interchange": inter}),
                         "each diagonal (i, i+d) against i; bands: bootstrap intervals; "
                         "dotted: the decision rule's threshold 0.10"))
        rule = [d for d in ps.decision_rule(rep, inter) if d["layers"][1] - d["layers"][0] == 1]
        if rule:
            parts.append("<h4>Decision rule (adjacent pairs, threshold 0.10)</h4>")
            parts.append(table([{"pair": f"{d['layers'][0]}-{d['layers'][1]}", **{
                k: d[k] for k in ("replacement", "interchange", "replacement_class",
                                  "interchange_class", "rule")}} for d in rule]))
    for name, res in results.items():
        parts.append(f"<h3>{esc(name)} <code>{esc(res.probe)}</code> ({esc(res.kind)})</h3>")
        parts.append(img(plot_result(res), f"{name}: block indices 0-based"))
        rows = _ranking_rows(res) if res.kind not in ("span", "interval", "head") else []
        if rows:
            parts.append(f"<details><summary>top {len(rows)} blocks</summary>"
                         f"{table(rows)}</details>")
    names = [n for n, r in results.items() if r.kind != "head"]
    if names:
        parts.append("<h3>Blocks each protocol would remove</h3>")
        parts.append(table([{"n": n, **{name: ps.removal_cell(results[name], n)
                                        for name in names}}
                            for n in range(1, MAX_REMOVE + 1)], ["n", *names]))
    corr = ps.rank_correlations(dict(results))
    if corr:
        parts.append("<h3>Protocol agreement (rank correlation of per-block removability)"
                     "</h3>")
        parts.append(table(corr, ["a", "b", "n", "spearman", "kendall"]))
    if probe_summary:
        parts.append("<details><summary>full probe summary (summary.md)</summary>"
                     f"{markdown(probe_summary)}</details>")
    return "".join(parts)


def _reproduce_section(commands, recipe) -> str:
    parts = []
    if commands:
        text = commands if isinstance(commands, str) else "\n".join(commands)
        parts.append(f"<h3>Commands</h3><pre><code>{esc(text.strip())}</code></pre>")
    if recipe:
        if isinstance(recipe, Path):
            recipe = recipe.read_text()
        if not isinstance(recipe, str):
            recipe = yaml.safe_dump(recipe, sort_keys=False)
        parts.append(f"<h3>Recipe</h3><pre><code>{esc(recipe.strip())}</code></pre>")
    return "".join(parts)


# ---------------------------------------------------------------- public
def render_report(*, title: str = "prunelab report", summary: Mapping[str, Any] | None = None,
                  notes: str | None = None,
                  leaderboard: Sequence[Mapping[str, Any]] | str | Path | None = None,
                  plots: Mapping[str, Image] | Sequence[Image] | None = None,
                  probes: Mapping[str, ProbeResult] | None = None,
                  probe_summary: str | None = None,
                  sections: Mapping[str, str] | None = None,
                  commands: str | Sequence[str] | None = None,
                  recipe: str | Path | Mapping | None = None) -> str:
    """The page as a string (see :func:`write_report` for the arguments)."""
    body: list[tuple[str, str, str]] = []  # (anchor, heading, html)
    if summary:
        body.append(("summary", "Model summary", _summary_section(summary)))
    if notes:
        body.append(("notes", "Notes", markdown(notes)))
    if leaderboard is not None:
        body.append(("leaderboard", "Leaderboard", _leaderboard_section(leaderboard)))
    if plots:
        body.append(("plots", "Plots", _plots_section(plots)))
    if probes:
        body.append(("probes", "Probes", _probe_section(probes, probe_summary)))
    for k, (head, text) in enumerate((sections or {}).items()):
        body.append((f"section-{k}", head, markdown(text)))
    if commands or recipe:
        body.append(("reproduce", "Reproduce", _reproduce_section(commands, recipe)))
    nav = " ".join(f'<a href="#{a}">{esc(h)}</a>' for a, h, _ in body)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    content = "".join(f'<section id="{a}"><h2>{esc(h)}</h2>{x}</section>' for a, h, x in body)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body><main>"
            f"<h1>{esc(title)}</h1><p class=\"meta\">prunelab {esc(__version__)}, "
            f"{stamp}; block indices are 0-based.</p><nav>{nav}</nav>{content}"
            "</main></body></html>\n")


def write_report(out_dir: str | Path, *, filename: str = "report.html",
                 title: str = "prunelab report", summary: Mapping[str, Any] | None = None,
                 notes: str | None = None,
                 leaderboard: Sequence[Mapping[str, Any]] | str | Path | None = None,
                 plots: Mapping[str, Image] | Sequence[Image] | None = None,
                 probes: Mapping[str, ProbeResult] | None = None,
                 probe_summary: str | None = None,
                 sections: Mapping[str, str] | None = None,
                 commands: str | Sequence[str] | None = None,
                 recipe: str | Path | Mapping | None = None,
                 overwrite: bool = True) -> Path:
    """Write ``out_dir/filename`` atomically and return its path; an existing file is
    replaced only with ``overwrite`` (a folder never); a failure, a full disk included,
    is one line (:class:`~prunelab.errors.OutputWriteError`) and leaves nothing behind.

    Every part is optional: ``summary`` (key -> value: model, parameters, data...),
    ``notes`` (Markdown), ``leaderboard`` (rows as dicts, or a CSV path), ``plots``
    (caption -> figure / PNG path / PNG bytes, or a list of them), ``probes`` (name ->
    :class:`~prunelab.probes.base.ProbeResult`; figures, rankings, agreement and the swap
    decision rule are drawn from them), ``probe_summary`` (the Markdown of
    :func:`~prunelab.probes.summary.write_summary`, shown folded), ``sections`` (heading ->
    Markdown, e.g. a sweep's ``curve.md``), ``commands`` (the exact commands to reproduce)
    and ``recipe`` (YAML text, a path, or a dict dumped as YAML)."""
    page = render_report(title=title, summary=summary, notes=notes, leaderboard=leaderboard,
                         plots=plots, probes=probes, probe_summary=probe_summary,
                         sections=sections, commands=commands, recipe=recipe)
    return write_text(Path(out_dir) / filename, page, overwrite=overwrite)
