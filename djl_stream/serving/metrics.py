"""Serving metrics: Prometheus at ``GET /metrics``, DJL ``[METRICS]`` lines in djl-serving.

Every figure about generation comes from the model's scheduler
(:class:`~djl_stream.generation.scheduler.SchedulerObserver`), on one clock, so it means the
same under ``djl-stream serve`` and inside djl-serving:

- **queue time**: submitted to the scheduler → admitted to the running batch (its prefill
  starts);
- **time to first token**: submitted → its first token chosen: queue time plus prefill. It
  leaves out what comes before the scheduler (reading the body, validation, tokenizing: a
  few milliseconds) and after it (detokenizing, formatting, the network), and it is the
  same for streaming and non-streaming requests; the access log's ``first_chunk`` is the
  HTTP view (request received → first body byte sent);
- **inter-token latency**: between consecutive decode steps that gave one request tokens
  (a request with several prompts advances all of them in one step);
- **end-to-end time**: submitted → its last token, for requests that finished (eos,
  ``max_new_tokens`` or a stop string); cancelled and failed ones are counted apart;
- **KV-cache tokens**: the positions the KV cache holds, over every running row and every
  prompt part-way through its prefill.

The figures are per process, like the scheduler: two apps in one process show the same
numbers, from one registry of our own (never prometheus_client's global one, so repeated
app creation registers nothing twice). The start-up warm-up generation counts too.

``djl-stream serve`` also counts HTTP requests by route and status, and its access-log line
carries the request's figures (:class:`RequestRecord`). Inside djl-serving the handler
cannot add a route; there :class:`DjlMetricLines` prints each request's figures as
``[METRICS]`` lines on the worker's stdout, which djl-serving's ``PyProcess`` parses with
DJL's ``Metric.parse`` into its ``model_metric`` log (and, with ``SERVING_PROMETHEUS=true``,
into its own ``/server/metrics``).

Example::

    $ curl -s localhost:8080/metrics | grep '^djl_stream_generation_tokens_total'
    djl_stream_generation_tokens_total 48.0
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import re
import sys
import threading
from typing import Callable, Iterator, List, Optional, Tuple

from djl_stream.generation.scheduler import (CANCELLED, FAILED, FINISHED, BatchState,
                                             RequestStats, SchedulerObserver, add_observer)

logger = logging.getLogger(__name__)

# Buckets, in seconds. vLLM's (TTFT 1 ms-2560 s, per-token 10 ms-80 s, request 0.3 s-7680 s)
# and TGI's (one geometric 0.15 ms-1.9 ks series for every duration) are made for large
# models on GPUs; here steps of a small model take a few milliseconds on a GPU and tens on
# a CPU, so the fine end starts lower, and the coarse end stops a little beyond
# djl-serving's 120 s timeouts (predict_timeout, chunked_read_timeout).
#: Queue time: usually under one decode step, minutes only when the batch is full.
QUEUE_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                      5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Time to first token: queue time plus one prefill.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
#: Inter-token latency: one decode step of the whole batch.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
#: End-to-end time: up to a few thousand tokens.
E2E_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
               45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0)


# -- one HTTP request's figures ---------------------------------------------------------

@dataclasses.dataclass
class RequestRecord:
    """The generations one HTTP request started, for its access-log line.

    The scheduler updates each :class:`RequestStats` in place; by the time a response has
    ended, a request that finished has all its figures.

    >>> from djl_stream.generation.scheduler import RequestStats
    >>> record = RequestRecord([RequestStats(request_id=0, prompts=1, prompt_tokens=5,
    ...     submitted_at=1.0, admitted_at=1.001, first_token_at=1.03, last_token_at=1.09,
    ...     ended_at=1.09, generated_tokens=4, steps=4, outcome="finished")])
    >>> " ".join(record.log_fields())
    'queue=0.0010s ttft=0.0300s itl=0.0200s e2e=0.0900s prompt_tokens=5 generated_tokens=4'
    """

    generations: List[RequestStats] = dataclasses.field(default_factory=list)

    def log_fields(self) -> List[str]:
        if not self.generations:
            return []
        first = self.generations[0]
        fields = [f"{name}={value:.4f}s" for name, value in (
            ("queue", first.queue_time), ("ttft", first.time_to_first_token),
            ("itl", first.mean_inter_token_latency),
            ("e2e", first.e2e_latency if first.outcome == FINISHED else None))
            if value is not None]
        fields.append(f"prompt_tokens={sum(g.prompt_tokens for g in self.generations)}")
        reused = sum(g.reused_prompt_tokens for g in self.generations)
        if reused:
            fields.append(f"reused_prompt_tokens={reused}")
        fields.append(f"generated_tokens={sum(g.generated_tokens for g in self.generations)}")
        fields += [f"generation={g.outcome}" for g in self.generations
                   if g.outcome in (CANCELLED, FAILED)]
        return fields


_CURRENT_RECORD: contextvars.ContextVar[Optional[RequestRecord]] = contextvars.ContextVar(
    "djl_stream_request_record", default=None)


@contextlib.contextmanager
def record_request() -> Iterator[RequestRecord]:
    """Collect the generations submitted in this context (and the threads it hands work
    to with its context, as anyio's ``to_thread`` does) into a :class:`RequestRecord`.

    >>> with record_request() as record:
    ...     pass  # handle the request
    >>> record.generations
    []
    """
    record = RequestRecord()
    token = _CURRENT_RECORD.set(record)
    try:
        yield record
    finally:
        _CURRENT_RECORD.reset(token)


#: How a sequence leaves the scheduler (``djl_stream_requests_finished_total``'s label).
FINISH_REASONS = ("eos", "length", "stop", "cancelled", "error")


# -- Prometheus -------------------------------------------------------------------------

class PrometheusMetrics(SchedulerObserver):
    """The metrics in a registry of their own, fed by the schedulers and the server.

    >>> metrics = PrometheusMetrics()
    >>> metrics.http_request("/ping", 200)
    >>> body, content_type = metrics.exposition()
    >>> b'djl_stream_http_requests_total{route="/ping",status="200"} 1.0' in body
    True
    """

    def __init__(self, *, process_metrics: bool = True) -> None:
        # Imported here: model.py's import chain reaches this module, and the djl-serving
        # container need not have the [serve] extra.
        from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                                       PlatformCollector, ProcessCollector)

        self.registry = registry = CollectorRegistry(auto_describe=True)
        if process_metrics:
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)

        self.http_requests = Counter(
            "djl_stream_http_requests", "HTTP requests answered, by route (the route's "
            "template, or 'unmatched') and status code; a streamed answer counts once it ends.",
            ["route", "status"], registry=registry)
        self.prompt_tokens = Counter(
            "djl_stream_prompt_tokens", "Prompt tokens of the requests admitted to the "
            "running batch, those whose keys and values were reused included "
            "(djl_stream_prompt_tokens_reused).", ["model"], registry=registry)
        self.reused_prompt_tokens = Counter(
            "djl_stream_prompt_tokens_reused", "Prompt tokens not prefilled: their keys and "
            "values were reused from a running or finished request whose prompt began the "
            "same way (counted when a request ends).", ["model"], registry=registry)
        self.generation_tokens = Counter(
            "djl_stream_generation_tokens", "Tokens generated: one per prompt per decode step "
            "that advanced it, end-of-sequence tokens included.", ["model"], registry=registry)
        self.cancelled = Counter(
            "djl_stream_requests_cancelled", "Requests whose generation stopped early because "
            "their stream was closed: the client left (the server closes the stream) or the "
            "caller closed it, while waiting or running.", ["model"], registry=registry)
        self.failed = Counter(
            "djl_stream_requests_failed", "Requests whose generation failed (the model raised "
            "in a step, or the scheduler shut down).", ["model"], registry=registry)
        self.finished = Counter(
            "djl_stream_requests_finished", "Sequences (a request's prompts, OpenAI's n "
            "choices) that left the scheduler, by why: eos, length, stop (a stop string), "
            "cancelled or error.", ["model", "finish_reason"], registry=registry)

        self.queue_time = Histogram(
            "djl_stream_request_queue_time_seconds", "Seconds a request waited in the "
            "scheduler's queue: submitted -> admitted to the running batch.",
            ["model"], buckets=QUEUE_TIME_BUCKETS, registry=registry)
        self.ttft = Histogram(
            "djl_stream_time_to_first_token_seconds", "Seconds from a request's submission to "
            "the scheduler to its first token: queue time plus prefill (excludes parsing and "
            "tokenizing before, detokenizing and sending after).",
            ["model"], buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(
            "djl_stream_inter_token_latency_seconds", "Seconds between consecutive decode "
            "steps that gave one request new tokens (one observation per step after its "
            "first).", ["model"], buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(
            "djl_stream_e2e_request_latency_seconds", "Seconds from a request's submission to "
            "the scheduler to its last token, for requests that finished (eos, "
            "max_new_tokens or a stop string).", ["model"], buckets=E2E_BUCKETS,
            registry=registry)

        self.batch_rows = Gauge(
            "djl_stream_batch_rows", "Rows (prompts) in the running batch.", ["model"],
            registry=registry)
        self.waiting = Gauge(
            "djl_stream_requests_waiting", "Requests queued for room in the running batch.",
            ["model"], registry=registry)
        self.kv_cache_tokens = Gauge(
            "djl_stream_kv_cache_tokens", "Token positions the KV cache holds, over every "
            "running row and prompt being read.", ["model"], registry=registry)
        self._models: set = set()

    # -- fed by the server --

    def http_request(self, route: str, status: int) -> None:
        self.http_requests.labels(route=route, status=str(status)).inc()

    def exposition(self, accept: Optional[str] = None) -> Tuple[bytes, str]:
        """The registry in the format ``accept`` asks for (Prometheus text by default,
        OpenMetrics when asked): the body and its content type."""
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type

    # -- fed by the scheduler --

    def _meet(self, model: str) -> None:
        """A model's series start at 0 the first time it is seen, as unlabelled ones
        would: a scraper sees a counter before it first moves (a rate needs two samples)."""
        if model in self._models:
            return
        self._models.add(model)
        for metric in (self.prompt_tokens, self.reused_prompt_tokens,
                       self.generation_tokens, self.cancelled,
                       self.failed, self.queue_time, self.ttft, self.itl, self.e2e,
                       self.batch_rows, self.waiting, self.kv_cache_tokens):
            metric.labels(model)
        for reason in FINISH_REASONS:
            self.finished.labels(model, reason)

    def request_submitted(self, stats: RequestStats) -> None:
        self._meet(stats.model)
        record = _CURRENT_RECORD.get()
        if record is not None:
            record.generations.append(stats)

    def request_admitted(self, stats: RequestStats) -> None:
        self.queue_time.labels(stats.model).observe(stats.queue_time)
        self.prompt_tokens.labels(stats.model).inc(stats.prompt_tokens)

    def request_advanced(self, stats: RequestStats, tokens: int,
                         interval: Optional[float]) -> None:
        self.generation_tokens.labels(stats.model).inc(tokens)
        if interval is None:
            self.ttft.labels(stats.model).observe(stats.time_to_first_token)
        else:
            self.itl.labels(stats.model).observe(interval)

    def request_ended(self, stats: RequestStats) -> None:
        self.reused_prompt_tokens.labels(stats.model).inc(stats.reused_prompt_tokens)
        if stats.outcome == FINISHED:
            self.e2e.labels(stats.model).observe(stats.e2e_latency)
        elif stats.outcome == CANCELLED:
            self.cancelled.labels(stats.model).inc()
        elif stats.outcome == FAILED:
            self.failed.labels(stats.model).inc()
        for reason in stats.finish_reasons:
            self.finished.labels(stats.model, reason).inc()

    def batch_changed(self, state: BatchState) -> None:
        self._meet(state.model)
        self.batch_rows.labels(state.model).set(state.running_rows)
        self.waiting.labels(state.model).set(state.waiting_requests)
        self.kv_cache_tokens.labels(state.model).set(state.kv_cache_tokens)


_SERVER_METRICS: Optional[PrometheusMetrics] = None
_SERVER_METRICS_LOCK = threading.Lock()


def server_metrics() -> PrometheusMetrics:
    """The process's :class:`PrometheusMetrics`, created (and told about every scheduler)
    on first use; every app in the process shares it."""
    global _SERVER_METRICS
    with _SERVER_METRICS_LOCK:
        if _SERVER_METRICS is None:
            _SERVER_METRICS = PrometheusMetrics()
            add_observer(_SERVER_METRICS)
        return _SERVER_METRICS


# -- djl-serving's [METRICS] lines ------------------------------------------------------

#: What djl-serving's PyProcess looks for in a worker's stdout line; the rest of the line
#: goes to DJL's ``Metric.parse``.
DJL_METRICS_MARKER = "[METRICS]"
#: Units DJL's ``Unit.fromValue`` knows that these lines use (there is no "Seconds").
MICROSECONDS, COUNT = "Microseconds", "Count"
#: DJL's metric types: counters add, gauges set, histograms observe.
DJL_COUNTER, DJL_GAUGE, DJL_HISTOGRAM = "c", "g", "h"


def djl_metric_line(name: str, value: float, unit: str, metric_type: str,
                    dimension: Tuple[str, str]) -> str:
    """One metric as djl-serving's worker reader wants it (whole numbers: DJL's pattern
    reads digits, ``-``, ``,``, ``.`` and ``e`` only, so never ``inf`` or ``1E-5``).

    >>> djl_metric_line("djl_stream_generation_tokens", 16, "Count", "c", ("Model", "tiny"))
    '[METRICS]djl_stream_generation_tokens.Count:16|#Model:tiny|c'
    """
    return (f"{DJL_METRICS_MARKER}{name}.{unit}:{int(round(value))}"
            f"|#{dimension[0]}:{dimension[1]}|{metric_type}")


def djl_dimension_value(text: str) -> str:
    """``text`` usable as a dimension value: DJL splits dimensions on ``,`` and ``:`` and
    ends them at ``|``.

    >>> djl_dimension_value("s3://bucket/llama,v2")
    's3_//bucket/llama_v2'
    """
    return re.sub(r"[^\w./-]", "_", text) or "model"


class DjlMetricLines(SchedulerObserver):
    """Each request's figures as DJL metric lines on stdout, for djl-serving's front end.

    Per request, when it ends: queue time, time to first token, mean inter-token latency
    (a histogram of per-request means, as TGI's ``tgi_request_mean_time_per_token_duration``:
    a line per token would flood the worker's stdout), end-to-end time (finished requests),
    in microseconds like djl-serving's own latencies, and its prompt and generated tokens and
    a cancelled or failed request as counts. The load (``djl_stream_batch_rows``,
    ``djl_stream_requests_waiting``, ``djl_stream_kv_cache_tokens``) as gauges, sampled
    every ``gauge_interval`` seconds by a thread of its own and printed when it changed
    (the way a scraper would see it: a step's state every few milliseconds would flood the
    worker's stdout); ``None`` samples only when :meth:`sample` is called. The dimension is
    ``Model:<model>``, like djl-serving's own model metrics.

    >>> lines = []
    >>> observer = DjlMetricLines("tiny", write=lines.append, gauge_interval=None)
    >>> observer.batch_changed(BatchState(running_rows=2, waiting_requests=0, kv_cache_tokens=40))
    >>> observer.sample()
    >>> lines[0]
    '[METRICS]djl_stream_batch_rows.Count:2|#Model:tiny|g'
    """

    def __init__(self, model: str, *, write: Optional[Callable[[str], None]] = None,
                 gauge_interval: Optional[float] = 1.0) -> None:
        self.dimension = ("Model", djl_dimension_value(model))
        self._write = write or _write_stdout_line
        self._state = BatchState()
        self._printed_state: Optional[BatchState] = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        if gauge_interval is not None:
            threading.Thread(target=self._sample_every, args=(gauge_interval,),
                             name="djl-stream-metric-lines", daemon=True).start()

    def _line(self, name: str, value: float, unit: str, metric_type: str) -> str:
        return djl_metric_line(name, value, unit, metric_type, self.dimension)

    def request_ended(self, stats: RequestStats) -> None:
        lines = []
        timings = (("djl_stream_request_queue_time_microseconds", stats.queue_time),
                   ("djl_stream_time_to_first_token_microseconds", stats.time_to_first_token),
                   ("djl_stream_mean_inter_token_latency_microseconds",
                    stats.mean_inter_token_latency),
                   ("djl_stream_e2e_request_latency_microseconds",
                    stats.e2e_latency if stats.outcome == FINISHED else None))
        for name, seconds in timings:
            if seconds is not None:
                lines.append(self._line(name, seconds * 1e6, MICROSECONDS, DJL_HISTOGRAM))
        if stats.admitted_at is not None:
            lines.append(self._line("djl_stream_prompt_tokens", stats.prompt_tokens, COUNT,
                                    DJL_COUNTER))
        if stats.reused_prompt_tokens:
            lines.append(self._line("djl_stream_prompt_tokens_reused",
                                    stats.reused_prompt_tokens, COUNT, DJL_COUNTER))
        if stats.generated_tokens:
            lines.append(self._line("djl_stream_generation_tokens", stats.generated_tokens,
                                    COUNT, DJL_COUNTER))
        if stats.outcome == CANCELLED:
            lines.append(self._line("djl_stream_requests_cancelled", 1, COUNT, DJL_COUNTER))
        elif stats.outcome == FAILED:
            lines.append(self._line("djl_stream_requests_failed", 1, COUNT, DJL_COUNTER))
        with self._lock:
            for line in lines:
                self._write(line)

    def batch_changed(self, state: BatchState) -> None:
        self._state = state  # under the scheduler's lock: no printing here

    def sample(self) -> None:
        """Print the load if it changed since it was last printed."""
        state = self._state
        with self._lock:
            if state == self._printed_state:
                return
            self._printed_state = state
            for name, value in (("djl_stream_batch_rows", state.running_rows),
                                ("djl_stream_requests_waiting", state.waiting_requests),
                                ("djl_stream_kv_cache_tokens", state.kv_cache_tokens)):
                self._write(self._line(name, value, COUNT, DJL_GAUGE))

    def stop(self) -> None:
        """End the background sampling."""
        self._stopped.set()

    def _sample_every(self, interval: float) -> None:
        while not self._stopped.wait(interval):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a closed stdout must not end the sampling
                logger.exception("printing the load as [METRICS] lines failed")


_STDOUT_LOCK = threading.Lock()


def _write_stdout_line(line: str) -> None:
    # One write per line: the front end reads the worker's stdout line by line, and other
    # threads log there too.
    with _STDOUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


_DJL_LINES: Optional[DjlMetricLines] = None


def start_djl_metric_lines(model: str) -> DjlMetricLines:
    """Print every scheduler's figures as ``[METRICS]`` lines from now on (once per
    process; a later call keeps the first observer)."""
    global _DJL_LINES
    with _SERVER_METRICS_LOCK:
        if _DJL_LINES is None:
            _DJL_LINES = DjlMetricLines(model)
            add_observer(_DJL_LINES)
        return _DJL_LINES
