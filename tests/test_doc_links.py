"""Links between README.md, the docs/ pages and hostfiles/README.md resolve: every
relative link names a file of the repository, every #anchor a heading of the page it
points to (GitHub's anchors); and the README indexes every docs page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT
from doc_blocks import PAGES

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings (outside code blocks)."""
    out, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out.add(slug)
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link of `page`, outside code blocks."""
    out, fenced = [], False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1) or m.group(2)
            if not re.match(r"^[a-z]+:", target):
                out.append((n, target))
    return out


@pytest.mark.parametrize(
    "page", [*PAGES, ROOT / "hostfiles" / "README.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_links_resolve(page):
    bad = []
    for n, target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"line {n}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"line {n}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_readme_indexes_every_docs_page():
    listed = {(ROOT / t.partition("#")[0]).resolve() for _, t in links(ROOT / "README.md")}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in listed]
    assert not missing, f"README.md links no page {missing}: add it to The manual"
