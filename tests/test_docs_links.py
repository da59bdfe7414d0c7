"""The documents' relative links lead somewhere: the README points into docs/performance.md for every
figure it summarises, and that page links each run's JSON under docs/results/; a moved or renamed file
must not leave a figure without its source."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """Markdown link targets that name a file of this repository (no URL, no in-page anchor)."""
    targets = [m.group(1).split("#")[0] for m in LINK.finditer(text)]
    return [t for t in targets if t and not re.match(r"[a-z]+:", t)]


def test_relative_links_are_found_in_markdown():
    text = "see [a](docs/a.md), [b](https://x.org/b), [c](#top), [d](results/d.json#rows)"
    assert relative_links(text) == ["docs/a.md", "results/d.json"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path):
    missing = [t for t in relative_links(document.read_text()) if not (document.parent / t).exists()]
    assert not missing, f"{document.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_readme_points_to_the_measurement_record():
    assert "docs/performance.md" in relative_links((ROOT / "README.md").read_text())
