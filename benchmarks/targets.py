"""The performance targets djl-stream aims at, checked against a run's results.

A target is computed and reported, never asserted: a missed target is a line that says
FAIL with the measured figure and by how much it falls short (:func:`missed_by`), and the
benchmark still finishes and writes its report.
A target whose figures were not measured (``--skip-http``) is reported as not measured.

Example::

    for check in evaluate(results):
        print(check.line())      # "PASS  in-process stream >= 1.0x generate() tok/s: 1.04x"
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

from .results import CONTINUOUS, Results, ratio


@dataclasses.dataclass(frozen=True)
class Check:
    """One target: what it asks, the measured figure, and whether it holds."""

    target: str
    measured: str
    passed: Optional[bool]

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "NOT MEASURED"}[self.passed]

    def line(self) -> str:
        return f"{self.verdict:<4}  {self.target}: {self.measured}"


def missed_by(value: float, limit: float, at_most: bool) -> str:
    """How far ``value`` falls short of ``limit`` (a ceiling where ``at_most``), as a
    share of the limit: empty where it does not. One decimal below 1 %, so that a
    shortfall never reads as 0 %.

    >>> missed_by(4.98, 5.0, at_most=False), missed_by(1.25, 1.15, at_most=True)
    (' (missed by 0.4%)', ' (missed by 9%)')
    >>> missed_by(5.1, 5.0, at_most=False), missed_by(4.999, 5.0, at_most=False)
    ('', ' (missed by less than 0.1%)')
    """
    short = value / limit - 1 if at_most else 1 - value / limit
    if short <= 0:
        return ""
    if short < 0.001:
        return " (missed by less than 0.1%)"
    return f" (missed by {short:.1%})" if short < 0.01 else f" (missed by {short:.0%})"


def _at_least(target: str, value: float, minimum: float, detail: str = "") -> Check:
    if math.isnan(value):
        return Check(target, "not measured", None)
    return Check(target, f"{value:.2f}x{missed_by(value, minimum, at_most=False)}{detail}",
                 value >= minimum)


def evaluate(results: Results) -> List[Check]:
    """Every target, in the order the report lists them."""
    s = results.settings
    most = max(s.concurrency)
    checks = [
        _at_least("in-process stream >= 1.0x generate() tok/s",
                  results.single_ratio("djl_stream", "generate"), 1.0),
        _at_least("in-process stream >= 0.95x bare loop tok/s",
                  results.single_ratio("djl_stream", "bare_loop"), 0.95),
        _at_least("HTTP one client >= 0.9x generate() tok/s",
                  results.single_ratio("http", "generate"), 0.9),
        _at_least("stream >= 4x the Jina way at 128 new tokens",
                  results.single_ratio("djl_stream", "jina"), 4.0,
                  "" if s.new_tokens == 128 else f" (measured at {s.new_tokens} new tokens)"),
    ]
    one = results.load_median(CONTINUOUS, 1, "aggregate")
    many = results.load_median(CONTINUOUS, most, "aggregate")
    checks.append(_at_least(f"{most} clients aggregate >= 5x one client's tok/s",
                            ratio(many, one), 5.0))
    itl_one = results.load_median(CONTINUOUS, 1, "itl_p50")
    itl_many = results.load_median(CONTINUOUS, most, "itl_p50")
    itl_ratio = ratio(itl_many, itl_one)
    checks.append(Check(f"ITL p50 at {most} clients <= 3x one client's",
                        "not measured" if math.isnan(itl_ratio) else
                        f"{itl_ratio:.2f}x{missed_by(itl_ratio, 3.0, at_most=True)} "
                        f"({itl_many * 1e3:.0f} ms vs {itl_one * 1e3:.0f} ms)",
                        None if math.isnan(itl_ratio) else itl_ratio <= 3.0))
    checks.append(_late_arrival_check(results))
    checks.append(_memory_check(results))
    return checks


def _late_arrival_check(results: Results) -> Check:
    target = "late arrival TTFT <= solo TTFT + 3 decode steps (median)"
    late, solo, step = (results.late_ttft(CONTINUOUS), results.solo_ttft(CONTINUOUS),
                        results.solo_itl(CONTINUOUS))
    if any(math.isnan(x) for x in (late, solo, step)) or step <= 0:
        return Check(target, "not measured", None)
    extra = (late - solo) / step
    # (in steps, the target's own unit: a share of "3 steps" would say little)
    miss = f" (missed by {extra - 3.0:.1f} steps)" if extra > 3.0 else ""
    return Check(target, f"{late * 1e3:.0f} ms vs solo {solo * 1e3:.0f} ms: "
                         f"{extra:+.1f} decode steps of {step * 1e3:.0f} ms{miss}", extra <= 3.0)


def _memory_check(results: Results) -> Check:
    target = "server RSS after the load within 100 MB of before"
    change = next((m for m in results.memory if m.process == f"server ({CONTINUOUS})"), None)
    if change is None or change.growth is None:
        return Check(target, "not measured", None)
    growth_mb = change.growth / 1e6
    miss = f" (missed by {abs(growth_mb) - 100:.0f} MB)" if abs(growth_mb) > 100 else ""
    return Check(target, f"{growth_mb:+.0f} MB{miss}", abs(growth_mb) <= 100)

