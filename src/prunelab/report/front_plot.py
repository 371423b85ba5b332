"""Plots of a served front: perplexity against file size and against generation speed,
every file a point (the dense ladder in grey, each pruned model its own colour, the type
written beside it), the Pareto-optimal files joined by a line."""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from prunelab.io.files import atomic_file

PLOTS = {"size": ("front_size.png", "mib", "file size (MiB)", "front_size"),
         "speed": ("front_speed.png", "gen", "generation tokens/s (median)", "front_speed")}


def plot_front(rows: list[dict], out_dir: str | Path, title: str = "served front") -> list[Path]:
    """Write ``front_size.png`` and (when speeds were measured) ``front_speed.png`` in
    ``out_dir`` from the front's rows (see :func:`prunelab.workflow.front_table.front_rows`:
    ``model``, ``type``, ``mib``, ``ppl``, ``gen`` and the two front flags)."""
    written = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    cmap = colormaps["tab10"]
    colours = {m: ("0.45" if m == "dense" else cmap((i - 1) % 10)) for i, m in
               enumerate(models)}
    for name, x_key, x_label, flag in PLOTS.values():
        pts = [r for r in rows if r.get(x_key) is not None and r.get("ppl") is not None]
        if not pts:
            continue
        fig = Figure(figsize=(9, 6))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for m in models:
            mine = [r for r in pts if r["model"] == m]
            ax.scatter([r[x_key] for r in mine], [r["ppl"] for r in mine], s=28,
                       color=colours[m], label=m, zorder=3,
                       marker="s" if m == "dense" else "o")
            for r in mine:
                ax.annotate(r["type"], (r[x_key], r["ppl"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points", color=colours[m])
        front = sorted((r for r in pts if r.get(flag)), key=lambda r: r[x_key])
        if front:
            ax.plot([r[x_key] for r in front], [r["ppl"] for r in front], color="black",
                    lw=1, ls="--", zorder=2, label="Pareto front")
        ax.set_xlabel(x_label + (" (log scale)" if x_key == "mib" else ""))
        ax.set_ylabel("perplexity in llama.cpp (lower is better)")
        ax.set_yscale("log")
        if x_key == "mib":  # a ladder spans 3-4x in size: the small end needs the room
            ax.set_xscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = Path(out_dir) / name
        with atomic_file(path, overwrite=True) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        written.append(path)
    return written
