"""The pages a user opens first stay readable: docs/benchmarks.md and docs/architecture.md within 500
lines, no doc naming a tracker issue or telling who else used the machine, and every section of
those two pages that code, tests or docs point at by name or anchor still there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES = ("benchmarks.md", "architecture.md")
MAX_LINES = 500
# A tracker number: "issue" or "issues" then a number, or "#" then a number (not an anchor, an HTML
# entity or a colour); and the stories a load figure replaces.
TRACKER = re.compile(r"\bissues? #?\d+|(?<![\w/&#(])#\d+\b|\bother (jobs|engineers|sessions)\b", re.IGNORECASE)
# docs/benchmarks.md, "Title"  /  docs/architecture.md, *Title*  (a title on one line)
NAMED = re.compile(r"docs/(benchmarks|architecture)\.md[,:]? (?:\"([^\"\n]+)\"|\*([^*\n]+)\*)")
LINK = re.compile(r"\]\((benchmarks\.md|architecture\.md|)#([^)\s]+)\)")


def _titles(page: Path) -> list[str]:
    """Headings (outside code fences) and bold paragraph labels, lower-cased."""
    titles, fenced = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            titles.append(m.group(1).strip().lower())
        titles += [label.strip(" .").lower() for label in re.findall(r"\*\*([^*\n]+)\*\*", line)]
    return titles


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


@pytest.mark.parametrize("name", PAGES)
def test_page_fits_in_500_lines(name):
    lines = len((ROOT / "docs" / name).read_text().splitlines())
    assert lines <= MAX_LINES, f"docs/{name} has {lines} lines"


def test_docs_name_features_not_tracker_issues_or_other_users():
    found = [f"{doc.relative_to(ROOT)}:{n}: {line.strip()}" for doc in DOCS
             for n, line in enumerate(doc.read_text().splitlines(), 1) if TRACKER.search(line)]
    assert not found, "\n".join(found)


def test_sections_named_elsewhere_exist():
    sources = [*DOCS, ROOT / "tests" / "README.md",
               *(f for folder in ("blockdiff", "tests", "benchmarks", "scripts") for f in (ROOT / folder).rglob("*.py"))]
    titles = {page: _titles(ROOT / "docs" / page) for page in PAGES}
    missing = []
    for source in sources:
        if source == Path(__file__):  # its own comments show the patterns
            continue
        text = source.read_text(errors="replace")
        for m in NAMED.finditer(text):
            page, title = m.group(1) + ".md", (m.group(2) or m.group(3)).lower()
            if not any(title in t for t in titles[page]):
                missing.append(f"{source.relative_to(ROOT)}: {m.group(0)}")
        if source.suffix != ".md":
            continue
        for m in LINK.finditer(text):
            page = m.group(1) or source.name
            if page in PAGES and m.group(2) not in {_anchor(t) for t in titles[page]}:
                missing.append(f"{source.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "\n".join(missing)
