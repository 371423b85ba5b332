"""Markdown for ``benchmarks/results/peers.md``: tables, ratios, gaps, one section per peer.

The page holds one section per peer between ``<!-- peer:NAME -->`` and
``<!-- /peer:NAME -->``; :func:`update_page` replaces that peer's section only (or
appends it, keeping the order of :data:`ORDER`), so peers can be run one at a time.
Pure string functions, no torch, no prunelab.
"""

from __future__ import annotations

import re

ORDER = ("kvpress", "snapkv-settings", "llm-compressor", "torch-pruning", "modelopt", "mergekit")
PAGE_HEAD = """# prunelab beside its peers

prunelab and the tools users would pick instead, on the same model, the same calibration and
test token ids (their sha256 checked on both sides), the same budget, in one run of
`python benchmarks/peers/run.py` (`--all`, or `--peer NAME` to redo one section; each peer
in its own virtual environment under `.bench/peers/`, never a prunelab dependency).
Every job is a fresh process pinned to one core (`taskset -c 1`, one thread); wall time and
peak RSS (prunelab's `PeakRSS`, 2 ms sampling, over the RSS just before the timed call) are
measured the same way on both sides. Ratios are prunelab / peer: below 1 is better for
prunelab in time, memory, perplexity and KL. **gap** marks a row where prunelab's quality
is worse than the peer's (perplexity more than 0.1 % higher or KL more than 2 % higher).
"""


def fmt(v, spec: str) -> str:
    """``v`` formatted, ``-`` for None or NaN."""
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return format(v, spec)


def ratio(a, b, spec: str = ".2f") -> str:
    """``a / b`` formatted; ``-`` when either is missing or ``b`` is 0."""
    if a is None or b is None or b == 0 or a != a or b != b:
        return "-"
    return format(a / b, spec)


def gap(ours, theirs, tolerance: float) -> str:
    """``"gap +x.x %"`` when ``ours`` exceeds ``theirs`` by more than ``tolerance``
    (relative; lower is better), else ``""``."""
    if ours is None or theirs is None or theirs <= 0:
        return ""
    rel = ours / theirs - 1.0
    return f"**gap +{rel:.1%}**" if rel > tolerance else ""


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; cells are ``str()``-ed; every row must have
    ``len(headers)`` cells."""
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row has {len(r)} cells, the table {len(headers)}: {r}")
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _marks(name: str) -> tuple[str, str]:
    return f"<!-- peer:{name} -->", f"<!-- /peer:{name} -->"


def update_page(page: str, name: str, body: str) -> str:
    """``page`` with peer ``name``'s section set to ``body`` (other sections untouched).

    An empty ``page`` starts from :data:`PAGE_HEAD`. A new section goes before the first
    existing section that comes after it in :data:`ORDER` (at the end otherwise)."""
    if name not in ORDER:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(ORDER)}")
    start, end = _marks(name)
    block = f"{start}\n{body.strip()}\n{end}"
    if not page.strip():
        page = PAGE_HEAD
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pat.search(page):
        return pat.sub(lambda _m: block, page, count=1)
    later = [n for n in ORDER[ORDER.index(name) + 1:] if _marks(n)[0] in page]
    if later:
        at = page.index(_marks(later[0])[0])
        return page[:at] + block + "\n\n" + page[at:]
    return page.rstrip("\n") + "\n\n" + block + "\n"


def sections(page: str) -> list[str]:
    """Names of the peer sections present, in page order."""
    return re.findall(r"<!-- peer:([\w.-]+) -->", page)
