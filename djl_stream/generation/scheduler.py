"""Continuous batching: one decode loop per model, shared by every request.

A :class:`Scheduler` owns a thread that repeats one cycle: run one forward pass of prefill
for waiting requests, then one decode step for the running batch. Requests are admitted
in arrival order while the running batch has room; those that fit in the prefill budget
(``max_batch_prefill_tokens``: rows × prompt columns per forward pass) are prefilled
together in one pass, and a longer prompt is prefilled in chunks of that budget, one per
cycle, building its own KV cache, so that the running batch keeps taking decode steps
while it is read (chunked prefill). A chunk deep into a long prompt attends to all of it,
so it feeds fewer columns (:func:`prefill_columns`), and while requests decode a pass is
also kept within ``prefill_stall_steps`` of their decode steps, as timed
(:mod:`~djl_stream.generation.prefill_pacing`); with nothing decoding, the budget is wider
(``max_idle_prefill_tokens``), and so it is for a burst: requests waiting with
:data:`BURST_RATIO` times the running rows or more are admitted (up to
:data:`BURST_PASSES` passes of that budget) and read as if nothing were decoding. Where
the model runs djl-stream's Llama step, a chunk read
while requests decode shares one forward pass with their decode step (a mixed pass,
:func:`~djl_stream.generation.batch.mixed_pass`): the weights are read once for both, so
the streams wait for that pass alone and a short prompt is read in one pass. Once its
last chunk has chosen its first token, the request joins the running batch: at once when
its cache is no longer than the running rows', else at the start of the next cycle, which
reads no chunk: the joined batch is then heavier (its rows attend to the new prompt's
columns), and a running stream should not wait for a prefill pass and that step at once. A finished, stopped or abandoned request leaves the
batch, and its KV-cache rows are freed, at the next step. Each request keeps its own
sampling parameters, seed, stop strings and limits, so batching never changes what a
request generates.

``submit()`` returns a :class:`GenerationStream`: an iterator yielding, per decode step in
which the request advanced, one list with the new text of each of its prompts. Closing it
(a client that left) cancels the request.

What the scheduler does can be watched without touching it: a :class:`SchedulerObserver`
(added process-wide with :func:`add_observer`) is told when a request is submitted,
admitted, advanced and ended, with its :class:`RequestStats` (queue time, time to first
token, inter-token latency, tokens), and after each step the :class:`BatchState` (rows
running, requests waiting, KV-cache tokens). The serving layer turns these into Prometheus
metrics and log lines, so this package never needs a metrics library.

Example::

    scheduler = Scheduler(load_runner(model), max_batch_size=32, max_queue=100)
    stream = scheduler.submit(build_sequences(model, tokenizer, prompt_ids, max_new_tokens=64))
    for pieces in stream:
        print(pieces[0], end="", flush=True)
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from djl_stream.generation.batch import CausalLMBatch, generate_token, mixed_pass, prefill_chunk
from djl_stream.generation.errors import GenerationFailed, QueueFullError
from djl_stream.generation.prefill_pacing import (DEFAULT_PREFILL_STALL_STEPS, PrefillPacer,
                                                  attention_parity_context, prefill_columns)
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.generation.step import Generation, Step
from djl_stream.runtime.attention import PassAbandoned
from djl_stream.runtime.memory import release_cached_memory
from djl_stream.runtime.runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE = 1000
#: The longest prompt a request may send by default (``option.max_input_length``'s default).
DEFAULT_MAX_INPUT_LENGTH = 4096
#: The prefill budget (tokens per forward pass) when none is set, by device type. On a
#: CPU, prefill is compute-bound: the number keeps one chunk within a few decode steps of
#: a small model, so that a running stream barely slows while a long prompt is read; the
#: stall bound (:mod:`~djl_stream.generation.prefill_pacing`) narrows passes further where
#: the machine is slower. 64 rather than 32: a chat prompt of 40-60 tokens arriving beside
#: decoding streams is read in one pass where the stall bound allows it, not in two with a
#: decode step between. An accelerator reads a few thousand tokens in the time of a few
#: decode steps.
DEFAULT_MAX_BATCH_PREFILL_TOKENS = {"cpu": 64}
DEFAULT_ACCELERATOR_PREFILL_TOKENS = 2048
#: While no request is decoding, a prefill pass may feed this many times the budget: no
#: stream waits between tokens then, and fewer, wider passes read a long prompt sooner. A
#: request that arrives meanwhile waits for one such pass at most.
IDLE_PREFILL_FACTOR = 8
#: Rows waiting at least this many times the rows decoding make a burst (TGI's
#: ``waiting_served_ratio`` has the same meaning and value): the waiting requests are then
#: admitted and read with the idle budget, as if nothing were decoding, because the few
#: running streams waiting longer between two tokens costs less than the many waiting
#: ones' first tokens coming one prompt per pass (16 clients released together would
#: otherwise see the first read alone and the 15 others one per pass beside it).
BURST_RATIO = 1.2
#: A burst takes the waiting requests whose prompts fit in this many passes of the idle
#: budget (rows × the longest prompt), read in as many passes; a burst whose first prompt
#: alone does not fit is paced as any other prefill. The running streams wait for that
#: many passes at most, a decode step in each. With one pass, a burst of chat prompts a
#: little larger than one idle pass would leave its last few to be read one per pass.
BURST_PASSES = 2

_END = object()

#: How a request left the scheduler (:attr:`RequestStats.outcome`): every sequence
#: finished (eos, length or a stop string), its stream was closed first, or a step failed.
FINISHED, CANCELLED, FAILED = "finished", "cancelled", "failed"


@dataclasses.dataclass
class RequestStats:
    """What the scheduler measured of one request, updated in place as it runs.

    Times are ``time.perf_counter()`` readings: ``submitted_at`` when :meth:`Scheduler.submit`
    queued it, ``admitted_at`` when it left the queue for its prefill, ``first_token_at`` and
    ``last_token_at`` when the steps that gave it its first and latest tokens ended,
    ``ended_at`` when it left the scheduler. ``generated_tokens`` counts every token chosen
    for its prompts (end-of-sequence included); ``steps`` the decode steps that gave it any;
    ``reused_prompt_tokens`` the prompt tokens its caches started with, reused from other
    sequences' keys and values instead of read (see :mod:`djl_stream.runtime.kv_cache`).

    >>> stats = RequestStats(request_id=0, prompts=1, prompt_tokens=5, submitted_at=10.0,
    ...                      admitted_at=10.5, first_token_at=11.0, last_token_at=13.0, steps=5)
    >>> stats.queue_time, stats.time_to_first_token, stats.mean_inter_token_latency
    (0.5, 1.0, 0.5)
    """

    request_id: int
    prompts: int
    prompt_tokens: int
    submitted_at: float
    admitted_at: Optional[float] = None
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    ended_at: Optional[float] = None
    generated_tokens: int = 0
    steps: int = 0
    reused_prompt_tokens: int = 0
    outcome: Optional[str] = None
    #: The served model's name (the scheduler's ``model_name``), for metrics' labels.
    model: str = ""
    #: Why each of its sequences ended (``eos``, ``length``, ``stop``; ``cancelled`` or
    #: ``error`` for those that did not finish), once it has left.
    finish_reasons: Tuple[str, ...] = ()

    @property
    def queue_time(self) -> Optional[float]:
        """Submitted → admitted to the batch (its prefill starts)."""
        return None if self.admitted_at is None else self.admitted_at - self.submitted_at

    @property
    def time_to_first_token(self) -> Optional[float]:
        """Submitted → its first token chosen (queue time plus prefill)."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def mean_inter_token_latency(self) -> Optional[float]:
        """Mean time between consecutive steps that gave it tokens (None before two)."""
        if self.steps < 2 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / (self.steps - 1)

    @property
    def e2e_latency(self) -> Optional[float]:
        """Submitted → ended (its last token, cancellation or failure)."""
        return None if self.ended_at is None else self.ended_at - self.submitted_at


@dataclasses.dataclass(frozen=True)
class BatchState:
    """The scheduler's load at one moment.

    ``kv_cache_tokens`` counts the positions the KV cache holds: every running row's, plus
    those of prompts part-way through a chunked prefill.
    """

    running_rows: int = 0
    waiting_requests: int = 0
    kv_cache_tokens: int = 0
    model: str = ""


class SchedulerObserver:
    """Told what a :class:`Scheduler` does; override the methods you need (these do nothing).

    Calls come from the scheduler's decode thread (``request_submitted`` from the caller's
    thread, before the request can start), so an observer must be quick and thread-safe;
    one that raises is logged and otherwise ignored.

    >>> class Tokens(SchedulerObserver):
    ...     total = 0
    ...     def request_advanced(self, stats, tokens, interval):
    ...         Tokens.total += tokens
    >>> add_observer(Tokens())  # doctest: +SKIP
    """

    def request_submitted(self, stats: RequestStats) -> None:
        """Queued (in the thread that called :meth:`Scheduler.submit`)."""

    def request_admitted(self, stats: RequestStats) -> None:
        """Left the queue; its prefill (its first chunk) runs next."""

    def request_advanced(self, stats: RequestStats, tokens: int,
                         interval: Optional[float]) -> None:
        """A step gave it ``tokens`` tokens (one per prompt that advanced); ``interval`` is
        the time since its previous such step, None for its first."""

    def request_ended(self, stats: RequestStats) -> None:
        """Left the scheduler; ``stats.outcome`` says how."""

    def batch_changed(self, state: BatchState) -> None:
        """The load after a step, a submission or requests leaving the queue."""


#: Observers of every scheduler without observers of its own (see :func:`add_observer`).
_OBSERVERS: List[SchedulerObserver] = []
_OBSERVERS_LOCK = threading.Lock()


def add_observer(observer: SchedulerObserver) -> None:
    """Have ``observer`` told about every scheduler in the process (added once however
    often this is called)."""
    with _OBSERVERS_LOCK:
        if not any(o is observer for o in _OBSERVERS):
            _OBSERVERS.append(observer)


def remove_observer(observer: SchedulerObserver) -> None:
    with _OBSERVERS_LOCK:
        _OBSERVERS[:] = [o for o in _OBSERVERS if o is not observer]


class _Job:
    """One submitted request: its sequences and the queue its stream reads from."""

    __slots__ = ("job_id", "sequences", "outbox", "cancelled", "done", "stats")

    def __init__(self, job_id: int, sequences: List[GenerationSequence]):
        self.job_id = job_id
        self.sequences = sequences
        self.outbox: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self.cancelled = False
        self.done = False
        self.stats = RequestStats(
            request_id=job_id, prompts=len(sequences),
            prompt_tokens=sum(len(seq.prompt_ids) for seq in sequences),
            submitted_at=time.perf_counter())

    def finish(self, error: Optional[BaseException] = None) -> None:
        if not self.done:
            self.done = True
            self.outbox.put(error if error is not None else _END)


class _Prefill:
    """Requests being prefilled together, and their batch (built at its first chunk).
    ``burst``: admitted as a burst (:data:`BURST_RATIO`), read with the idle budget."""

    __slots__ = ("jobs", "batch", "burst")

    def __init__(self, jobs: List[_Job], burst: bool = False):
        self.jobs = jobs
        self.batch: Optional[CausalLMBatch] = None
        self.burst = burst

    @property
    def rows(self) -> int:
        return sum(len(job.sequences) for job in self.jobs)


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
    ``max_batch_prefill_tokens`` caps the tokens (rows × columns) one prefill forward pass
    feeds (``option.max_batch_prefill_tokens``); ``None`` picks one for the device (see
    :func:`default_max_batch_prefill_tokens`). It is at least ``max_batch_size``, which a
    decode step feeds anyway, so that a chunk can hold one column of every row. A chunk
    deep into a long prompt feeds fewer columns, so that it costs what the budget costs at
    the prompt's start (:func:`prefill_columns`). ``max_idle_prefill_tokens`` is the budget
    while no request is decoding (by default :data:`IDLE_PREFILL_FACTOR` times the other).
    ``prefill_stall_steps`` bounds a pass while requests decode by time as well: at most
    that many of their decode steps, as measured (``option.prefill_stall_steps``; 0 turns
    the bound off; see :mod:`djl_stream.generation.prefill_pacing`). ``pacer`` replaces the
    :class:`~djl_stream.generation.prefill_pacing.PrefillPacer` built from it (another
    clock, another policy).
    ``max_input_length`` is the longest prompt a request may send
    (``option.max_input_length``).
    ``observers`` are told what happens (see :class:`SchedulerObserver`); by default, the
    process-wide ones of :func:`add_observer`. ``model_name`` names the served model in what
    they are told (metrics label their figures with it).
    """

    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        max_queue: int = DEFAULT_MAX_QUEUE,
        max_batch_prefill_tokens: Optional[int] = None,
        max_idle_prefill_tokens: Optional[int] = None,
        max_input_length: int = DEFAULT_MAX_INPUT_LENGTH,
        prefill_stall_steps: Optional[float] = DEFAULT_PREFILL_STALL_STEPS,
        pacer: Optional[PrefillPacer] = None,
        observers: Optional[Sequence[SchedulerObserver]] = None,
        model_name: str = "",
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        device = runner.device
        if max_batch_prefill_tokens is None:
            max_batch_prefill_tokens = max(default_max_batch_prefill_tokens(device),
                                           max_batch_size)
        if max_batch_prefill_tokens < max_batch_size:
            raise ValueError(
                f"max_batch_prefill_tokens ({max_batch_prefill_tokens}) must be at least "
                f"max_batch_size ({max_batch_size}): a prefill chunk feeds one column of "
                "every row of a request at the least")
        self.runner = runner
        self.device = device
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.max_input_length = max_input_length
        self.max_batch_prefill_tokens = max_batch_prefill_tokens
        self.max_idle_prefill_tokens = max(
            max_batch_prefill_tokens,
            IDLE_PREFILL_FACTOR * max_batch_prefill_tokens if max_idle_prefill_tokens is None
            else max_idle_prefill_tokens)
        self._pacer = pacer or PrefillPacer(prefill_stall_steps, attention_parity_context(runner.model),
                                            synchronize=_synchronizer(device))
        self._ids = itertools.count()
        self._waiting: Deque[_Job] = collections.deque()
        # Admitted requests whose prefill has not finished, in order; one at a time is
        # read, a chunk per cycle (several only after a shared prefill failed and each of
        # its requests is retried on its own).
        self._prefilling: Deque[_Prefill] = collections.deque()
        self._jobs: Dict[int, _Job] = {}
        self._wakeup = threading.Condition()
        self._running: Optional[CausalLMBatch] = None
        # A prefill that finished while a batch was running: it joins at the start of
        # the next cycle, which then reads no prefill chunk (see _prefill_step).
        self._joining: Optional[CausalLMBatch] = None
        self._stopping = False
        # A queued request was cancelled: the next cycle takes it out of the queue,
        # wherever it waits, so that it never reaches a prefill.
        self._queue_has_cancelled = False
        self._observers = _OBSERVERS if observers is None else list(observers)
        self.model_name = model_name
        self._state = BatchState(model=model_name)
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
        if self in _LIVE_SCHEDULERS:
            _LIVE_SCHEDULERS.remove(self)

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
                waiting = len(self._waiting)
                raise QueueFullError(
                    f"{waiting} request{'s are' if waiting != 1 else ' is'} already waiting; "
                    f"the queue holds {self.max_queue} (job_queue_size)"
                )
            job = _Job(next(self._ids), list(sequences))
            job.stats.model = self.model_name
            for index, seq in enumerate(job.sequences):
                seq.request_id = (job.job_id, index)
            # In the caller's thread, before the loop can see the job: an observer may
            # tie the request to the caller's context, and hears of it before anything else.
            self._notify("request_submitted", job.stats)
            self._jobs[job.job_id] = job
            self._waiting.append(job)
            self._publish(self._state.running_rows, self._state.kv_cache_tokens)
            self._wakeup.notify()
        return GenerationStream(self, job)

    def cancel(self, job: _Job) -> None:
        with self._wakeup:
            job.cancelled = True
            if job.stats.admitted_at is None:
                self._queue_has_cancelled = True
            self._wakeup.notify()

    @property
    def running_size(self) -> int:
        """Rows decoding, counting a finished prefill about to join them."""
        return sum(len(batch) for batch in (self._running, self._joining) if batch is not None)

    @property
    def waiting_size(self) -> int:
        return len(self._waiting)

    @property
    def prefilling_size(self) -> int:
        """Rows admitted whose prefill has not finished yet."""
        return sum(prefill.rows for prefill in list(self._prefilling))

    # -- the loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._wait_for_work()
                if self._stopping:
                    break
                self._drop_cancelled_prefills()
                stepped = False  # whether a mixed pass took the running batch's step
                if self._joining is not None:
                    self._join()
                elif self._prefilling:
                    stepped = self._prefill_step()
                self._drop_cancelled()
                if self._running is not None and not stepped:
                    self._decode()
                self._publish_running()
                if self._running is None and not self._busy():
                    # The batch just emptied (the loop only gets here with work done).
                    release_cached_memory()
            except Exception as error:  # noqa: BLE001 - the loop must outlive any bug
                # Whatever went wrong, no request may wait forever: fail every request
                # admitted (those in a batch, and any caught between two, a prefill
                # that was joining the running batch say) and start again empty.
                self._running = self._joining = None
                self._prefilling.clear()
                self._reclaim()
                with self._wakeup:
                    queued = {id(job) for job in self._waiting}
                    admitted = [job for job in self._jobs.values() if id(job) not in queued]
                self._fail(admitted, error)
                self._publish_running()
        self._running = self._joining = None
        self._prefilling.clear()
        with self._wakeup:
            failure = GenerationFailed("the server is shutting down")
            for job in list(self._jobs.values()):
                self._end(job, FAILED, failure)
            self._jobs.clear()
            self._waiting.clear()
            self._publish(0, 0)

    def _wait_for_work(self) -> None:
        """Block until there is something to do; admit waiting requests when no prefill
        is under way."""
        with self._wakeup:
            while True:
                self._drop_cancelled_waiting()
                if self._running is not None or self._busy() or self._stopping:
                    break
                # Idle: the last word observers hear must be this state, not a busy one.
                self._publish(0, 0)
                self._wakeup.wait()
            if self._prefilling or not self._waiting:
                return  # a request is admitted when its prefill can start at once
            burst = self._is_burst()
            burst_tokens = BURST_PASSES * self.max_idle_prefill_tokens
            admitted, tokens = self._admit(self.max_batch_size - self.running_size,
                                           burst_tokens if burst
                                           else self.max_batch_prefill_tokens)
            if admitted:
                # a long prompt at the head of a burst is paced as any other (see
                # BURST_PASSES): the running streams would wait for pass after pass
                self._prefilling.append(_Prefill(admitted, burst and tokens <= burst_tokens))

    def _is_burst(self) -> bool:
        """Under ``self._wakeup``: whether the waiting requests are read as if nothing were
        decoding: nothing is, or they have :data:`BURST_RATIO` times the running rows."""
        running = self.running_size
        return running == 0 or (sum(len(job.sequences) for job in self._waiting)
                                >= BURST_RATIO * running)

    def _drop_cancelled_waiting(self) -> None:
        """Under ``self._wakeup``: end the queued requests whose streams were closed."""
        if not self._queue_has_cancelled:
            return
        self._queue_has_cancelled = False
        for job in [job for job in self._waiting if job.cancelled]:
            self._waiting.remove(job)
            self._end(job, CANCELLED)

    def _admit(self, room: int, budget: int) -> Tuple[List[_Job], int]:
        """Take the requests to prefill together off the queue (under ``self._wakeup``),
        and the tokens of one pass reading all their prompts (rows × the longest).

        Arrival order, no overtaking: a big request at the head waits for room rather
        than being starved by small ones behind it. The head is taken however long its
        prompts (it is prefilled in chunks); requests behind it join it while all of
        them fit in one forward pass of ``budget`` tokens (rows × the longest prompt).
        """
        admitted: List[_Job] = []
        rows = longest = 0
        now = time.perf_counter()
        while self._waiting and len(self._waiting[0].sequences) <= room:
            job = self._waiting[0]
            if job.cancelled:
                self._end(self._waiting.popleft(), CANCELLED)
                continue
            job_longest = max(longest, max(len(seq.prompt_ids) for seq in job.sequences))
            job_rows = rows + len(job.sequences)
            if admitted and job_rows * job_longest > budget:
                break
            self._waiting.popleft()
            rows, longest = job_rows, job_longest
            room -= len(job.sequences)
            job.stats.admitted_at = now
            self._notify("request_admitted", job.stats)
            admitted.append(job)
        return admitted, rows * longest

    def _prefill_step(self) -> bool:
        """One forward pass of the prefill under way: a chunk of its prompts, or the rest
        of them, which chooses the first tokens and joins the running batch. Where the
        model's Llama step can, the pass also takes the running batch's decode step (a
        mixed pass, :meth:`_mixed_step`); returns whether it did."""
        prefill = self._prefilling[0]
        try:
            if prefill.batch is None:
                sequences = [seq for job in prefill.jobs for seq in job.sequences]
                prefill.batch = CausalLMBatch.from_sequences(self.runner, sequences)
                handles = iter(prefill.batch.handles)
                for job in prefill.jobs:  # (what each cache started with, not read again)
                    job.stats.reused_prompt_tokens = sum(
                        self.runner.length(next(handles)) for _ in job.sequences)
            batch = prefill.batch
        except Exception as error:  # noqa: BLE001 - a prompt the model cannot take
            self._prefill_failed(error)
            return False
        if self._running is not None:
            self._drop_cancelled_running()  # they would take this step too
        # (none may be left: every running request was cancelled)
        # A running batch that outgrew the last step timed alone takes its next step alone
        # (after this prefill pass), so that passes are sized by what a step costs now.
        if (self._running is not None and self.runner.mixes_passes
                and not self._pacer.step_outdated(len(self._running))
                and self._mixed_step(prefill)):
            return True
        try:
            # With nothing decoding, nobody waits between tokens: a long prompt alone is
            # read in fewer, wider passes (its time to first token is shorter).
            rows, cached = len(batch), batch.cache_length
            width = self._columns(prefill, rows, cached)
            # A pass of this prefill alone stops part-way once all of its requests were
            # cancelled: a client that leaves during a long prompt's pass frees the model
            # at the next layer, not at the end of the pass.
            with self.runner.abandoned_if(lambda: all(job.cancelled for job in prefill.jobs)):
                if batch.columns_to_feed > width:
                    with self._pacer.prefill_pass(rows, width, cached):
                        prefill.batch = prefill_chunk(self.runner, batch, width)
                    return False
                with self._pacer.prefill_pass(rows, batch.columns_to_feed, cached):
                    generations, batch = generate_token(self.runner, batch)
        except PassAbandoned:
            return False  # (the cycle's _drop_cancelled takes the prefill out)
        except Exception as error:  # noqa: BLE001 - find who caused it, keep serving
            self._prefill_failed(error)
            return False
        self._prefilled(generations, batch)
        return False

    def _mixed_step(self, prefill: "_Prefill") -> bool:
        """The running batch's decode step and the next chunk of ``prefill`` in one forward
        pass (:func:`~djl_stream.generation.batch.mixed_pass`): the weights are read once
        for both, so a chunk costs the running streams what its own columns cost, not a
        whole pass. The chunk may add ``prefill_stall_steps`` of their steps to the step
        (the wait between two of their tokens stays what it is with separate passes), and
        a short prompt is read in one pass instead of two or three. A mixed pass that
        raises grows no cache, and ``False`` comes back: this cycle then runs the prefill
        pass and the decode step apart, each finding its own culprit."""
        running, batch = self._running, prefill.batch
        rows, cached = len(batch), batch.cache_length
        width = min(batch.columns_to_feed,
                    self._columns(prefill, rows, cached, beside_step=True))
        last_chunk = width == batch.columns_to_feed
        try:
            with self._pacer.mixed_pass(rows, width, cached):
                generations, self._running, first_tokens, rest = mixed_pass(
                    self.runner, running, batch, width)
        except Exception as error:  # noqa: BLE001 - run them apart: each finds its culprit
            logger.warning("a mixed pass failed (%s: %s); running the prefill and the decode "
                           "step apart", type(error).__name__, error)
            return False
        self._dispatch(generations)
        if last_chunk:
            self._prefilled(first_tokens, rest, stepped=True)
        else:
            prefill.batch = rest
        return True

    def _columns(self, prefill: "_Prefill", rows: int, cached: int, *,
                 beside_step: bool = False) -> int:
        """Columns of ``prefill``'s next pass (``rows`` rows after ``cached`` columns): the
        idle budget's with nothing decoding or for a burst, else the budget's within the
        stall bound (``beside_step``: in a mixed pass, see :meth:`PrefillPacer.columns`),
        told the prompts' length (a short prompt's passes may stretch)."""
        if prefill.burst or self._running is None:
            return prefill_columns(self.max_idle_prefill_tokens, rows, cached,
                                   self._pacer.parity_context)
        return self._pacer.columns(self.max_batch_prefill_tokens, rows, cached,
                                   beside_step=beside_step,
                                   prompt_length=cached + prefill.batch.columns_to_feed)

    def _prefill_failed(self, error: Exception) -> None:
        prefill = self._prefilling.popleft()
        if prefill.batch is not None:
            prefill.batch.release()  # (a retry starts again from its prompts)
        if len(prefill.jobs) == 1:
            self._fail(prefill.jobs, error)
            return
        # One of them may have caused it (a prompt the model cannot take): prefill
        # each on its own, next, so that only the one that fails again fails.
        logger.warning("prefill of %d requests failed (%s: %s); retrying each alone",
                       len(prefill.jobs), type(error).__name__, error)
        self._prefilling.extendleft(reversed([_Prefill([job], prefill.burst)
                                              for job in prefill.jobs]))

    def _prefilled(self, generations: List[Generation], batch: Optional[CausalLMBatch],
                   stepped: bool = False) -> None:
        """The prefill under way chose its first tokens: send them, and have its batch
        join the running one: now, or at the next cycle when it is longer and the running
        batch's step is still to come this cycle (not ``stepped`` in the same pass)."""
        self._prefilling.popleft()
        self._dispatch(generations)
        if batch is None:
            return
        if self._running is None:
            self._running = batch
        elif stepped or batch.cache_length <= self._running.cache_length:
            # No longer than the running rows: the joined step reads no more columns per
            # row than theirs, and waiting a cycle would cost each short prompt a step
            # (16 clients arriving together were admitted one per three steps). After a
            # mixed pass the running batch has had this cycle's step: the joined batch's
            # first is the next cycle's, whatever its length.
            self._running = CausalLMBatch.concatenate([self._running, batch])
        else:
            # Not now: this cycle's decode step would then follow this prefill pass with
            # the joined batch, heavier than the running one (its rows attend to the new
            # prompt's columns), and a running stream would wait for both at once.
            self._joining = batch

    def _join(self) -> None:
        # (the running batch may have finished meanwhile: concatenate skips a None)
        self._running = CausalLMBatch.concatenate([self._running, self._joining])
        self._joining = None

    def _busy(self) -> bool:
        """Whether anything besides the running batch is under way or waiting."""
        return bool(self._waiting or self._prefilling or self._joining is not None)

    def _decode(self) -> None:
        batch = self._running
        try:
            with self._pacer.decode_step(len(batch)):
                generations, self._running = generate_token(self.runner, batch)
        except Exception as error:  # noqa: BLE001 - find who caused it, keep serving
            self._running = None
            self._decode_apart(batch, error)
            return
        self._dispatch(generations)

    def _decode_apart(self, batch: CausalLMBatch, error: Exception) -> None:
        """A decode step of several requests raised: run each request's rows as a batch of
        its own, so that the one that caused it (if one did) fails alone and the others
        go on, in one batch again. (The failed pass grew no cache.) Only when every
        request fails on its own do they all fail, as before.
        """
        jobs = self._jobs_of(batch.sequences)
        if len(jobs) <= 1:
            batch.release()
            self._fail(jobs, error)
            return
        logger.warning("a decode step of %d requests failed (%s: %s); retrying each alone",
                       len(jobs), type(error).__name__, error)
        survivors: List[CausalLMBatch] = []
        generations: List[Generation] = []
        for job, part in zip(jobs, batch.split([[seq.request_id for seq in job.sequences]
                                                for job in jobs])):
            try:
                part_generations, part = generate_token(self.runner, part)
            except Exception as part_error:  # noqa: BLE001 - this one fails alone
                part.release()
                self._fail([job], part_error)
                continue
            generations.extend(part_generations)
            if part is not None:
                survivors.append(part)
        self._running = CausalLMBatch.concatenate(survivors) if survivors else None
        self._dispatch(generations)

    def _drop_cancelled(self) -> None:
        self._drop_cancelled_prefills()
        self._drop_cancelled_running()

    def _drop_cancelled_running(self) -> None:
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
                    self._end(self._jobs[job_id], CANCELLED)

    def _drop_cancelled_prefills(self) -> None:
        """Cancelled requests (and failed ones) leave their prefill, and with them the KV
        cache it has built; a prefill left with no request ends."""
        for prefill in list(self._prefilling):
            gone = [job for job in prefill.jobs
                    if job.cancelled or job.job_id not in self._jobs]
            if not gone:
                continue
            prefill.jobs = [job for job in prefill.jobs if job not in gone]
            if not prefill.jobs:
                self._prefilling.remove(prefill)
                if prefill.batch is not None:
                    prefill.batch.release()
            elif prefill.batch is not None:
                prefill.batch = prefill.batch.filter(
                    [seq.request_id for job in prefill.jobs for seq in job.sequences])
            logger.info("dropped %d cancelled request(s) from a prefill", len(gone))
            with self._wakeup:
                for job in gone:
                    self._end(job, CANCELLED)

    def _dispatch(self, generations: List[Generation]) -> None:
        """Send each job the list of its prompts' new text for this step."""
        now = time.perf_counter()
        by_job: Dict[int, List[Generation]] = {}
        for generation in generations:
            by_job.setdefault(generation.request_id[0], []).append(generation)
        for job_id, job_generations in by_job.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue  # it failed earlier; its rows leave at the next _drop_cancelled
            errors = [g.error for g in job_generations if g.error is not None]
            if errors:
                # Its own parameters broke its row: this request ends, the batch goes on
                # (its other rows leave the batch with it, at the next _drop_cancelled).
                logger.warning("request %d failed alone: %s", job_id, errors[0])
                with self._wakeup:
                    self._end(job, FAILED, GenerationFailed(errors[0]))
                continue
            self._advance(job.stats, len(job_generations), now)
            per_prompt: List[Optional[Generation]] = [None] * len(job.sequences)
            for generation in job_generations:
                per_prompt[generation.request_id[1]] = generation
            job.outbox.put(Step.of(per_prompt))
            if all(seq.finished for seq in job.sequences):
                with self._wakeup:
                    self._end(job, FINISHED)

    def _advance(self, stats: RequestStats, tokens: int, now: float) -> None:
        # Before the step reaches the stream: whoever reads the token sees it counted.
        interval = None if stats.last_token_at is None else now - stats.last_token_at
        if stats.first_token_at is None:
            stats.first_token_at = now
        stats.last_token_at = now
        stats.generated_tokens += tokens
        stats.steps += 1
        self._notify("request_advanced", stats, tokens, interval)

    def _fail(self, jobs: List[_Job], error: Exception) -> None:
        logger.exception("generation step failed for %d request(s)", len(jobs), exc_info=error)
        failure = GenerationFailed(f"{type(error).__name__}: {error}")
        with self._wakeup:
            for job in jobs:
                self._end(job, FAILED, failure)

    def _jobs_of(self, sequences: List[GenerationSequence]) -> List[_Job]:
        ids = dict.fromkeys(seq.request_id[0] for seq in sequences)
        return [self._jobs[job_id] for job_id in ids if job_id in self._jobs]

    def _end(self, job: _Job, outcome: str, error: Optional[BaseException] = None) -> None:
        """The job leaves the scheduler: observers hear it before its stream ends, so that
        a caller who saw the stream end finds the request's figures complete."""
        if job.stats.outcome is None:
            job.stats.outcome = outcome
            job.stats.ended_at = time.perf_counter()
            job.stats.finish_reasons = tuple(
                seq.finish_reason or ("error" if seq.error or outcome == FAILED else "cancelled")
                for seq in job.sequences)
            self._notify("request_ended", job.stats)
        job.finish(error)
        self._jobs.pop(job.job_id, None)

    # -- observers ----------------------------------------------------------------------

    def _publish_running(self) -> None:
        """Tell observers the load after a step (in the loop thread, which owns the batch)."""
        decoding = [b for b in (self._running, self._joining) if b is not None]
        prefilling = [prefill.batch for prefill in self._prefilling if prefill.batch is not None]
        rows = sum(len(batch) for batch in decoding)
        kv_tokens = sum(batch.cached_tokens for batch in decoding + prefilling)
        with self._wakeup:
            self._publish(rows, kv_tokens)

    def _reclaim(self) -> None:
        """Free the caches of every sequence no batch holds any more (after a failure
        dropped batches whole)."""
        live = {h for batch in [self._running, self._joining]
                + [prefill.batch for prefill in self._prefilling]
                if batch is not None for h in batch.handles}
        self.runner.release_all_but(live)

    def _publish(self, rows: int, kv_tokens: int) -> None:
        # Under self._wakeup, so that states reach observers in the order they happened.
        self._state = BatchState(rows, len(self._waiting), kv_tokens, self.model_name)
        self._notify("batch_changed", self._state)

    def _notify(self, event: str, *args) -> None:
        for observer in list(self._observers):
            try:
                getattr(observer, event)(*args)
            except Exception:  # noqa: BLE001 - watching must never break serving
                logger.exception("scheduler observer %r failed on %s", observer, event)


def default_max_batch_prefill_tokens(device) -> int:
    """The prefill budget for ``device`` when none is set: small on a CPU, where prefill is
    compute-bound and a long chunk would stall the running batch, larger on an accelerator.

    >>> default_max_batch_prefill_tokens("cpu") < default_max_batch_prefill_tokens("cuda:0")
    True
    """
    import torch

    kind = torch.device(device).type
    return DEFAULT_MAX_BATCH_PREFILL_TOKENS.get(kind, DEFAULT_ACCELERATOR_PREFILL_TOKENS)


def _synchronizer(device):
    """What a prefill pass's timing waits for on ``device``: CUDA kernels run after the
    call that launched them returns; on a CPU the call returns when the work is done."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


#: Every scheduler started. A scheduler lives as long as the process, like the model its
#: running thread holds, so plain (strong) containers are the honest ones.
_LIVE_SCHEDULERS: List[Scheduler] = []


@atexit.register
def _shutdown_all() -> None:
    for scheduler in list(_LIVE_SCHEDULERS):
        scheduler.shutdown()
