"""Everything one run measured, and the medians the report and the targets read.

Raw timings are kept per repetition; every figure reported is the median over
repetitions of a per-repetition value (tokens per second of one run, p50 of one load
test's inter-token gaps, ...), so one disturbed repetition cannot move it much.

Example::

    results = Results(settings, machine)
    results.single["generate"].append(timing)
    results.single_median("generate", "tokens_per_s")
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from .http_load import LoadResult
from .inprocess import Row
from .measure import MemoryChange, ProcessMemory, StreamTiming, median, percentile
from .settings import Settings

#: The two ways the server is run under load.
CONTINUOUS = "continuous batching"
ONE_AT_A_TIME = "one at a time"
MODES = (CONTINUOUS, ONE_AT_A_TIME)


@dataclasses.dataclass
class Results:
    settings: Settings
    machine: Dict[str, str]
    #: the single-stream rows measured, in the order they ran
    rows: List[Row] = dataclasses.field(default_factory=list)
    #: row key -> one timing per repetition
    single: Dict[str, List[StreamTiming]] = dataclasses.field(default_factory=dict)
    #: (mode, clients) -> one load result per repetition
    concurrency: Dict[Tuple[str, int], List[LoadResult]] = dataclasses.field(default_factory=dict)
    #: mode -> the late request's timing, one per repetition
    late: Dict[str, List[StreamTiming]] = dataclasses.field(default_factory=dict)
    memory: List[MemoryChange] = dataclasses.field(default_factory=list)
    #: process -> its memory after each load-test repetition (growth that goes on from
    #: one repetition to the next is a leak; growth that stops is the allocator keeping
    #: the largest batch's working set)
    memory_trace: Dict[str, List[Optional[ProcessMemory]]] = dataclasses.field(default_factory=dict)
    notes: List[str] = dataclasses.field(default_factory=list)
    elapsed_s: float = math.nan

    # -- single stream ------------------------------------------------------------------

    def single_median(self, key: str, figure: str) -> float:
        """Median over repetitions of ``figure`` for row ``key``: ``tokens_per_s``,
        ``ttft``, ``itl_p50``, ``itl_p99`` or ``wall``; NaN when not measured."""
        return median(_figure(t, figure) for t in self.single.get(key, ()))

    def single_ratio(self, key: str, baseline: str, figure: str = "tokens_per_s") -> float:
        return ratio(self.single_median(key, figure), self.single_median(baseline, figure))

    def single_tokens(self, key: str) -> Optional[int]:
        counts = {t.tokens for t in self.single.get(key, ())}
        return min(counts) if counts else None

    def single_text(self, key: str) -> Optional[str]:
        timings = self.single.get(key)
        return timings[0].text if timings else None

    # -- concurrency --------------------------------------------------------------------

    def load_median(self, mode: str, clients: int, figure: str) -> float:
        """Median over repetitions of ``aggregate``, ``ttft_p50``, ``ttft_p99``,
        ``itl_p50`` or ``itl_p99`` at ``clients`` concurrent clients."""
        return median(_load_figure(r, figure) for r in self.concurrency.get((mode, clients), ()))

    def load_errors(self) -> List[str]:
        return [e for runs in self.concurrency.values() for r in runs for e in r.errors]

    # -- late arrival -------------------------------------------------------------------

    def late_ttft(self, mode: str) -> float:
        return median(t.ttft for t in self.late.get(mode, ()) if t.ttft is not None)

    def solo_ttft(self, mode: str) -> float:
        """The one-client TTFT of the same server and request size: the late request's
        reference."""
        return self.load_median(mode, 1, "ttft_p50")

    def solo_itl(self, mode: str) -> float:
        return self.load_median(mode, 1, "itl_p50")


def _figure(timing: StreamTiming, figure: str) -> float:
    if figure == "itl_p50":
        return percentile(timing.inter_token, 50)
    if figure == "itl_p99":
        return percentile(timing.inter_token, 99)
    value = getattr(timing, figure)
    return math.nan if value is None else value


def _load_figure(result: LoadResult, figure: str) -> float:
    if figure == "aggregate":
        return result.aggregate_tokens_per_s
    kind, q = figure.rsplit("_p", 1)
    return result.ttft(float(q)) if kind == "ttft" else result.inter_token(float(q))


def ratio(value: float, baseline: float) -> float:
    """``value / baseline``; NaN when either is missing or the baseline is zero."""
    if math.isnan(value) or math.isnan(baseline) or baseline == 0:
        return math.nan
    return value / baseline
