"""``make bench``'s targets (``benchmarks/targets.py``) computed from a run's results: each
FAIL line says by how much the figure falls short, in the target's own unit, and a PASS
line says nothing of the kind. (Timings here are made up; no server runs.)"""

from __future__ import annotations

from benchmarks.http_load import LoadResult
from benchmarks.measure import MemoryChange, ProcessMemory, StreamTiming
from benchmarks.results import CONTINUOUS, Results
from benchmarks.settings import Settings
from benchmarks.targets import evaluate


def _load(clients: int, gap: float) -> LoadResult:
    """``clients`` streams of 10 tokens, one every ``gap`` seconds from a start at 0: an ITL
    and a TTFT of ``gap``, ``clients / gap`` tokens/s together."""
    arrivals = tuple(i * gap for i in range(1, 11))
    return LoadResult(clients, (StreamTiming(0.0, arrivals, arrivals[-1], 10),) * clients)


def _results(many_gap: float, late_steps: float, growth_mb: float) -> Results:
    """One client's steps of 20 ms; 16 clients' of ``many_gap``; a late request whose first
    token comes ``late_steps`` solo steps after a solo one's; the server's RSS grown by
    ``growth_mb``."""
    settings = Settings(model_dir="model", new_tokens=128, concurrency=(1, 16),
                        concurrency_new_tokens=10, repetitions=1, jina_repetitions=1,
                        concurrency_repetitions=1)
    results = Results(settings, machine={})
    solo = 0.020
    results.concurrency[(CONTINUOUS, 1)] = [_load(1, solo)]
    results.concurrency[(CONTINUOUS, 16)] = [_load(16, many_gap)]
    first = solo + late_steps * solo
    results.late[CONTINUOUS] = [StreamTiming(0.0, (first,), first, 1)]
    results.memory.append(MemoryChange(f"server ({CONTINUOUS})",
                                       ProcessMemory(1_000_000_000, 1_000_000_000),
                                       ProcessMemory(int(1e9 + growth_mb * 1e6), 2_000_000_000)))
    return results


def test_a_missed_target_says_by_how_much_in_its_own_unit():
    # 16 clients at 16 x 20 ms / 4.98 a step: 4.98x one client's tokens/s, an ITL 3.21x
    checks = {c.target: c for c in evaluate(_results(0.020 * 16 / 4.98, 3.4, 227))}
    aggregate = checks["16 clients aggregate >= 5x one client's tok/s"]
    assert (aggregate.passed, aggregate.measured) == (False, "4.98x (missed by 0.4%)")
    itl = checks["ITL p50 at 16 clients <= 3x one client's"]
    assert (itl.passed, itl.measured) == (False, "3.21x (missed by 7%) (64 ms vs 20 ms)")
    late = checks["late arrival TTFT <= solo TTFT + 3 decode steps (median)"]
    assert (late.passed, late.measured) == (
        False, "88 ms vs solo 20 ms: +3.4 decode steps of 20 ms (missed by 0.4 steps)")
    memory = checks["server RSS after the load within 100 MB of before"]
    assert (memory.passed, memory.measured) == (False, "+227 MB (missed by 127 MB)")
    assert memory.line() == ("FAIL  server RSS after the load within 100 MB of before: "
                             "+227 MB (missed by 127 MB)")


def test_a_met_target_says_no_shortfall():
    checks = evaluate(_results(0.020 * 16 / 6.0, 2.5, -40))
    measured = {c.target: c for c in checks if c.passed is not None}
    assert len(measured) == 4, [c.line() for c in checks]
    assert all(c.passed for c in measured.values()), [c.line() for c in checks]
    assert not any("missed" in c.measured for c in checks), [c.line() for c in checks]
    # (the single-stream rows were not measured here, and say so)
    assert {c.measured for c in checks if c.passed is None} == {"not measured"}
