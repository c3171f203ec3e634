"""Continuous batching: one decode loop per model, shared by every request.

A :class:`Scheduler` owns a thread that repeats one cycle: admit waiting requests (in
arrival order, while the running batch has room), prefill them as a batch of their own
and merge them into the running batch, then run one decode step for everyone. A finished,
stopped or abandoned request leaves the batch, and its KV-cache rows are freed, at the
next step. Each request keeps its own sampling parameters, seed, stop strings and limits,
so batching never changes what a request generates.

``submit()`` returns a :class:`GenerationStream`: an iterator yielding, per decode step in
which the request advanced, one list with the new text of each of its prompts. Closing it
(a client that left) cancels the request.

Example::

    scheduler = Scheduler(model, tokenizer, max_batch_size=32, max_queue=100)
    stream = scheduler.submit(build_sequences(model, tokenizer, prompt_ids, max_new_tokens=64))
    for pieces in stream:
        print(pieces[0], end="", flush=True)
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import itertools
import logging
import queue
import sys
import threading
from typing import Deque, Dict, Iterator, List, Optional, Sequence

from djl_stream.generation.batch import CausalLMBatch, generate_token
from djl_stream.generation.errors import GenerationFailed, QueueFullError
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.generation.step import Generation, Step

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE = 1000

_END = object()


class _Job:
    """One submitted request: its sequences and the queue its stream reads from."""

    __slots__ = ("job_id", "sequences", "outbox", "cancelled", "done")

    def __init__(self, job_id: int, sequences: List[GenerationSequence]):
        self.job_id = job_id
        self.sequences = sequences
        self.outbox: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self.cancelled = False
        self.done = False

    def finish(self, error: Optional[BaseException] = None) -> None:
        if not self.done:
            self.done = True
            self.outbox.put(error if error is not None else _END)


class GenerationStream(Iterator[List[str]]):
    """The stream of one request; see the module docstring. ``close()`` cancels it."""

    def __init__(self, scheduler: "Scheduler", job: _Job):
        self._scheduler = scheduler
        self._job = job
        self._closed = False

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> List[str]:
        if self._closed:
            raise StopIteration
        item = self._job.outbox.get()
        if item is _END:
            self._closed = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._closed = True
            raise item
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop generating for this request (idempotent)."""
        if not self._closed:
            self._closed = True
            self._scheduler.cancel(self._job)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    @property
    def sequences(self) -> List[GenerationSequence]:
        return self._job.sequences


class Scheduler:
    """The decode loop of one model; see the module docstring.

    ``max_batch_size`` caps the rows (prompts) decoding together
    (``option.max_rolling_batch_size``); ``max_queue`` caps the requests waiting for room
    (``job_queue_size``), beyond which :meth:`submit` raises :class:`QueueFullError`.
    """

    def __init__(
        self,
        model,
        *,
        pad_token_id: int,
        device,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_queue: int = DEFAULT_MAX_QUEUE,
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self._ids = itertools.count()
        self._waiting: Deque[_Job] = collections.deque()
        self._jobs: Dict[int, _Job] = {}
        self._wakeup = threading.Condition()
        self._running: Optional[CausalLMBatch] = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="djl-stream-scheduler", daemon=True)
        self._thread.start()
        _LIVE_SCHEDULERS.append(self)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step; requests still in flight end with an
        error. Called at interpreter exit, because a daemon thread killed in the middle of
        a torch operation aborts the whole process."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join(timeout)

    # -- called from request threads --------------------------------------------------

    def submit(self, sequences: Sequence[GenerationSequence]) -> GenerationStream:
        """Queue a request (its sequences join the running batch together)."""
        if not sequences:
            raise ValueError("a request needs at least one sequence")
        if len(sequences) > self.max_batch_size:
            raise ValueError(
                f"the request has {len(sequences)} prompts; at most "
                f"{self.max_batch_size} (option.max_rolling_batch_size) run together"
            )
        with self._wakeup:
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting; the queue holds "
                    f"{self.max_queue} (job_queue_size)"
                )
            job = _Job(next(self._ids), list(sequences))
            for index, seq in enumerate(job.sequences):
                seq.request_id = (job.job_id, index)
            self._jobs[job.job_id] = job
            self._waiting.append(job)
            self._wakeup.notify()
        return GenerationStream(self, job)

    def cancel(self, job: _Job) -> None:
        with self._wakeup:
            job.cancelled = True
            self._wakeup.notify()

    @property
    def running_size(self) -> int:
        running = self._running
        return len(running) if running is not None else 0

    @property
    def waiting_size(self) -> int:
        return len(self._waiting)

    # -- the loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            admitted: List[_Job] = []
            try:
                admitted = self._wait_for_work()
                if self._stopping:
                    break
                if admitted:
                    self._prefill(admitted)
                self._drop_cancelled()
                if self._running is not None:
                    self._decode()
                if self._running is None and not self._waiting:
                    # The batch just emptied (the loop only gets here with work done).
                    release_cached_memory()
            except Exception as error:  # noqa: BLE001 - the loop must outlive any bug
                # Whatever went wrong, no request may wait forever: fail everything
                # in flight and start again with an empty batch.
                running, self._running = self._running, None
                in_flight = self._jobs_of(running.sequences) if running is not None else []
                self._fail(list({id(j): j for j in admitted + in_flight}.values()), error)
        self._running = None
        with self._wakeup:
            for job in list(self._jobs.values()):
                job.finish(GenerationFailed("the server is shutting down"))
            self._jobs.clear()
            self._waiting.clear()

    def _wait_for_work(self) -> List[_Job]:
        """Block until there is something to do; return the jobs admitted now."""
        with self._wakeup:
            while True:
                while self._waiting and self._waiting[0].cancelled:
                    self._forget(self._waiting.popleft())
                if self._waiting or self._running is not None or self._stopping:
                    break
                self._wakeup.wait()
            room = self.max_batch_size - self.running_size
            admitted: List[_Job] = []
            # Arrival order, no overtaking: a big request at the head waits for room
            # rather than being starved by small ones behind it.
            while self._waiting and len(self._waiting[0].sequences) <= room:
                job = self._waiting.popleft()
                if job.cancelled:
                    self._forget(job)
                    continue
                room -= len(job.sequences)
                admitted.append(job)
            return admitted

    def _prefill(self, jobs: List[_Job]) -> None:
        sequences = [seq for job in jobs for seq in job.sequences]
        try:
            batch = CausalLMBatch.from_sequences(
                sequences, pad_token_id=self.pad_token_id, device=self.device
            )
            generations, batch = generate_token(self.model, batch)
        except Exception as error:  # noqa: BLE001 - fail these requests, keep serving
            self._fail(jobs, error)
            return
        self._dispatch(generations)
        if batch is not None:
            self._running = (
                batch if self._running is None
                else CausalLMBatch.concatenate([self._running, batch])
            )

    def _decode(self) -> None:
        batch = self._running
        try:
            generations, self._running = generate_token(self.model, batch)
        except Exception as error:  # noqa: BLE001 - fail these requests, keep serving
            self._running = None
            self._fail(self._jobs_of(batch.sequences), error)
            return
        self._dispatch(generations)

    def _drop_cancelled(self) -> None:
        batch = self._running
        if batch is None:
            return
        cancelled = {seq.request_id[0] for seq in batch.sequences
                     if getattr(self._jobs.get(seq.request_id[0]), "cancelled", True)}
        if not cancelled:
            return
        keep = [seq.request_id for seq in batch.sequences if seq.request_id[0] not in cancelled]
        self._running = batch.filter(keep)
        logger.info("dropped %d cancelled request(s) from the batch; %d row(s) remain",
                    len(cancelled), len(keep))
        with self._wakeup:
            for job_id in cancelled:
                if job_id in self._jobs:
                    self._forget(self._jobs[job_id])

    def _dispatch(self, generations: List[Generation]) -> None:
        """Send each job the list of its prompts' new text for this step."""
        by_job: Dict[int, List[Generation]] = {}
        for generation in generations:
            by_job.setdefault(generation.request_id[0], []).append(generation)
        for job_id, job_generations in by_job.items():
            job = self._jobs[job_id]
            per_prompt: List[Optional[Generation]] = [None] * len(job.sequences)
            for generation in job_generations:
                per_prompt[generation.request_id[1]] = generation
            job.outbox.put(Step.of(per_prompt))
            if all(seq.finished for seq in job.sequences):
                with self._wakeup:
                    self._forget(job)

    def _fail(self, jobs: List[_Job], error: Exception) -> None:
        logger.exception("generation step failed for %d request(s)", len(jobs), exc_info=error)
        failure = GenerationFailed(f"{type(error).__name__}: {error}")
        with self._wakeup:
            for job in jobs:
                job.finish(failure)
                self._jobs.pop(job.job_id, None)

    def _jobs_of(self, sequences: List[GenerationSequence]) -> List[_Job]:
        ids = dict.fromkeys(seq.request_id[0] for seq in sequences)
        return [self._jobs[job_id] for job_id in ids if job_id in self._jobs]

    def _forget(self, job: _Job) -> None:
        job.finish()
        self._jobs.pop(job.job_id, None)


def release_cached_memory() -> None:
    """Give freed KV-cache memory back to the system once the batch is empty.

    On CPU, glibc keeps large freed blocks in the decode thread's malloc arena, so the
    server's resident size would stay at its peak after a burst; ``malloc_trim`` returns
    them. On GPU, PyTorch's caching allocator holds them until ``empty_cache``.
    """
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (not musl)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()

#: Every scheduler started. A scheduler lives as long as the process, like the model its
#: running thread holds, so plain (strong) containers are the honest ones.
_LIVE_SCHEDULERS: List[Scheduler] = []


@atexit.register
def _shutdown_all() -> None:
    for scheduler in list(_LIVE_SCHEDULERS):
        scheduler.shutdown()


#: The scheduler of each model (keyed by the model object itself, compared by identity).
_SCHEDULERS: Dict[object, Scheduler] = {}
_SCHEDULERS_LOCK = threading.Lock()


def scheduler_for(model, *, pad_token_id: int, device, **settings) -> Scheduler:
    """The model's scheduler, created on first use (``settings`` apply only then)."""
    with _SCHEDULERS_LOCK:
        scheduler = _SCHEDULERS.get(model)
        if scheduler is None:
            scheduler = Scheduler(model, pad_token_id=pad_token_id, device=device, **settings)
            _SCHEDULERS[model] = scheduler
        return scheduler
