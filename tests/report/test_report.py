"""report.html and the readable swap plots: log colour scale, diagonals as lines, a
self-contained page (no script, no network), ``prunelab report DIR``, headless Chromium."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import LogNorm, Normalize

from prunelab.cli import cli_main
from prunelab.io.files import write_json
from prunelab.models.loading import wrap
from prunelab.probes import ProbeResult
from prunelab.probes.plots import pair_norm, plot_result, plot_swap_pair
from prunelab.probes.session import run_probes
from prunelab.probes.swap_plots import diagonal_offsets, plot_swap_diagonals
from prunelab.report.html import write_report

from tiny_models import tiny_model, tiny_tokens

N = 30


def smollm_like(probe: str, window: int = 1, ci: bool = False,
                scale: float = 1.0) -> ProbeResult:
    """SmolLM2 at --window 1 as reported: (0,1) and (28,29) at KL 5-7.5, the middle pairs
    0.07-0.6 (window 2 adds the pairs (i, i+2) at twice the value)."""
    scores = []
    for d in range(1, window + 1):
        for i in range(N - d):
            v = 0.07 + 0.53 * (i % 7) / 6
            v = {0: 7.5, N - 2: 5.0}.get(i, v) * d * scale
            s = {"layers": [i, i + d], "value": v}
            if ci:
                s.update(ci_low=v * 0.8, ci_high=v * 1.25)
            scores.append(s)
    return ProbeResult(probe=probe, config={"window": window}, kind="pair", num_blocks=N,
                       scores=scores)


def _rgba(image, value: float) -> np.ndarray:
    return np.array(image.cmap(image.norm(value)))


# ---------------------------------------------------------------- plots
def test_pair_norm_log_over_a_decade_else_linear():
    norm = pair_norm(np.array([0.07, np.nan, 0.6, 7.5]))
    assert isinstance(norm, LogNorm) and (norm.vmin, norm.vmax) == (0.07, 7.5)
    lin = pair_norm(np.array([0.2, 0.5, np.nan]))
    assert type(lin) is Normalize and (lin.vmin, lin.vmax) == (0.2, 0.5)
    assert type(pair_norm(np.array([0.0, 7.5]))) is Normalize  # log needs positive values
    assert (pair_norm(np.array([np.nan])).vmin, pair_norm(np.array([np.nan])).vmax) == (0, 1)


def test_swap_heatmap_separates_the_middle_pairs(tmp_path):
    rep, inter = smollm_like("replacement"), smollm_like("interchange")
    fig = plot_swap_pair(rep, inter, tmp_path / "swap.png")
    assert (tmp_path / "swap.png").stat().st_size > 5000
    images = [ax.images[0] for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in fig.axes if ax.images] == ["replacement", "interchange"]
    assert isinstance(images[0].norm, LogNorm) and images[0].get_clim() == (0.07, 7.5)
    # the lowest and highest middle pairs now get clearly different colours; on the old
    # linear scale over 0.07..7.5 they were nearly the same
    low, high = _rgba(images[0], 0.07), _rgba(images[0], 0.6)
    assert np.abs(low - high).max() > 0.3
    linear = images[0].cmap(Normalize(0.07, 7.5)(np.array([0.07, 0.6])))
    assert np.abs(linear[0] - linear[1]).max() < 0.15
    single = plot_result(rep)  # a single pair probe's own figure uses the same scale
    assert isinstance(single.axes[0].images[0].norm, LogNorm)
    assert "log colour" in single.axes[0].get_title()


def test_swap_diagonals_lines_with_intervals(tmp_path):
    rep = smollm_like("replacement", window=2, ci=True)
    inter = smollm_like("interchange", window=2)  # no intervals: no band
    assert diagonal_offsets(rep) == [1, 2]
    fig = plot_swap_diagonals({"replacement": rep, "interchange": inter},
                              tmp_path / "diag.png")
    assert (tmp_path / "diag.png").stat().st_size > 5000
    axes = [ax for ax in fig.axes if ax.lines]
    assert [ax.get_title() for ax in axes] == ["diagonal d = 1: pairs (i, i+1)",
                                               "diagonal d = 2: pairs (i, i+2)"]
    for d, ax in zip((1, 2), axes, strict=True):
        rep_line, inter_line = [ln for ln in ax.lines if ln.get_label() in
                                ("replacement", "interchange")]
        assert list(rep_line.get_xdata()) == list(range(N - d))
        expect = [s["value"] for s in rep.scores if s["layers"][1] - s["layers"][0] == d]
        assert list(rep_line.get_ydata()) == expect
        assert len(ax.collections) == 1  # one bootstrap band: replacement's
        band = ax.collections[0].get_paths()[0].vertices
        assert band[:, 1].max() == pytest.approx(7.5 * d * 1.25)
        assert ax.get_yscale() == "log"
        assert any(ln.get_ydata()[0] == 0.10 for ln in ax.lines)  # the threshold


# ---------------------------------------------------------------- the page
def _images(page: str) -> list[bytes]:
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', page)
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    return [base64.b64decode(s.split(",", 1)[1]) for s in srcs]


def _assert_self_contained(page: str) -> None:
    low = page.lower()
    assert "<script" not in low and "<link" not in low and "@import" not in low
    assert not re.search(r'(src|href)="(https?:)?//', low)
    assert "url(" not in low


def test_write_report_every_part(tmp_path):
    rep, inter = smollm_like("replacement", ci=True), smollm_like("interchange", scale=0.1)
    board = [{"method": "wanda", "sparsity": 0.5, "test_perplexity": 35.29123},
             {"method": "magnitude <b>", "sparsity": 0.5, "test_perplexity": None}]
    path = write_report(tmp_path / "r", title="study", summary={"model": "tiny", "blocks": 30},
                        leaderboard=board, plots={"swap": plot_swap_pair(rep, inter),
                                                  "raw": b"\x89PNG\r\n\x1a\nxx"},
                        probes={"replacement": rep, "interchange": inter},
                        probe_summary="# s\n\n| a | b |\n|---|---|\n| 1 | 2 |\n",
                        sections={"Depth curve": "text *here*"},
                        commands=["prunelab probe --model M --out 'a b'"],
                        recipe={"model": "M", "stages": [{"prune": {"method": "wanda"}}]})
    assert path == tmp_path / "r" / "report.html"
    page = path.read_text()
    _assert_self_contained(page)
    pngs = _images(page)
    assert all(p.startswith(b"\x89PNG") for p in pngs)
    # swap pair + raw plot, probes: heatmaps + diagonals + one figure per probe
    assert len(pngs) == 2 + 2 + 2
    for text in ("Model summary", "Leaderboard", "Plots", "Probes", "Depth curve",
                 "Reproduce", "35.29", "magnitude &lt;b&gt;", "trust interchange",
                 "Protocol agreement", "<em>here</em>", "<td>1</td>",
                 "prunelab probe --model M --out &#x27;a b&#x27;", "method: wanda"):
        assert text in page, text
    assert "<b>" not in page
    # nothing given: a valid page with no sections
    empty = write_report(tmp_path / "e").read_text()
    assert "<section" not in empty and empty.startswith("<!DOCTYPE html>")


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe-run")
    run_probes(wrap(tiny_model("llama")), ["interchange", "replacement", "block-influence"],
               tiny_tokens(4, 12), batch_size=2, out_dir=out, window=2)
    (out / "commands.txt").write_text("prunelab probe --model tiny --window 2\n")
    return out


def test_cli_report_of_a_probe_run(probe_dir, capsys):
    assert (probe_dir / "swap_diagonals.png").stat().st_size > 5000  # the probe output
    assert cli_main(["report", str(probe_dir)]) == 0
    path = probe_dir / "report.html"
    assert capsys.readouterr().out.strip() == f"report: {path}"
    page = path.read_text()
    _assert_self_contained(page)
    for text in ("replacement", "interchange", "block-influence", "Decision rule",
                 "Protocol agreement", "Blocks each protocol would remove",
                 "prunelab probe --model tiny --window 2", "full probe summary"):
        assert text in page, text
    assert len(_images(page)) == 2 + 3  # swap heatmaps + diagonals + one per probe


def test_cli_report_of_a_sweep_and_points(tmp_path, capsys):
    from prunelab.workflow.sweep import write_sweep_reports

    points = [{"probe": "block-influence", "strategy": "lowest", "recovery": "none",
               "removed_count": n, "removed_blocks": list(range(n)),
               "test_perplexity": 10.0 + n, "test_kl": 0.1 * n, "test_top1": 0.9,
               "calib_kl_before_recovery": None, "calib_kl_after_recovery": None,
               "params": 1000 - n, "error": None} for n in (1, 2)]
    dense = {"perplexity": 9.5, "samples": 4, "seqlen": 12}
    write_json(tmp_path / "points.json", points)
    write_json(tmp_path / "dense.json", dense)
    write_json(tmp_path / "sweep.json", {"format": "prunelab-sweep/1", "fingerprint": {
        "format": "prunelab-fingerprint/1", "model": {"spec": "tiny-llama"},
        "dtype": "float32", "data": {"spec": "wiki-vital:calib", "samples": 4, "seqlen": 12,
                                     "seed": 0}}})
    write_sweep_reports(points, dense, tmp_path)
    out = tmp_path / "elsewhere" / "r.html"
    assert cli_main(["report", str(tmp_path), "--out", str(out)]) == 0
    page = out.read_text()
    assert capsys.readouterr().out.strip() == f"report: {out}"
    for text in ("tiny-llama", "wiki-vital:calib (4 windows x 12 tokens, seed 0)", "9.5",
                 "Depth pruning curve", "<td class=\"num\">12</td>", "curve.png"):
        assert text in page, text
    assert len(_images(page)) == 1
    # the executor's layout (a comparison) without a leaderboard.csv
    pts = tmp_path / "cmp"
    write_json(pts / "points" / "wanda-0.5" / "result.json", {"ppl": 3.25, "kept": [1, 2]})
    assert cli_main(["report", str(pts)]) == 0
    assert "wanda-0.5" in (pts / "report.html").read_text()


def test_cli_report_errors(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert cli_main(["report", str(tmp_path)]) == 2
    cap = capsys.readouterr()
    lines = [ln for ln in (cap.out + cap.err).splitlines() if ln.strip()]
    assert lines == [f"error: {tmp_path / 'missing'} is not a folder",
                     f"error: {tmp_path} holds no probe result, sweep, leaderboard, manifest "
                     "or plot of prunelab's to report on"]


# ---------------------------------------------------------------- headless Chromium
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def render(page: Path, png: Path, profile: Path) -> list[str]:
    """Screenshot ``page`` with headless Chromium; returns its console messages."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--disable-extensions", f"--user-data-dir={profile}",
           "--enable-logging=stderr", "--v=0", f"--screenshot={png}",
           "--window-size=1280,2400", page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert png.is_file(), proc.stderr[-2000:]
    return [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: "
                    "apt-get install chromium; scripts/setup.sh does it)")
def test_report_renders_in_chromium(probe_dir, tmp_path):
    import matplotlib.image

    # the console check sees errors: a page that logs one is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><p>x</p><script>console.error('boom-7')"
                   "</script></body></html>")
    assert any("boom-7" in ln for ln in render(bad, tmp_path / "bad.png", tmp_path / "p1"))
    # the report: no console message at all, and a screenshot that is not blank
    page = write_report(tmp_path, probes={n: ProbeResult.load(probe_dir / f"{n}.json")
                                          for n in ("replacement", "interchange")},
                        summary={"model": "tiny llama"}, commands="prunelab probe ...")
    shot = tmp_path / "shot.png"
    assert render(page, shot, tmp_path / "p2") == []
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (2400, 1280)
    assert pixels.std() > 0.05  # a white page has 0
    assert (pixels.reshape(-1, 3).std(axis=1) > 0.1).mean() > 0.01  # coloured pixels (plots)


def _page_width(page: Path, profile: Path, width: int = 1280) -> int:
    """The page's scroll width in headless Chromium with a ``width``-pixel window (a copy
    of the page with a one-line script that writes it into the title)."""
    probe = page.with_name("width-" + page.name)
    probe.write_text(page.read_text().replace(
        "</body>", "<script>document.title='W'+document.documentElement.scrollWidth"
        "</script></body>"))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-extensions", f"--user-data-dir={profile}",
           f"--window-size={width},900", "--dump-dom", probe.resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"<title>W(\d+)</title>", dom)
    assert found, dom[:500]
    return int(found.group(1))


def _wide_rows() -> list[dict]:
    import random

    rnd = random.Random(0)
    cols = ["method", "params", "params_kept", "bytes", "perplexity", "kl_to_dense",
            "top1_agreement", "arc_easy", "hellaswag", "piqa", "winogrande", "boolq",
            "zero-shot avg", "prefill_tok_s", "decode_tok_s", "peak_memory_bytes"]
    return [{c: (f"method-{i}" if c == "method" else rnd.random() * 10 ** rnd.randint(0, 9))
             for c in cols} for i in range(6)]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: "
                    "apt-get install chromium; scripts/setup.sh does it)")
def test_wide_leaderboard_fits_a_1280_pixel_page(tmp_path):
    import csv as csv_mod

    rows = _wide_rows()
    board = tmp_path / "leaderboard.csv"
    with open(board, "w", newline="") as fh:
        w = csv_mod.DictWriter(fh, fieldnames=[*rows[0], "achieved"])
        w.writeheader()
        w.writerows(rows)  # "achieved": empty in every row
    page = write_report(tmp_path, leaderboard=board, summary={"model": "tiny"})
    text = page.read_text()
    assert "achieved" not in text  # the empty column is dropped
    cells = re.findall(r'<td class="num">([^<]*)</td>', text)
    assert len(cells) == 6 * 15 and "0.8417633356554161" not in text
    for c in cells:  # 4 significant digits, or a count grouped in thousands
        assert re.fullmatch(r"\d{1,3}(,\d{3})+", c) or \
            len(re.sub(r"\D", "", c).lstrip("0")) <= 4, c
    assert _page_width(page, tmp_path / "p") <= 1280
    # the same page without the table's own scrolling would be wider: the check can fail
    unfit = tmp_path / "unfit.html"
    unfit.write_text(text.replace("display:block;\n max-width:100%;overflow-x:auto", ""))
    assert _page_width(unfit, tmp_path / "p2") > 1280
