"""Docs and code say what is, not how it came to be: no issue numbers, stops or dates.

Git history keeps those. The figures files written by the make targets (``BENCHMARKS.md``,
``RELIABILITY.md``) carry the date and machine of their run, and the tests' fixtures may
hold dates that are data (a boto3 response's ``CreationTime``): neither is history.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Naming an issue ("issue 9", "issue #9"), a stop ("stop 44", "the 36th stop") or a day.
HISTORY = re.compile(r"\bissues? #?\d+|\bstop \d+\b|\b\d+(?:st|nd|rd|th) stop\b"
                     r"|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
#: Where a date would be history; the tests and conformance suites are held to the rest.
NO_DATES = ["README.md", "docs", "docker", "model", "djl_stream", "benchmarks", "Makefile"]
NO_ISSUES = NO_DATES + ["tests", "conformance", "BENCHMARKS.md", "RELIABILITY.md"]
TEXT = {".py", ".md", ".properties", ".txt", ".toml", ".sh", ".jinja", ""}


def files(roots):
    for root in roots:
        path = REPO / root
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for candidate in candidates:
            if (candidate.is_file()
                    and (candidate.suffix in TEXT or candidate.name.startswith("Dockerfile"))
                    and "__pycache__" not in candidate.parts and candidate != Path(__file__)
                    and candidate.stat().st_size < 1_000_000):
                yield candidate


def mentions(roots, only_issues: bool):
    found = []
    for path in files(roots):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in HISTORY.finditer(line):
                if only_issues and re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", match.group()):
                    continue
                found.append(f"{path.relative_to(REPO)}:{number}: {match.group()}")
    return found


def test_no_issue_stop_or_date_in_docs_or_code():
    assert mentions(NO_DATES, only_issues=False) == []


def test_no_issue_or_stop_in_tests_or_figures():
    assert mentions(NO_ISSUES, only_issues=True) == []


@pytest.mark.parametrize("text", ["as issue 9 asked", "see issue #12", "since stop 44",
                                  "the 36th stop", "until 2026-11-26"])
def test_the_pattern_finds_what_it_looks_for(text):
    assert HISTORY.search(text)
