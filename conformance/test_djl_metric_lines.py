"""djl-stream's figures in djl-serving's real worker: ``[METRICS]`` lines on its stdout.

djl-serving's ``PyProcess.ReaderThread`` hands every worker stdout line containing
``[METRICS]`` to DJL's ``Metric.parse`` for the ``model_metric`` log (and, with
``SERVING_PROMETHEUS=true``, its ``/server/metrics``). The worker's stdout is kept in a log
file by :class:`~djl_frontend.DjlWorker`; each metric line there must parse by DJL's rules
(``test_metrics.parse_djl_metric``) and carry what the answer carried. ``djl-stream serve``
has its own ``/metrics`` and prints none.
"""

from __future__ import annotations

import time

import pytest

from targets import LOCAL, REAL, Fleet
from test_metrics import parse_djl_metric


@pytest.fixture(scope="module")
def tiny(djl_src, tiny_dir):
    fleet = Fleet(tiny_dir, djl_src)
    yield fleet
    fleet.stop()


def metric_lines(logs: str) -> list[dict]:
    # a last line without its newline may be cut short: it is read at the next look
    whole = logs[:logs.rfind("\n") + 1]
    return [parse_djl_metric(line) for line in whole.splitlines() if "[METRICS]" in line]


def wait_for(served, condition, timeout: float = 60.0) -> list[dict]:
    """The worker's metric lines once ``condition`` holds for them: its stdout reaches the
    log file through a pipe, a moment after the answer (a deadline, not a speed test)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = metric_lines(served.logs())
        if condition(lines):
            return lines
        assert time.monotonic() < deadline, served.logs()[-3000:]
        time.sleep(0.1)


def named(lines: list[dict], name: str) -> list[dict]:
    return [line for line in lines if line["name"] == name]


@pytest.mark.parametrize("target", REAL, ids=lambda t: t.name)
def test_each_request_reports_its_figures_to_djl_serving(tiny, target):
    served = tiny[target]
    # the start-up warm-up already reported (and printed the load)
    seen = len(wait_for(served, lambda lines: named(lines, "djl_stream_generation_tokens")))
    answer = served.ask({"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 6}})
    assert answer.status == 200
    steps = len(answer.lines())

    histograms = ("djl_stream_request_queue_time_microseconds",
                  "djl_stream_time_to_first_token_microseconds",
                  "djl_stream_mean_inter_token_latency_microseconds",
                  "djl_stream_e2e_request_latency_microseconds")
    # The request's lines are printed one at a time and reach the log through a pipe: wait
    # for each of them (waiting for one let CI read the log between two of them).
    lines = wait_for(served, lambda lines: all(named(lines[seen:], name) for name in
                                               (*histograms, "djl_stream_generation_tokens")))
    new = lines[seen:]
    assert [line["value"] for line in named(new, "djl_stream_generation_tokens")] == [steps]
    assert named(new, "djl_stream_generation_tokens")[0]["type"] == "c"
    for histogram in histograms:
        [line] = named(new, histogram)
        assert (line["unit"], line["type"]) == ("Microseconds", "h")
        assert line["value"] >= 0
    assert {line["dimensions"]["Model"] for line in lines} == {tiny.model_dir.name}

    # and once idle, the load it reports (sampled each second) is zero
    # (the three gauges are printed one line at a time: wait for the last of each)
    def idle(lines):
        return all(named(lines, name) and named(lines, name)[-1]["value"] == 0
                   for name in ("djl_stream_batch_rows", "djl_stream_kv_cache_tokens"))

    lines = wait_for(served, idle)
    assert named(lines, "djl_stream_kv_cache_tokens")[-1]["value"] == 0


def test_djl_stream_serve_prints_no_metric_lines(tiny):
    served = tiny[LOCAL]
    assert served.ask({"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 3}}).status == 200
    assert "[METRICS]" not in served.logs()
