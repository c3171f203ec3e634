"""``python -m benchmarks.cycle_trace``: where a burst of clients' first tokens go, one
scheduler cycle at a time.

The model is loaded in this process as the server loads it, and ``--clients`` client
threads, released together, each stream ``--tokens`` tokens through
``StreamingUtils.get_stream_generator("Accelerate")`` (the server's path without HTTP). The
scheduler's passes are timed from inside: every decode step, prefill pass, mixed pass
(prompts read beside the running batch's step), join and cache concatenation, and on a GPU
every CUDA-graph capture. For each pass it reports its wall time and what may explain a
slow one:

* **cpu**: the scheduler thread's own CPU time in it (``time.thread_time``): near the wall
  time, the pass computed on the host (Python, launching kernels, the garbage collector);
  far below it, it waited (for the GPU, for the GIL);
* **gc**: the garbage collector's pauses inside it, in any thread (a collection holds the
  GIL, so the scheduler waits for it too), with their generations;
* **segments**: on a GPU, how many new segments PyTorch's caching allocator asked the
  driver for (``cudaMalloc``) during it.

Each client count runs ``--rounds`` times, then ``--late`` clients with one more request
arriving once they all have two tokens (``make bench``'s late arrival; at most one less
than ``option.max_rolling_batch_size``, so that the late request finds a row free; client
counts past it decode in waves, the rest waiting for rows). Per round: the
span, tokens/s, time to first token min/p50/max, resident memory, totals per kind of pass,
then the passes in order, the replayed decode steps left out unless slow. The figures
come from one process and one machine: compare rounds of one run.

It was written for a GPU whose first bursts stalled for 0.5-1 s in passes that take 25-150
ms the next time (docs/PERFORMANCE.md, "Targets missed"); on a CPU it shows the same
cycles at CPU speed.

On a GPU, ``CUDA_MODULE_LOADING=EAGER`` in the environment loads every kernel when CUDA
starts instead of at its first launch (the default, ``LAZY``): a stall that it removes
was a first launch.

Example::

    python -m benchmarks.cycle_trace --model-dir model --clients 4,16 --tokens 16 --late 0
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gc
import os
import statistics
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from djl_stream import StreamingUtils
from djl_stream.generation import cuda_graphs
from djl_stream.generation.burst_warm_up import burst_sizes, warm_up_bursts
from djl_stream.generation import scheduler as scheduler_module
from djl_stream.generation.batch import CausalLMBatch

from .inprocess import LoadedModel
from .measure import ProcessMemory
from .settings import PROMPTS, late_clients


@dataclasses.dataclass
class Pass:
    """One timed call: what it was, when (seconds on the trace's clock), how long, the
    calling thread's CPU seconds, the collector's pauses inside it and new GPU segments."""

    kind: str
    label: str
    start: float
    wall: float
    cpu: float
    gc: float = 0.0
    gc_generations: Tuple[int, ...] = ()
    segments: int = 0


class CycleTrace:
    """Times the scheduler's passes while installed (a context manager): ``passes`` holds
    them, ``collections`` the garbage collector's pauses ``(start, seconds, generation)``.

    >>> with CycleTrace() as trace:
    ...     pass
    >>> trace.passes
    []
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.passes: List[Pass] = []
        self.collections: List[Tuple[float, float, int]] = []
        self._cuda = device if device is not None and device.type == "cuda" else None
        self._undo: List[Callable[[], None]] = []
        self._gc_started = 0.0
        self._in_flight = 0
        self._settled = threading.Condition()

    def __enter__(self) -> "CycleTrace":
        def running(s):
            return len(s._running) if s._running is not None else 0

        def prompts(jobs):
            return sum(len(job.sequences) for job in jobs)

        self._wrap(scheduler_module.Scheduler, "_decode", "decode",
                   lambda s: f"{len(s._running)} rows, {s._running.cache_length} columns")
        self._wrap(scheduler_module.Scheduler, "_prefill_step", "prefill",
                   lambda s: f"{prompts(s._prefilling[0].jobs)} prompts"
                             f"{' (burst)' if s._prefilling[0].burst else ''}, "
                             f"{running(s)} rows running")
        self._wrap(scheduler_module.Scheduler, "_mixed_step", "mixed",
                   lambda s, prefill: f"{prompts(prefill.jobs)} prompts beside {running(s)} rows")
        self._wrap(scheduler_module.Scheduler, "_join", "join", lambda s: "")
        self._wrap(cuda_graphs.CudaGraphSteps, "_capture", "capture",
                   lambda s, static, keys, values: f"{static.ids.shape[0]} rows")
        concatenate = CausalLMBatch.__dict__["concatenate"]
        trace = self

        def concatenated(cls, batches, *args, **kwargs):
            label = " + ".join(str(len(b)) for b in batches if b is not None)
            with trace._timing("concatenate", label):
                return concatenate.__func__(cls, batches, *args, **kwargs)

        CausalLMBatch.concatenate = classmethod(concatenated)
        self._undo.append(lambda: setattr(CausalLMBatch, "concatenate", concatenate))
        gc.callbacks.append(self._on_collection)
        self._undo.append(lambda: gc.callbacks.remove(self._on_collection))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def clear(self) -> None:
        self.passes.clear()
        self.collections.clear()

    def settle(self, timeout: float = 10.0) -> None:
        """Wait for the passes under way to be recorded: a client has its last token while
        the step that made it is still handing tokens out, before its time is written."""
        with self._settled:
            self._settled.wait_for(lambda: self._in_flight == 0, timeout)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.collections.append((self._gc_started, time.perf_counter() - self._gc_started,
                                     info["generation"]))

    def _segments(self) -> int:
        if self._cuda is None:
            return 0
        return torch.cuda.memory_stats(self._cuda).get("segment.all.allocated", 0)

    @contextlib.contextmanager
    def _timing(self, kind: str, label: str):
        with self._settled:
            self._in_flight += 1
        segments, cpu, start = self._segments(), time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - start
            inside = [(s, d, g) for s, d, g in self.collections if start <= s <= start + wall]
            self.passes.append(Pass(kind, label, start, wall, time.thread_time() - cpu,
                                    sum(d for _, d, _ in inside),
                                    tuple(g for _, _, g in inside),
                                    self._segments() - segments))
            with self._settled:
                self._in_flight -= 1
                self._settled.notify_all()

    def _wrap(self, owner, name: str, kind: str, describe: Callable[..., str]) -> None:
        original = owner.__dict__[name]
        trace = self

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with trace._timing(kind, describe(*args)):
                return original(*args, **kwargs)

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))


@dataclasses.dataclass
class Round:
    """One round's clients: their times to first token (ms), tokens, and the span (s)."""

    clients: int
    tokens: int
    span: float
    first_tokens: List[float]
    late_first_token: Optional[float] = None
    resident_mib: int = 0


def warm_up_as_the_server(lm: LoadedModel) -> float:
    """What the server runs before it says it is ready (``StreamingService._warm_up``,
    less the request parse): one short request, then on a GPU bursts of requests."""
    began = time.perf_counter()
    generate = StreamingUtils.get_stream_generator("Accelerate")
    for _ in generate(lm.model, lm.tokenizer, ["Hello"], max_new_tokens=2):
        pass
    warm_up_bursts(generate, lm.model, lm.tokenizer,
                   burst_sizes(lm.device, lm.properties.max_rolling_batch_size))
    return time.perf_counter() - began


def resident_mib() -> int:
    memory = ProcessMemory.of()
    return memory.rss >> 20 if memory is not None else 0


def run_round(lm: LoadedModel, prompts: Sequence[str], clients: int, tokens: int, *,
              late: bool = False) -> Round:
    """``clients`` threads released together, each streaming ``tokens`` tokens of prompt
    ``i % len(prompts)``; with ``late``, one more request once every client has two."""
    generator = StreamingUtils.get_stream_generator("Accelerate")
    barrier = threading.Barrier(clients + 1)
    first = [0.0] * clients
    received = [0] * clients

    def client(i: int) -> None:
        barrier.wait()
        began = time.perf_counter()
        for _ in generator(lm.model, lm.tokenizer, [prompts[i % len(prompts)]],
                           max_new_tokens=tokens, ignore_eos=True):
            received[i] += 1
            if received[i] == 1:
                first[i] = (time.perf_counter() - began) * 1e3

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    began = time.perf_counter()
    barrier.wait()
    late_first = None
    if late:
        while min(received) < 2 and any(t.is_alive() for t in threads):
            time.sleep(0.001)
        sent = time.perf_counter()
        stream = generator(lm.model, lm.tokenizer, [prompts[0]], max_new_tokens=2,
                           ignore_eos=True)
        next(stream)
        late_first = (time.perf_counter() - sent) * 1e3
        for _ in stream:
            pass
    for thread in threads:
        thread.join()
    return Round(clients, tokens, time.perf_counter() - began, first, late_first,
                 resident_mib())


def report(round_: Round, trace: CycleTrace, began: float, max_lines: int) -> str:
    firsts = sorted(round_.first_tokens)
    lines = [f"## {round_.clients} clients{' + 1 late' if round_.late_first_token else ''}: "
             f"{round_.span * 1e3:.0f} ms, "
             f"{round_.clients * round_.tokens / round_.span:.0f} tokens/s, first token "
             f"min/p50/max {firsts[0]:.0f}/{firsts[len(firsts) // 2]:.0f}/{firsts[-1]:.0f} ms"
             + (f", late arrival's {round_.late_first_token:.0f} ms"
                if round_.late_first_token else "")
             + f", RSS {round_.resident_mib} MB"]
    passes = sorted(trace.passes, key=lambda p: p.start)
    counts, walls = collections.Counter(), collections.Counter()
    for p in passes:
        counts[p.kind] += 1
        walls[p.kind] += p.wall
    pauses = [d for _, d, _ in trace.collections]
    lines.append("  totals: " + ", ".join(f"{kind} {counts[kind]}x {walls[kind] * 1e3:.0f} ms"
                                          for kind in counts)
                 + f"; garbage collector: {len(pauses)} pauses, {sum(pauses) * 1e3:.0f} ms, "
                   f"longest {max(pauses, default=0) * 1e3:.0f} ms")
    decodes = [p.wall for p in passes if p.kind == "decode"]
    slow = 3 * statistics.median(decodes) if decodes else 0.0
    shown = [p for p in passes if p.kind != "decode" or p.wall > slow]
    for p in shown[:max_lines]:
        extras = [f"cpu {p.cpu * 1e3:.0f}"]
        if p.gc:
            extras.append(f"gc {p.gc * 1e3:.0f} (gen {','.join(map(str, p.gc_generations))})")
        if p.segments:
            extras.append(f"+{p.segments} segments")
        lines.append(f"  +{(p.start - began) * 1e3:7.1f} {p.wall * 1e3:7.1f} ms {p.kind:11s} "
                     f"{p.label} [{', '.join(extras)}]")
    if len(shown) > max_lines:
        lines.append(f"  ... {len(shown) - max_lines} more")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cycle_trace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--decode-step", default="",
                        help="option.decode_step over the model directory's (default: its own)")
    parser.add_argument("--clients", default="1,4,4,16,16,64,64",
                        help="client counts, one round each, in this order")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per client")
    parser.add_argument("--late", type=int, default=31,
                        help="clients decoding when one more arrives (0: no late rounds; at "
                             "most option.max_rolling_batch_size - 1, so that it finds a row)")
    parser.add_argument("--late-rounds", type=int, default=2)
    parser.add_argument("--max-lines", type=int, default=40, help="passes shown per round")
    parser.add_argument("--no-warm-up", action="store_true",
                        help="skip the server's warm-up at load (one request, and on a GPU "
                             "bursts: djl_stream.generation.burst_warm_up)")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    lm = LoadedModel.load(args.model_dir, device=args.device, decode_step=args.decode_step)
    prompts = [lm.prompt(p).text for p in PROMPTS]
    loading = os.environ.get("CUDA_MODULE_LOADING", "unset: LAZY")
    print(f"{args.model_dir} on {lm.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, RSS {resident_mib()} MB after loading"
          + (f", CUDA_MODULE_LOADING {loading}" if lm.device.type == "cuda" else ""),
          flush=True)
    if not args.no_warm_up:
        seconds = warm_up_as_the_server(lm)
        print(f"the server's warm-up in {seconds:.1f} s, RSS {resident_mib()} MB after it",
              flush=True)
    rounds = [(int(c), False) for c in args.clients.split(",") if c]
    late = late_clients(args.late, lm.properties.max_rolling_batch_size)
    if late != args.late:
        print(f"--late {args.late}: {late} clients instead, one less than "
              f"option.max_rolling_batch_size ({lm.properties.max_rolling_batch_size}), so "
              "that the late request finds a row free", flush=True)
    rounds += [(late, True)] * (args.late_rounds if late > 0 else 0)
    with CycleTrace(lm.device) as trace:
        for clients, late in rounds:
            trace.clear()
            began = time.perf_counter()
            result = run_round(lm, prompts, clients, args.tokens, late=late)
            trace.settle()
            print(report(result, trace, began, args.max_lines) + "\n", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
