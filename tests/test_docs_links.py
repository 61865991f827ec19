"""Links between the README and docs/ resolve: every relative file link to a file that
exists, every #anchor to a heading of its page (as GitHub names headings)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    # GitHub's: markup and links reduced to their text, lower case, punctuation dropped
    # (hyphens and underscores stay), spaces become hyphens.
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = _slug(heading.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code shows, not links
    return [link for link in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]  # http:, mailto:, ...


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, broken


def test_the_checker_sees_links_and_anchors() -> None:
    # Guards the test above against passing by finding nothing.
    readme = ROOT / "README.md"
    assert "docs/operations.md#agents-behind-a-proxy" in _links(readme)
    assert "agents-behind-a-proxy" in _anchors(ROOT / "docs" / "operations.md")
    assert _slug("4. Clusters without a LoadBalancer") == "4-clusters-without-a-loadbalancer"
