"""Serving metrics: ``GET /metrics`` of a real server, the access-log figures, and the DJL
``[METRICS]`` lines djl-serving's front end parses.

The server test sends requests of known sizes and checks the scraped figures (parsed with
prometheus_client's own parser) against what the answers carried: requests by route and
status, tokens, histogram counts, and the load back at zero once idle. Nothing is timed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess

from djl_stream.generation.scheduler import (CANCELLED, FINISHED, BatchState, RequestStats)
from djl_stream.serving.metrics import (DjlMetricLines, PrometheusMetrics, RequestRecord,
                                        djl_metric_line, server_metrics, start_djl_metric_lines)

HISTOGRAMS = ("djl_stream_request_queue_time_seconds", "djl_stream_time_to_first_token_seconds",
              "djl_stream_inter_token_latency_seconds", "djl_stream_e2e_request_latency_seconds")
GAUGES = ("djl_stream_batch_rows", "djl_stream_requests_waiting", "djl_stream_kv_cache_tokens")


# -- reading an exposition ----------------------------------------------------------------

class Scrape:
    """One exposition, parsed by prometheus_client: every sample by name and labels."""

    def __init__(self, text: str):
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def __call__(self, name: str, **labels) -> float:
        """The sum of ``name``'s samples that carry ``labels`` (and any others, such as
        ``model``)."""
        wanted = {(k, str(v)) for k, v in labels.items()}
        return sum(value for (sample, have), value in self.samples.items()
                   if sample == name and wanted <= have)

    def buckets(self, histogram: str) -> list[tuple[float, float]]:
        summed: dict[float, float] = {}
        for (name, labels), value in self.samples.items():
            if name == histogram + "_bucket":
                le = float(dict(labels)["le"])
                summed[le] = summed.get(le, 0.0) + value
        return sorted(summed.items())

    def minus(self, before: "Scrape", name: str, **labels) -> float:
        return self(name, **labels) - before(name, **labels)


def assert_histograms_consistent(scrape: Scrape) -> None:
    for histogram in HISTOGRAMS:
        buckets = scrape.buckets(histogram)
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), histogram  # cumulative
        assert buckets[-1] == (float("inf"), scrape(histogram + "_count")), histogram


# -- djl-serving's parser, by its rules -----------------------------------------------------

#: DJL's Metric.parse (ai/djl/metric/Metric.java, the same in DJL 0.30 and 0.33); Java's
#: \w and \s are ASCII. Python reads atomic groups from 3.11; before, plain groups match
#: the same lines here (nothing after them could take back what they matched).
JAVA_PATTERN = r"\s*([\w\s]+)\.([\w\s]+):([0-9\-,.e]+)(?>\|#([^|]*))?(?>\|(\d+))?(?>\|([cgh]))?"
DJL_METRIC = re.compile(JAVA_PATTERN if sys.version_info >= (3, 11)
                        else JAVA_PATTERN.replace("(?>", "(?:"), re.ASCII)
#: ai.djl.metric.Unit values (Unit.fromValue throws for any other).
DJL_UNITS = {"Microseconds", "Milliseconds", "Bytes", "Kilobytes", "Megabytes", "Gigabytes",
             "Terabytes", "Bits", "Kilobits", "Megabits", "Gigabits", "Terabits", "Percent",
             "Count", "Bytes/Second", "Kilobytes/Second", "Megabytes/Second",
             "Gigabytes/Second", "Terabytes/Second", "Bits/Second", "Kilobits/Second",
             "Megabits/Second", "Gigabits/Second", "Terabits/Second", "Count/Second",
             "Count/Item", "None"}


def parse_djl_metric(stdout_line: str) -> dict:
    """What djl-serving makes of one worker stdout line: PyProcess.ReaderThread takes what
    follows "[METRICS]", Metric.parse reads it, and the Prometheus appender (with
    SERVING_PROMETHEUS=true) needs a known unit, a first dimension "name:value" and a
    Prometheus-legal name. Fails the test where any of them would fail."""
    at = stdout_line.index("[METRICS]")
    match = DJL_METRIC.fullmatch(stdout_line[at + len("[METRICS]"):])
    assert match, f"Metric.parse returns null for {stdout_line!r}"
    name, unit, value, dimensions, timestamp, kind = match.groups()
    assert unit in DJL_UNITS, unit
    float(value.replace(",", "x"))  # Double.valueOf: no thousands separators
    assert dimensions, "without dimensions DJL uses Host:<hostname>"
    pairs = [d.split(":") for d in dimensions.split(",")]
    assert all(len(p) == 2 for p in pairs), dimensions  # else a null Dimension
    assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name), name
    assert not name.endswith(("_total", "_created", "_bucket", "_info")), name
    return {"name": name, "unit": unit, "value": float(value), "dimensions": dict(pairs),
            "type": kind}


# -- the access-log record --------------------------------------------------------------------

def stats(**fields) -> RequestStats:
    base = dict(request_id=7, prompts=1, prompt_tokens=5, submitted_at=100.0)
    return RequestStats(**{**base, **fields})


def test_the_log_fields_are_the_schedulers_figures():
    finished = stats(admitted_at=100.002, first_token_at=100.05, last_token_at=100.35,
                     ended_at=100.35, generated_tokens=4, steps=4, outcome=FINISHED)
    assert RequestRecord([finished]).log_fields() == [
        "queue=0.0020s", "ttft=0.0500s", "itl=0.1000s", "e2e=0.3500s",
        "prompt_tokens=5", "generated_tokens=4"]
    cancelled = stats(admitted_at=100.0, first_token_at=100.1, last_token_at=100.1,
                      ended_at=100.2, generated_tokens=1, steps=1, outcome=CANCELLED)
    assert RequestRecord([cancelled]).log_fields() == [
        "queue=0.0000s", "ttft=0.1000s", "prompt_tokens=5", "generated_tokens=1",
        "generation=cancelled"]
    assert RequestRecord().log_fields() == []  # a request that generated nothing


# -- the Prometheus registry ----------------------------------------------------------------

def test_registries_are_independent_and_the_servers_is_shared():
    first, second = PrometheusMetrics(), PrometheusMetrics()  # no duplicate registration
    first.http_request("/invocations", 200)
    assert Scrape(first.exposition()[0].decode())("djl_stream_http_requests_total",
                                                  route="/invocations", status=200) == 1
    assert Scrape(second.exposition()[0].decode())("djl_stream_http_requests_total",
                                                   route="/invocations", status=200) == 0
    assert server_metrics() is server_metrics()


def test_creating_apps_again_registers_nothing_twice(tmp_path):
    from prometheus_client import REGISTRY

    from djl_stream.serving.server import create_app

    create_app(tmp_path)  # (the model loads only when an app starts)
    create_app(tmp_path)
    body, content_type = server_metrics().exposition()
    assert content_type.startswith("text/plain")
    names = [f.name for f in text_string_to_metric_families(body.decode())]
    assert len(names) == len(set(names))
    assert {"djl_stream_generation_tokens", *HISTOGRAMS, *GAUGES} <= set(names)
    # prometheus_client's global registry is left to whoever else runs in the process
    assert not any(name.startswith("djl_stream") for name in REGISTRY._names_to_collectors)


def test_the_scheduler_events_become_samples():
    metrics = PrometheusMetrics(process_metrics=False)
    request = stats()
    metrics.request_submitted(request)
    metrics.batch_changed(BatchState(running_rows=0, waiting_requests=1))
    request.admitted_at = 100.0078125  # (binary fractions: no rounding at a bucket edge)
    metrics.request_admitted(request)
    request.first_token_at = request.last_token_at = 100.1875
    metrics.request_advanced(request, 2, None)
    metrics.batch_changed(BatchState(running_rows=2, waiting_requests=0, kv_cache_tokens=14))
    metrics.request_advanced(request, 2, 0.04)
    metrics.request_advanced(request, 1, 0.05)
    request.outcome, request.ended_at = FINISHED, 100.3
    request.reused_prompt_tokens = 3
    metrics.request_ended(request)
    scrape = Scrape(metrics.exposition()[0].decode())
    assert scrape("djl_stream_kv_cache_tokens") == 14 and scrape("djl_stream_batch_rows") == 2
    assert scrape("djl_stream_prompt_tokens_total") == 5
    assert scrape("djl_stream_prompt_tokens_reused_total") == 3
    assert scrape("djl_stream_generation_tokens_total") == 5
    assert scrape("djl_stream_request_queue_time_seconds_count") == 1
    assert scrape("djl_stream_request_queue_time_seconds_bucket", le="0.01") == 1
    assert scrape("djl_stream_time_to_first_token_seconds_bucket", le="0.15") == 0
    assert scrape("djl_stream_time_to_first_token_seconds_bucket", le="0.2") == 1
    assert scrape("djl_stream_inter_token_latency_seconds_count") == 2
    assert scrape("djl_stream_inter_token_latency_seconds_bucket", le="0.04") == 1
    assert scrape("djl_stream_e2e_request_latency_seconds_sum") == pytest.approx(0.3)
    assert_histograms_consistent(scrape)
    for family in GAUGES + HISTOGRAMS + ("djl_stream_generation_tokens",):
        assert scrape.families[family].documentation  # HELP says what it means


# -- the DJL metric lines -----------------------------------------------------------------------

def test_a_requests_figures_as_djl_metric_lines():
    lines: list[str] = []
    observer = DjlMetricLines("tiny-model", write=lines.append, gauge_interval=None)
    observer.request_ended(stats(admitted_at=100.002, first_token_at=100.05,
                                 last_token_at=100.35, ended_at=100.35, generated_tokens=4,
                                 steps=4, outcome=FINISHED))
    assert lines == [
        "[METRICS]djl_stream_request_queue_time_microseconds.Microseconds:2000|#Model:tiny-model|h",
        "[METRICS]djl_stream_time_to_first_token_microseconds.Microseconds:50000|#Model:tiny-model|h",
        "[METRICS]djl_stream_mean_inter_token_latency_microseconds.Microseconds:100000|#Model:tiny-model|h",
        "[METRICS]djl_stream_e2e_request_latency_microseconds.Microseconds:350000|#Model:tiny-model|h",
        "[METRICS]djl_stream_prompt_tokens.Count:5|#Model:tiny-model|c",
        "[METRICS]djl_stream_generation_tokens.Count:4|#Model:tiny-model|c",
    ]
    parsed = [parse_djl_metric("INFO::" + line) for line in lines]  # as the worker logs it
    assert [p["value"] for p in parsed] == [2000, 50000, 100000, 350000, 5, 4]
    assert {p["dimensions"]["Model"] for p in parsed} == {"tiny-model"}


def test_a_cancelled_request_is_counted_and_has_no_e2e_line():
    lines: list[str] = []
    DjlMetricLines("m", write=lines.append, gauge_interval=None).request_ended(stats(ended_at=100.5, outcome=CANCELLED))
    assert lines == ["[METRICS]djl_stream_requests_cancelled.Count:1|#Model:m|c"]  # never admitted


def test_the_load_is_printed_when_sampled_and_changed():
    lines: list[str] = []
    observer = DjlMetricLines("m", write=lines.append, gauge_interval=None)
    observer.sample()  # idle from the start
    observer.batch_changed(BatchState(0, 1, 0))
    observer.batch_changed(BatchState(1, 0, 10))  # only the latest is sampled
    observer.sample()
    observer.sample()  # unchanged: nothing
    observer.batch_changed(BatchState(1, 0, 11))
    observer.batch_changed(BatchState())
    observer.sample()
    values = [(p["name"], p["value"], p["type"]) for p in map(parse_djl_metric, lines)]
    assert values == [
        ("djl_stream_batch_rows", 0, "g"), ("djl_stream_requests_waiting", 0, "g"),
        ("djl_stream_kv_cache_tokens", 0, "g"),
        ("djl_stream_batch_rows", 1, "g"), ("djl_stream_requests_waiting", 0, "g"),
        ("djl_stream_kv_cache_tokens", 10, "g"),
        ("djl_stream_batch_rows", 0, "g"), ("djl_stream_requests_waiting", 0, "g"),
        ("djl_stream_kv_cache_tokens", 0, "g"),
    ]


def test_the_load_is_sampled_in_the_background():
    lines: list[str] = []
    observer = DjlMetricLines("m", write=lines.append, gauge_interval=0.01)
    try:
        observer.batch_changed(BatchState(2, 0, 20))
        deadline = time.monotonic() + 30
        while "[METRICS]djl_stream_kv_cache_tokens.Count:20|#Model:m|g" not in lines:
            assert time.monotonic() < deadline, lines
            time.sleep(0.01)
    finally:
        observer.stop()


@pytest.mark.parametrize("model", ["model", "s3://bucket/llama,v2:1", "HuggingFaceTB/SmolLM2", "a|b c"])
def test_any_model_name_makes_a_dimension_djl_can_read(model):
    line = djl_metric_line("djl_stream_generation_tokens", 3, "Count", "c",
                           DjlMetricLines(model, gauge_interval=None).dimension)
    assert list(parse_djl_metric(line)["dimensions"]) == ["Model"]


def test_each_djl_metric_name_has_one_type():
    # the Prometheus appender registers a name once, as the type it first saw
    lines: list[str] = []
    observer = DjlMetricLines("m", write=lines.append, gauge_interval=None)
    observer.request_ended(stats(admitted_at=100.1, first_token_at=100.2, last_token_at=100.4,
                                 ended_at=100.4, generated_tokens=3, steps=3, outcome=FINISHED))
    observer.request_ended(stats(admitted_at=100.1, first_token_at=100.2, last_token_at=100.2,
                                 ended_at=100.3, generated_tokens=1, steps=1, outcome=CANCELLED))
    observer.request_ended(stats(admitted_at=100.1, ended_at=100.3, outcome="failed"))
    observer.batch_changed(BatchState(2, 1, 30))
    observer.sample()
    types = {(p["name"], p["type"]) for p in map(parse_djl_metric, lines)}
    assert len(types) == len({name for name, _ in types}) == 11


def test_djl_lines_start_once_per_process(monkeypatch):
    from djl_stream.serving import metrics

    added = []
    monkeypatch.setattr(metrics, "_DJL_LINES", None)
    monkeypatch.setattr(metrics, "add_observer", added.append)  # not this test process's stdout
    first = start_djl_metric_lines("a")
    try:
        assert start_djl_metric_lines("b") is first and added == [first]
        assert first.dimension == ("Model", "a")
    finally:
        first.stop()


# -- a real server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = ServerProcess(tiny_model_dir, client_timeout=120)
    try:
        yield server.wait_ready(timeout=120)
    finally:
        server.stop()


def scrape(server: ServerProcess) -> Scrape:
    response = server.http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return Scrape(response.text)


def scrape_when(server: ServerProcess, condition, timeout: float = 60.0) -> Scrape:
    """The first scrape for which ``condition`` holds: the access log counts a request once
    its response has gone out, and the load drops to zero a moment after the last token,
    so a scrape right after an answer may come too early (a deadline, not a speed test)."""
    deadline = time.monotonic() + timeout
    while True:
        current = scrape(server)
        if condition(current):
            return current
        assert time.monotonic() < deadline, {k: v for k, v in current.samples.items()
                                             if k[0].startswith("djl_stream")}
        time.sleep(0.05)


def idle(current: Scrape) -> bool:
    return all(current(gauge) == 0 for gauge in GAUGES)


def streamed(server, prompt, max_new_tokens):
    """The pieces of a streamed answer, one line per decode step."""
    pieces = []
    with server.http.stream("POST", "/invocations", json={
            "inputs": prompt, "stream": True,
            "parameters": {"max_new_tokens": max_new_tokens}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                pieces.append(json.loads(line)["output_tokens"][0])
    return pieces


def whole(server, prompt, max_new_tokens):
    response = server.http.post("/invocations", json={
        "inputs": prompt, "stream": False, "parameters": {"max_new_tokens": max_new_tokens}})
    assert response.status_code == 200
    return response.json()["generated_text"]


def test_metrics_count_what_the_answers_carried(server, smollm2_tokenizer):
    before = scrape_when(server, idle)  # after start-up (the warm-up generation counts too)
    asked = [("Hi", 5), ("The quick brown fox", 9), ("Once upon a time", 12)]
    streams = [streamed(server, prompt, n) for prompt, n in asked]
    tokens = [len(pieces) for pieces in streams]  # one line per decode step
    # The same requests unstreamed: greedy, so the same tokens (their text proves it).
    for (prompt, n), pieces in zip(asked[:2], streams):
        assert whole(server, prompt, n) == "".join(pieces)
    tokens += tokens[:2]
    prompts = [prompt for prompt, _ in asked + asked[:2]]
    requests = len(prompts)

    after = scrape_when(server, lambda s: idle(s) and s.minus(
        before, "djl_stream_http_requests_total", route="/invocations", status=200) >= requests)
    assert after.minus(before, "djl_stream_http_requests_total",
                       route="/invocations", status=200) == requests
    assert after.minus(before, "djl_stream_generation_tokens_total") == sum(tokens)
    prompt_tokens = sum(len(ids) for ids in smollm2_tokenizer(prompts)["input_ids"])
    assert after.minus(before, "djl_stream_prompt_tokens_total") == prompt_tokens
    for histogram in ("djl_stream_request_queue_time_seconds",
                      "djl_stream_time_to_first_token_seconds",
                      "djl_stream_e2e_request_latency_seconds"):
        assert after.minus(before, histogram + "_count") == requests, histogram
    # one interval per token after each request's first
    assert after.minus(before, "djl_stream_inter_token_latency_seconds_count") == \
        sum(tokens) - requests
    assert after.minus(before, "djl_stream_requests_cancelled_total") == 0
    assert after.minus(before, "djl_stream_requests_failed_total") == 0
    assert_histograms_consistent(after)

    # and the access log has each request's figures
    def logged(log: str) -> Counter:
        return Counter(int(n) for n in re.findall(
            r"POST /invocations 200 .* ttft=\S+ .*generated_tokens=(\d+)", log))

    def all_logged(log: str) -> bool:
        return all(logged(log)[n] >= count for n, count in Counter(tokens).items())

    assert all_logged(server.wait_for_log(all_logged)), logged(server.logs())


def test_refused_unknown_and_cancelled_requests(server, smollm2_tokenizer):
    before = scrape_when(server, idle)
    bad = server.http.post("/invocations", json={"inputs": "Hi", "parameters": {"max_new_tokens": -1}})
    assert bad.status_code == 400
    assert server.http.get("/no/such/route").status_code == 404
    assert server.http.get("/invocations").status_code == 405
    received = 0
    with server.http.stream("POST", "/invocations", json={
            "inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 250}}) as response:
        for line in response.iter_lines():
            received += bool(line)
            if received == 2:
                break  # and the connection closes

    after = scrape_when(server, lambda s: idle(s) and s.minus(
        before, "djl_stream_requests_cancelled_total") >= 1 and s.minus(
        before, "djl_stream_http_requests_total", route="/invocations", status=200) >= 1)
    assert after.minus(before, "djl_stream_requests_cancelled_total") == 1
    counted = {labels: after.minus(before, "djl_stream_http_requests_total", **dict(labels))
               for labels in [(("route", "/invocations"), ("status", "200")),
                              (("route", "/invocations"), ("status", "400")),
                              (("route", "/invocations"), ("status", "405")),
                              (("route", "unmatched"), ("status", "404"))]}
    assert set(counted.values()) == {1}, counted
    # only the cancelled request reached the model: the 400 was refused before it
    assert after.minus(before, "djl_stream_prompt_tokens_total") == \
        len(smollm2_tokenizer("Hello")["input_ids"])
    generated = after.minus(before, "djl_stream_generation_tokens_total")
    assert received <= generated < 250
    assert after.minus(before, "djl_stream_time_to_first_token_seconds_count") == 1
    assert after.minus(before, "djl_stream_inter_token_latency_seconds_count") == generated - 1
    assert after.minus(before, "djl_stream_e2e_request_latency_seconds_count") == 0
    server.wait_for_log("client-disconnected")


def test_openmetrics_when_asked(server):
    response = server.http.get("/metrics", headers={"accept": "application/openmetrics-text"})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert "djl_stream_generation_tokens_total" in response.text


def test_scrapes_are_counted_by_route(server):
    first = scrape(server)
    second = scrape_when(server, lambda s: s.minus(
        first, "djl_stream_http_requests_total", route="/metrics", status=200) >= 1)
    assert second("djl_stream_http_requests_total", route="/metrics", status=200) >= 1


def test_figures_carry_the_model_and_finished_sequences_are_counted_by_reason(
        server, tiny_model_dir):
    model = {"model": tiny_model_dir.name}
    before = scrape_when(server, idle)
    full = "".join(streamed(server, "Once upon a time", 6))
    stop = next(full[i:i + 3] for i in range(2, len(full) - 3) if full[i:i + 3].strip())
    stopped = server.http.post("/invocations", json={
        "inputs": "Once upon a time", "stream": False,
        "parameters": {"max_new_tokens": 6, "stop": [stop]}})
    assert stopped.status_code == 200
    two = server.http.post("/invocations", json={
        "inputs": ["Hi", "Hello"], "stream": False, "parameters": {"max_new_tokens": 3}})
    assert two.status_code == 200

    def reasons(current: Scrape) -> dict:
        return {reason: current.minus(before, "djl_stream_requests_finished_total",
                                      finish_reason=reason, **model)
                for reason in ("length", "stop", "cancelled", "error")}

    after = scrape_when(server, lambda s: idle(s) and sum(reasons(s).values()) >= 4)
    assert reasons(after) == {"length": 3, "stop": 1, "cancelled": 0, "error": 0}
    # every generation figure names the model it is about
    assert after.minus(before, "djl_stream_prompt_tokens_total", **model) != 0
    assert after("djl_stream_batch_rows", **model) == 0
    assert after("djl_stream_generation_tokens_total", model="another") == 0
