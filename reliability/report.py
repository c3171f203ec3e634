"""Writing ``RELIABILITY.md``: the verdicts first, then the figures and the catalogue."""

from __future__ import annotations

import collections
from pathlib import Path


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(path: Path, results: dict) -> None:
    catalogue = results["catalogue"]
    findings = results["findings"]
    lines = [
        "# Reliability",
        "",
        "Written by `make reliability` (`python -m reliability.run"
        f"{' --quick' if results['quick'] else ''} --model-dir {results['model_dir']}`) "
        f"on {results['started']:%Y-%m-%d %H:%M} UTC. Hostile clients against a real "
        "`djl-stream serve`: what each must get, and whether it did. Targets are judged "
        "here, never asserted as times in the tests; `make test` runs a short version "
        "(`tests/test_reliability.py`) that checks the verdicts which do not depend on the "
        "machine's speed.",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in results["machine"].items()),
        f"One decode step (median gap of one greedy stream alone): "
        f"{results['decode_step_s'] * 1000:.1f} ms.",
        "",
        "## Verdicts",
        "",
        "| what | target | verdict | figures |",
        "|---|---|---|---|",
    ]
    passed = sum(1 for _, v in catalogue if v.ok)
    lines.append(f"| hostile-input catalogue ({len(catalogue)} cases) | every case gets its "
                 f"documented status and JSON shape | {'✓' if passed == len(catalogue) else '✗'}"
                 f" | {passed} of {len(catalogue)} |")
    for finding in findings:
        figures = "; ".join(f"{k}: {v}" for k, v in finding.figures.items())
        verdict = "✓" if finding.passed else f"✗ {finding.detail}"
        lines.append(f"| {_cell(finding.name)} | {_cell(finding.target)} | {_cell(verdict)} "
                     f"| {_cell(figures)} |")
    by_category = collections.defaultdict(lambda: [0, 0])
    for case, verdict in catalogue:
        by_category[case.category][0] += 1
        by_category[case.category][1] += verdict.ok
    lines += ["", "## The catalogue", "",
              "| category | cases | as documented |", "|---|---|---|"]
    lines += [f"| {c} | {n} | {ok} |" for c, (n, ok) in sorted(by_category.items())]
    failed = [(c, v) for c, v in catalogue if not v.ok]
    if failed:
        lines += ["", "Cases answered otherwise:", ""]
        lines += [f"- {_cell(c.name)} ({c.category}): {_cell(v.detail)}" for c, v in failed]
    uvicorn = [c for c, _ in catalogue if c.uvicorn]
    lines += ["", "Answered by uvicorn before djl-stream's code runs (a plain-text answer, "
              "the documented exception to \"a JSON body\"):", ""]
    lines += [f"- {_cell(c.name)}: {c.status}, {_cell(c.note)}" for c in uvicorn]
    lines += ["", "<details><summary>Every case</summary>", "",
              "| case | category | route | must get | got |", "|---|---|---|---|---|"]
    for case, verdict in catalogue:
        must = f"{case.status}" + (f" naming `{case.field}`" if case.field else "")
        lines.append(f"| {_cell(case.name)} | {case.category} | {case.method} {case.path} "
                     f"| {_cell(must)} | {'✓' if verdict.ok else '✗'} {_cell(verdict.detail)} |")
    lines += ["", "</details>", ""]
    path.write_text("\n".join(lines), encoding="utf-8")
