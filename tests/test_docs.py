"""The documentation against the code: the generated properties page, the README's table
of common properties, links between pages, and the README's length."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from djl_stream.serving.properties_reference import property_rows, render_reference

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: A user guide read in ten minutes.
README_MOST_LINES = 350


def test_the_properties_page_is_what_the_code_says():
    page = (REPO / "docs" / "properties.md").read_text(encoding="utf-8")
    assert page == render_reference(), (
        "docs/properties.md differs from ModelProperties: run "
        "`python -m djl_stream.serving.properties_reference docs/properties.md`")


def test_every_property_a_user_sets_has_a_meaning():
    for key, default, meaning in property_rows():
        assert meaning and default, key


def test_the_readme_s_properties_are_the_reference_s_lines():
    generated = {key: (default, meaning) for key, default, meaning in property_rows()}
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Properties", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (.*?) \| (.*) \|$", section, flags=re.M)
    assert len(rows) >= 8
    for key, default, meaning in rows:
        assert key in generated, f"{key} is not a property"
        expected_default, expected_meaning = generated[key]
        # (the README links to the same topic pages from the repository's root)
        assert (default, meaning) == (
            expected_default, re.sub(r"\]\((?!http)", "](docs/", expected_meaning)), key


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for ``page``'s headings: lower case, punctuation dropped, spaces
    as hyphens. Headings inside code blocks are not headings."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_between_pages_reaches_a_file_and_a_heading(page):
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name} links to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in heading_anchors(linked), (
                f"{page.name} links to {target}: {linked.name} has no such heading")


def test_the_readme_is_read_in_ten_minutes():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MOST_LINES
    assert max(len(line) for line in lines if not line.startswith("|")) <= 120


def test_the_topic_pages_are_there():
    for topic in ("deployment", "protocols", "properties", "performance", "reliability",
                  "development"):
        assert (REPO / "docs" / f"{topic}.md").is_file(), topic
