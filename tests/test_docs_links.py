"""The README, the reference pages and the results pages link only to files (and headings)
that exist, and the reference pages in docs/ hold no dated measurement text: dated
write-ups belong in benchmarks/results/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
         *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
PAGES = [p for p in PAGES if p.is_file()]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: ...


CASES = [(p, t) for p in PAGES for t in _links(p)]


def test_the_pages_have_links():
    assert len(PAGES) >= 10 and len(CASES) >= 40


@pytest.mark.parametrize("page,target", CASES,
                         ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in CASES])
def test_relative_links_point_to_existing_files_and_headings(page, target):
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / file_part).resolve() if file_part else page
    assert dest.exists(), f"{page.relative_to(ROOT)}: broken link {target!r}"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest), \
            f"{page.relative_to(ROOT)}: no heading #{anchor} in {dest.relative_to(ROOT)}"


def test_slug_and_checker_catch_breakage(tmp_path):
    assert _slug("Fitting the blended decay press (`fit=kl`)") == \
        "fitting-the-blended-decay-press-fitkl"
    page = tmp_path / "a.md"
    page.write_text("# Title\n\n[ok](a.md#title) [bad](missing.md) `[code](nope.md)`\n")
    assert _links(page) == ["a.md#title", "missing.md"]
    assert "title" in _anchors(page) and not (tmp_path / "missing.md").exists()


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_reference_pages_hold_no_dated_measurements(page):
    dated = [f"{i}: {line.strip()[:80]}" for i, line in enumerate(page.read_text().splitlines(), 1)
             if DATE.search(line)]
    assert not dated, (f"docs/{page.name} has dated text (move it to benchmarks/results/ "
                       f"and link to it): {dated}")
