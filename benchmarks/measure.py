"""What one stream's timing is, the statistics over many, and a process's memory.

Every row of the benchmark reduces to :class:`StreamTiming`: when the caller asked, when
each piece reached it, and when the last one did. Time to first token, inter-token latency
and tokens per second are all derived from those instants in one place, so every row is
measured the same way.

Example::

    >>> t = StreamTiming(start=0.0, arrivals=(0.2, 0.3, 0.45), end=0.45, tokens=3)
    >>> round(t.ttft, 2), [round(x, 2) for x in t.inter_token], round(t.tokens_per_s, 2)
    (0.2, [0.1, 0.15], 6.67)
    >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 99)
    (2.5, 3.97)
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import signal
from pathlib import Path
from typing import Iterable, List, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class StreamTiming:
    """One generation as its caller saw it (``time.perf_counter()`` seconds).

    ``arrivals`` holds one instant per piece handed to the caller: one per token for
    token streams, one per text chunk for streamers that group tokens into words, none
    for a call that returns everything at the end. ``tokens`` counts generated tokens.
    """

    start: float
    arrivals: tuple[float, ...]
    end: float
    tokens: int
    text: str = ""
    token_ids: Optional[tuple[int, ...]] = None
    error: Optional[str] = None

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token; None when nothing arrived before the end."""
        return self.arrivals[0] - self.start if self.arrivals else None

    @property
    def inter_token(self) -> List[float]:
        """Gaps between consecutive arrivals."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the whole call, prefill included."""
        return self.tokens / self.wall if self.wall > 0 else math.nan


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation (numpy's default); NaN if empty."""
    data = sorted(values)
    if not data:
        return math.nan
    position = (len(data) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def median(values: Iterable[float]) -> float:
    """Median ignoring NaN; NaN when nothing is left."""
    data = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(data) if data else math.nan


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """Resident set size now and at its peak, in bytes (Linux ``/proc``)."""

    rss: int
    peak: int

    @classmethod
    def of(cls, pid: Optional[int] = None) -> Optional["ProcessMemory"]:
        """``VmRSS`` and ``VmHWM`` of ``pid`` (default: this process); None where
        ``/proc`` does not exist or the process is gone."""
        path = Path("/proc") / (str(pid) if pid is not None else "self") / "status"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return None
        fields = {}
        for line in lines:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024
        if "VmRSS" not in fields:
            return None
        return cls(rss=fields["VmRSS"], peak=fields.get("VmHWM", fields["VmRSS"]))


    @classmethod
    def of_tree(cls, pid: int) -> Optional["ProcessMemory"]:
        """``pid`` and every process below it, summed: a server that runs its model in
        worker processes (Ray Serve) holds its memory there. The peak is the sum of each
        process's own peak, so it may overstate a peak they did not reach together."""
        found = [m for m in (cls.of(p) for p in process_tree(pid)) if m is not None]
        if not found:
            return None
        return cls(rss=sum(m.rss for m in found), peak=sum(m.peak for m in found))


def process_tree(pid: int) -> List[int]:
    """``pid`` and its descendants (Linux ``/proc``), ``pid`` first."""
    children: dict[int, List[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for p in frontier for child in children.get(p, [])]
        tree.extend(frontier)
    return tree


@dataclasses.dataclass(frozen=True)
class MemoryChange:
    """A process's memory before and after the part of the run that used it."""

    process: str
    before: Optional[ProcessMemory]
    after: Optional[ProcessMemory]

    @property
    def growth(self) -> Optional[int]:
        if self.before is None or self.after is None:
            return None
        return self.after.rss - self.before.rss


def cpu_load() -> Optional[tuple[float, float, float]]:
    """The 1, 5 and 15 minute load averages, where the OS has them."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def system_busy_cpu_seconds() -> Optional[float]:
    """CPU seconds every core of the machine spent busy since boot (``/proc/stat``)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: Optional[int] = None) -> Optional[float]:
    """User + system CPU seconds of one process (``/proc/PID/stat``)."""
    path = Path("/proc") / (str(pid) if pid is not None else "self") / "stat"
    try:
        fields = path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def all_inter_token(timings: Sequence[StreamTiming]) -> List[float]:
    """Every inter-token gap of every stream in ``timings``, pooled."""
    return [gap for timing in timings for gap in timing.inter_token]


class Paused:
    """The process trees of ``servers`` stopped (SIGSTOP) while the block runs and
    resumed (SIGCONT) after it, even when it raises.

    A server that is up but idle is not silent: Ray's GCS, raylet and dashboard, and a
    continuous-batching loop that polls its queue, take CPU time on a 2-core machine, and
    a decode step that runs on both cores waits for the slower of its two threads. A
    stopped process keeps its memory and sockets and takes no CPU; the whole tree is
    stopped and resumed together, so that no part of a server sees another part missing.
    """

    def __init__(self, servers: Sequence[object]) -> None:
        self.servers = list(servers)
        self.stopped: List[int] = []

    def _signal(self, pids: Sequence[int], signum: int) -> List[int]:
        done = []
        for pid in pids:
            try:
                os.kill(pid, signum)
                done.append(pid)
            except ProcessLookupError:
                pass
        return done

    def __enter__(self) -> "Paused":
        pids = [pid for server in self.servers for pid in process_tree(server.pid)]
        self.stopped = self._signal(pids, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        # children first, then parents: a parent resumed first could see a stopped child
        self._signal(list(reversed(self.stopped)), signal.SIGCONT)
        self.stopped = []
