"""Decode steps replayed from CUDA graphs: djl-stream's Llama decode step captured once per
row bucket and column window of a KV cache's buffers, then replayed with one launch.

On a GPU the decode step of a small model is bound by launching kernels, not by running
them: each of a step's few hundred kernels (a dozen a layer) is dispatched from Python and
finishes in microseconds. A CUDA graph records the kernels of one step, with their
arguments, and replays them all with one launch. What it recorded must not change, so:

* **shapes are fixed**: a batch's rows are padded up to a bucket (:data:`ROW_BUCKETS`,
  within the cache's row capacity: :func:`row_bucket`), and attention reads the cache's
  columns from the first one up to a window rounded up to :data:`COLUMN_WINDOW`
  (:func:`column_window`), with the padding mask hiding what is not the row's;
* **addresses are fixed**: the step's inputs (token ids, positions, the mask, the column it
  writes) are copied into tensors the graph owns before each replay, and its logits come
  out of one it owns. The cache's buffers are read and written in place (a copy would cost
  more than the step), so a graph belongs to one cache's buffers and is kept under their
  addresses and shapes: a cache that grows, or the cache of a new running batch, gets
  graphs of its own, unless PyTorch's caching allocator handed back the same blocks (as
  it can for a batch of the same shape once the last one is freed: the scheduler keeps
  freed blocks in that cache where graphs are replayed,
  :func:`~djl_stream.generation.allocators.release_cached_memory`). :data:`MAX_GRAPHS`
  graphs are kept, the least recently replayed dropped first, all in one memory pool;
* **padding rows change nothing**: the slots above the batch's rows (free, or lent to a
  prompt being prefilled) are computed with the others but write back the cache column
  they hold (``real`` in :func:`~djl_stream.generation.llama_decode._decode_logits`), and
  their logits are dropped.

A graph is captured at the :data:`CAPTURE_AFTER`-th step of a (bucket, window, buffers),
the steps before it run eagerly: a capture (two warm-up runs on a side stream, then the
recording, all with every row marked padding, so that they change no cache) took 86 ms of
SmolLM2-135M's step on an H200, about 5 eager steps, and a burst of arrivals passes through
bucket sizes and cache buffers that last a step or two. See ``stats``.

Example (on a CUDA machine)::

    graphs = CudaGraphSteps(llama_decode.step_of(model))
    logits = graphs.logits(batch.input_ids, batch.position_ids, batch.attention_mask,
                           keys, values, start, column)   # None: not captured, run eagerly

Without a GPU, :class:`CudaGraphSteps` with ``capture=False`` runs the same padded,
windowed computation eagerly (what the tests check on a CPU); it is never used to serve.

>>> row_bucket(3, capacity=16), row_bucket(3, capacity=3), row_bucket(20, capacity=24)
(4, 3, 24)
>>> column_window(1, capacity=1024), column_window(257, capacity=300)
(256, 300)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

#: The row counts a graph is captured for: a batch runs the graph of the smallest one that
#: holds it (and fits its cache's row capacity).
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Attention reads the cache's columns in windows of this many: a batch past a window's
#: end moves to the next window's graph. Wider windows mean fewer graphs but more columns
#: read and masked each step.
COLUMN_WINDOW = 256
#: How many captured graphs are kept (the least recently replayed go first).
MAX_GRAPHS = 64
#: The step of a (bucket, window, buffers) at which its graph is captured; the ones before
#: run eagerly, so that shapes and buffers that last a step or two cost no capture.
CAPTURE_AFTER = 3


def row_bucket(rows: int, capacity: int) -> int:
    """The rows a step of ``rows`` rows is padded to: the smallest of :data:`ROW_BUCKETS`
    that holds them within the cache's row ``capacity``, else the capacity itself."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket <= capacity:
            return bucket
    return capacity


def column_window(columns: int, capacity: int) -> int:
    """How many of the cache's first columns a step over its first ``columns`` reads:
    ``columns`` rounded up to :data:`COLUMN_WINDOW`, at most the cache's column
    ``capacity``."""
    return min(capacity, -(-columns // COLUMN_WINDOW) * COLUMN_WINDOW)


@dataclasses.dataclass
class _StaticStep:
    """One graph's fixed inputs and output, for ``rows`` rows and ``window`` columns."""

    ids: torch.Tensor        # (rows,) token ids
    positions: torch.Tensor  # (rows, 1)
    mask: torch.Tensor       # (rows, 1, 1, window) additive
    column: torch.Tensor     # (1,) the cache column written
    real: torch.Tensor       # (rows, 1, 1, 1) which rows are the batch's
    logits: Optional[torch.Tensor] = None
    graph: Optional["torch.cuda.CUDAGraph"] = None

    @classmethod
    def allocate(cls, rows: int, window: int, dtype: torch.dtype,
                 device: torch.device) -> "_StaticStep":
        return cls(ids=torch.zeros(rows, dtype=torch.long, device=device),
                   positions=torch.zeros((rows, 1), dtype=torch.long, device=device),
                   mask=torch.zeros((rows, 1, 1, window), dtype=dtype, device=device),
                   column=torch.zeros(1, dtype=torch.long, device=device),
                   real=torch.zeros((rows, 1, 1, 1), dtype=torch.bool, device=device))

    def fill(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor, start: int, column: int) -> None:
        """Copy a step's inputs in: the batch's rows first, then padding rows, which see
        only the column they write (attention over no column at all would be NaN)."""
        rows = input_ids.shape[0]
        self.ids.zero_()
        self.ids[:rows].copy_(input_ids.view(rows))
        self.positions.zero_()
        self.positions[:rows].copy_(position_ids.view(rows, 1))
        self.mask.fill_(float("-inf"))
        seen = attention_mask.view(rows, column + 1 - start) != 0
        self.mask[:rows, 0, 0, start:column + 1].masked_fill_(seen, 0.0)
        self.mask[rows:, 0, 0, column] = 0.0
        self.column.fill_(column)
        self.real.zero_()
        self.real[:rows] = True

    def fill_padding_only(self) -> None:
        """Inputs under which a run changes no cache (every row padding), for warming up
        and capturing."""
        self.ids.zero_()
        self.positions.zero_()
        self.mask.fill_(float("-inf"))
        self.mask[:, 0, 0, 0] = 0.0
        self.column.zero_()
        self.real.zero_()


@dataclasses.dataclass
class GraphStats:
    """What :class:`CudaGraphSteps` did: graphs captured (and the seconds it took),
    replayed, and dropped to stay within :data:`MAX_GRAPHS`."""

    captured: int = 0
    capture_seconds: float = 0.0
    replayed: int = 0
    dropped: int = 0


class CudaGraphSteps:
    """Decode steps of a :class:`~djl_stream.generation.llama_decode.LlamaDecodeStep`
    replayed from CUDA graphs: see the module docstring.

    ``capture=False`` runs the padded, windowed step eagerly instead of capturing it (on
    a CPU, for tests of the padding and the windows; never to serve). ``capture_after``
    is :data:`CAPTURE_AFTER` unless given.
    """

    def __init__(self, step, *, capture: bool = True, max_graphs: int = MAX_GRAPHS,
                 capture_after: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.step = step
        self.capture = capture
        self.max_graphs = max_graphs
        self.capture_after = CAPTURE_AFTER if capture_after is None else capture_after
        #: Steps run so far of each (bucket, window, buffers) not captured yet.
        self._pending: Dict[tuple, int] = {}
        self.stats = GraphStats()
        self._clock = clock
        self._graphs: "collections.OrderedDict[tuple, _StaticStep]" = collections.OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def __len__(self) -> int:
        return len(self._graphs)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor, keys: Sequence[torch.Tensor],
               values: Sequence[torch.Tensor], start: int, column: int
               ) -> Optional[torch.Tensor]:
        """The logits ``(rows, vocab)`` of a decode step of ``input_ids`` (``(rows, 1)``)
        whose cache buffers are ``keys``/``values`` (each layer's whole buffers), its
        columns in use from ``start`` and its new column ``column``; the step writes that
        column of the batch's rows, as the eager step does. ``None`` (nothing run) for
        the steps before a graph's capture (:data:`CAPTURE_AFTER`): the caller runs
        them eagerly."""
        rows = input_ids.shape[0]
        bucket = row_bucket(rows, keys[0].shape[0])
        window = column_window(column + 1, keys[0].shape[2])
        key = (bucket, window, tuple(keys[0].shape), tuple(values[0].shape),
               tuple(t.data_ptr() for t in keys), tuple(t.data_ptr() for t in values))
        static = self._graphs.get(key)
        if static is None:
            seen = self._pending.pop(key, 0) + 1
            if seen < self.capture_after:
                if len(self._pending) >= 4 * self.max_graphs:
                    self._pending.clear()  # (keys of buffers long gone)
                self._pending[key] = seen
                return None
            static = self._new_graph(key, bucket, window, keys, values)
        else:
            self._graphs.move_to_end(key)
        static.fill(input_ids, position_ids, attention_mask, start, column)
        if static.graph is None:
            static.logits = self._run(static, keys, values)
        else:
            static.graph.replay()
            self.stats.replayed += 1
        # the output tensor is the graph's: the next replay overwrites it
        return static.logits[:rows].clone()

    def _run(self, static: _StaticStep, keys, values) -> torch.Tensor:
        from djl_stream.generation.llama_decode import _decode_logits

        step = self.step
        hidden = F.embedding(static.ids, step.embedding)
        cos, sin = step.rotary(hidden, static.positions)
        return _decode_logits(step.geometry, step.layers, step.final_norm, step.lm_head,
                              hidden, cos.unsqueeze(1), sin.unsqueeze(1), static.mask,
                              keys, values, static.column, 0, real=static.real)

    def _new_graph(self, key: tuple, bucket: int, window: int, keys, values) -> _StaticStep:
        static = _StaticStep.allocate(bucket, window, self.step.embedding.dtype,
                                      keys[0].device)
        if self.capture:
            started = self._clock()
            self._capture(static, keys, values)
            seconds = self._clock() - started
            self.stats.captured += 1
            self.stats.capture_seconds += seconds
            logger.info("captured the decode step of %d rows over %d columns in a CUDA graph "
                        "in %.0f ms (%s)", bucket, window, seconds * 1e3, describe(self.stats))
        self._graphs[key] = static
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats.dropped += 1
        return static

    def _capture(self, static: _StaticStep, keys, values) -> None:
        """Warm up on a side stream (cuBLAS and attention pick and set up their kernels
        there, which a capture must not see), then record one run."""
        static.fill_padding_only()
        side = torch.cuda.Stream(device=keys[0].device)
        side.wait_stream(torch.cuda.current_stream(keys[0].device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(static, keys, values)
        torch.cuda.current_stream(keys[0].device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (none are expected in a server, whose
        # scheduler thread alone runs the model) must not invalidate the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static.logits = self._run(static, keys, values)
        static.graph = graph


def cuda_graphs_unavailable(model) -> Optional[str]:
    """Why decode steps of ``model`` cannot be replayed from CUDA graphs, or ``None``."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return "the model is not on one CUDA GPU"
    return None


def describe(stats: GraphStats) -> str:
    """One line for the log.

    >>> describe(GraphStats(captured=3, capture_seconds=0.12, replayed=40))
    '3 graphs captured in 120 ms, 40 replays'
    """
    return (f"{stats.captured} graphs captured in {stats.capture_seconds * 1e3:.0f} ms, "
            f"{stats.replayed} replays" + (f", {stats.dropped} dropped" if stats.dropped else ""))


