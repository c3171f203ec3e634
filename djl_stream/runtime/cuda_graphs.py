"""Decode steps replayed from CUDA graphs, for every architecture the attention path serves.

On a GPU a small model's decode step is bound by launching kernels: hundreds of them, each
short, each launched by Python through the model's own code. A CUDA graph records one
step's kernels once and replays them with a single launch. A graph fixes its shapes and
the addresses it reads, so a decode step is recorded per *bucket* (:func:`bucket_of`): its
row count rounded up to a power of two, and the columns it attends rounded up to a power
of two times :data:`~djl_stream.runtime.kv_cache.COLUMN_GRANULE`. The model's forward
(:class:`~djl_stream.runtime.decode_program.DecodeStep`, the same module the CPU program
compiles) reads its inputs from tensors the graph owns, and a step copies its tokens and
positions into them before each replay.

A bucket holds more rows than the step has: a padding row writes its keys and values
into a cache row no sequence holds, at the last column, and attends only to column 0, so
it touches nothing a sequence reads and its logits (thrown away) stay finite. A cache
that grows its columns moves its buffers, so the graphs recorded over the old ones are
dropped and recorded again as steps need them.

A bucket is recorded the third time a step needs it (:data:`RECORD_AT_USE`); the steps
before run eagerly (:meth:`GraphedDecode.decode` returns ``None``). Recording costs a few
eager steps, and a burst of arrivals passes through row counts that last a step or two.

Recording runs the step twice on a side stream first (the allocator settles its blocks
there, as PyTorch's guide to graphs advises), then records it; every bucket's graph
shares one memory pool. How a step is recorded is the :class:`Recorder`'s: CUDA graphs on
a GPU, and on a CPU (tests) a recorder that runs the same step eagerly, so the buckets,
the padding and the static inputs are tested where no GPU is.

Example::

    graphs = GraphedDecode(model, runner.cache, runner.layer_windows)
    logits = graphs.decode(ids=[5, 9], positions=[12, 7])   # rows 0 and 1 of the cache
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from djl_stream.runtime.attention import block_mask
from djl_stream.runtime.decode_program import DecodeStep
from djl_stream.runtime.kv_cache import COLUMN_GRANULE, KVCache

logger = logging.getLogger(__name__)

#: The use of a bucket at which it is recorded (the ones before run eagerly).
RECORD_AT_USE = 3


def bucket_of(rows: int, span: int, most_rows: int, most_columns: int) -> Tuple[int, int]:
    """The recorded shape a step of ``rows`` rows attending ``span`` columns runs in: the
    next power of two of each (columns at least :data:`COLUMN_GRANULE`), within the
    cache's ``most_rows`` rows and ``most_columns`` columns.

    >>> bucket_of(3, 40, most_rows=33, most_columns=1024)
    (4, 256)
    >>> bucket_of(17, 700, most_rows=33, most_columns=1024)
    (32, 1024)
    >>> bucket_of(33, 900, most_rows=33, most_columns=768)
    (33, 768)
    """
    row_bucket = 1 << max(0, rows - 1).bit_length()
    column_bucket = COLUMN_GRANULE
    while column_bucket < span:
        column_bucket *= 2
    return min(row_bucket, most_rows), min(column_bucket, most_columns)


class Recorder:
    """How a step is recorded and replayed: :class:`CudaGraphRecorder` on a GPU."""

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Record ``step`` (which reads and writes only tensors that outlive it); returns
        what replays it. What recording computes may be thrown away: the caller replays."""
        raise NotImplementedError


class EagerRecorder(Recorder):
    """Replays a step by running it: the same static inputs and buckets, no graph (for a
    CPU, where there is nothing to record)."""

    def record(self, step):
        return step


class CudaGraphRecorder(Recorder):
    """Records a step as a CUDA graph, every graph in one memory pool."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, step):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            step()
        return graph.replay


class _Bucket:
    """One recorded shape: its static inputs, its output, and its replay."""

    def __init__(self, rows: int, columns: int, vocab: int, device, dtype) -> None:
        self.rows, self.columns = rows, columns
        self.ids = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.mask_positions = torch.zeros((rows,), dtype=torch.long, device=device)
        self.write_rows = torch.zeros((rows,), dtype=torch.long, device=device)
        self.logits = torch.zeros((rows, vocab), dtype=dtype, device=device)
        self.replay: Optional[Callable[[], None]] = None
        self.uses = 0


class GraphedDecode:
    """Decode steps of the cache's rows ``[0, n)`` (one token each) replayed per bucket;
    see the module docstring."""

    def __init__(self, model: torch.nn.Module, cache: KVCache,
                 layer_windows: Sequence[Optional[int]],
                 recorder: Optional[Recorder] = None) -> None:
        self.cache = cache
        self.step = DecodeStep(model, layer_windows)
        self.windows = self.step.windows
        self.recorder = recorder or CudaGraphRecorder()
        self.vocab = model.get_output_embeddings().out_features
        self._buckets: Dict[Tuple[int, int], _Bucket] = {}
        self._buffers = None  # (the cache's buffers the buckets were recorded over)

    @property
    def recorded(self) -> List[Tuple[int, int]]:
        """The buckets recorded so far, as ``(rows, columns)``."""
        return sorted(key for key, bucket in self._buckets.items() if bucket.replay)

    def decode(self, ids: Sequence[int], positions: Sequence[int]) -> Optional[torch.Tensor]:
        """The logits ``(n, vocab)`` of one token of each of the cache's rows ``[0, n)``,
        token ``i`` at ``positions[i]`` (its keys and values written there); ``None``
        where the step's bucket is not recorded yet: the caller runs it eagerly."""
        cache = self.cache
        n = len(ids)
        if self._buffers is not cache.keys:  # (the cache grew: its buffers moved)
            self._buckets.clear()
            self._buffers = cache.keys
        rows, columns = bucket_of(n, max(positions) + 1, cache.rows + 1, cache.columns)
        bucket = self._buckets.get((rows, columns))
        if bucket is None:
            bucket = self._buckets[(rows, columns)] = _Bucket(
                rows, columns, self.vocab, cache.keys[0].device, self._logits_dtype())
        bucket.uses += 1
        if bucket.replay is None and bucket.uses < RECORD_AT_USE:
            return None
        self._fill(bucket, ids, positions)
        if bucket.replay is None:
            logger.debug("recording the decode step of %d rows over %d columns", rows, columns)
            bucket.replay = self.recorder.record(lambda: self._run(bucket))
        bucket.replay()
        return bucket.logits[:n].clone()

    def _logits_dtype(self) -> torch.dtype:
        weight = self.step.model.get_output_embeddings()
        parameter = next(weight.parameters(), None)
        return parameter.dtype if parameter is not None else self.cache.dtype

    def _fill(self, bucket: _Bucket, ids: Sequence[int], positions: Sequence[int]) -> None:
        """Copy the step's tokens into the bucket's inputs, padding rows after them."""
        n, size = len(ids), bucket.rows
        spare = self.cache.free_row()
        last = self.cache.columns - 1
        staged = torch.tensor([list(ids) + [0] * (size - n),
                               list(positions) + [last] * (size - n),
                               list(positions) + [0] * (size - n),
                               list(range(n)) + [spare] * (size - n)], dtype=torch.long)
        device = bucket.ids.device
        staged = staged.pin_memory() if device.type == "cuda" else staged
        staged = staged.to(device, non_blocking=True)
        bucket.ids[0].copy_(staged[0])
        bucket.positions[0].copy_(staged[1])
        bucket.mask_positions.copy_(staged[2])
        bucket.write_rows.copy_(staged[3])

    def _run(self, bucket: _Bucket) -> None:
        """The step over the bucket's inputs into its logits: what a graph records."""
        masks = [block_mask(bucket.mask_positions, bucket.columns, window)
                 for window in self.windows]
        with torch.inference_mode():
            logits = self.step(bucket.ids, bucket.positions, bucket.write_rows, masks,
                               self.cache.keys, self.cache.values)
        bucket.logits.copy_(logits)
