"""A request's life in ``djl-stream serve`` when it ends early: clients that leave before
their answer is ready, and the graceful shutdown on SIGTERM.

Real server subprocesses on the tiny model. What the server did is read from its own
figures at ``GET /metrics`` (tokens generated and prefilled, requests cancelled, the load)
and from what clients receive, never from how long anything took: generations here are
long (``ignore_eos``) only so that they are still running when the test acts.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_process import ServerProcess

#: Enough decode steps that a generation is still running when the test acts on it.
LONG = 900
DEADLINE = 120.0
SHUTTING_DOWN = {"code": 503, "type": "ServiceUnavailableException",
                 "message": "the server is shutting down"}


@pytest.fixture(scope="module")
def long_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, allowed generations long enough to outlast a test's actions."""
    directory = tmp_path_factory.mktemp("long") / "tiny"
    shutil.copytree(tiny_model_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (directory / "config.json").write_text(json.dumps(config))
    properties = (directory / "serving.properties").read_text()
    (directory / "serving.properties").write_text(
        properties.replace("option.max_new_tokens_limit=256", "option.max_new_tokens_limit=3000"))
    return directory


@pytest.fixture(scope="module")
def one_row_server(long_model_dir: Path) -> Iterator[ServerProcess]:
    """One request at a time in the batch: a second one waits in the queue."""
    server = ServerProcess(long_model_dir, env={"OPTION_MAX_ROLLING_BATCH_SIZE": "1"})
    try:
        yield server.wait_ready(timeout=300)
    finally:
        server.stop()


# -- reading the server's figures -----------------------------------------------------------

Figures = Dict[str, float]


def figures(server: ServerProcess) -> Figures:
    """Every sample of ``GET /metrics``, by name (labels folded in as ``name{k=v}``; the
    ``model`` label, the same on every generation figure here, summed away)."""
    response = server.http.get("/metrics")
    assert response.status_code == 200
    samples: Figures = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def figures_when(server: ServerProcess, condition: Callable[[Figures], bool]) -> Figures:
    """The first scrape for which ``condition`` holds (a deadline, not a speed target)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        current = figures(server)
        if condition(current):
            return current
        assert time.monotonic() < deadline, {k: v for k, v in current.items()
                                             if k.startswith("djl_stream")}
        time.sleep(0.02)


def idle(current: Figures) -> bool:
    return current["djl_stream_batch_rows"] == 0 and current["djl_stream_requests_waiting"] == 0


def minus(after: Figures, before: Figures, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def generation(prompt: str, *, stream: bool, max_new_tokens: int = LONG) -> dict:
    return {"inputs": prompt, "stream": stream,
            "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}


@contextmanager
def client_that_leaves(server: ServerProcess, body: dict) -> Iterator[socket.socket]:
    """A client that sends ``body`` to ``/invocations``, reads nothing, and leaves (closes
    its connection) when the block ends."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE) as sock:
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: test\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        yield sock


def prompt_tokens(tokenizer, prompt: str) -> int:
    return len(tokenizer(prompt)["input_ids"])


# -- clients that leave ---------------------------------------------------------------------

def test_a_non_streaming_client_that_leaves_stops_its_generation(one_row_server):
    server = one_row_server
    before = figures_when(server, idle)
    with client_that_leaves(server, generation("Hello there", stream=False)):
        figures_when(server, lambda m: m["djl_stream_batch_rows"] == 1)  # it is generating
    after = figures_when(server, idle)
    assert minus(after, before, "djl_stream_requests_cancelled_total") == 1
    generated = minus(after, before, "djl_stream_generation_tokens_total")
    assert 1 <= generated < LONG, generated
    # counted as nginx's "client closed request" (nothing was sent), once the handler
    # returned, a moment after the scheduler let the request go
    figures_when(server, lambda m: minus(
        m, before, "djl_stream_http_requests_total{route=/invocations,status=499}") == 1)
    # and the server goes on serving
    answer = server.http.post("/invocations", json=generation("Hi", stream=False, max_new_tokens=3))
    assert answer.status_code == 200 and answer.json()["generated_text"]


def test_queued_requests_whose_clients_left_are_never_prefilled(one_row_server, smollm2_tokenizer):
    server = one_row_server
    holder, queued = "The batch is mine for a while", ["Never prefilled", "Nor this one, streamed"]
    before = figures_when(server, idle)
    with server.http.stream("POST", "/invocations", json=generation(holder, stream=True)) as running:
        lines = running.iter_lines()
        assert json.loads(next(lines))["output_tokens"]  # the one row is taken
        with client_that_leaves(server, generation(queued[0], stream=False, max_new_tokens=4)), \
                client_that_leaves(server, generation(queued[1], stream=True, max_new_tokens=4)):
            figures_when(server, lambda m: m["djl_stream_requests_waiting"] == 2)
        # Both left while waiting: they leave the queue, and the one row is still busy.
        during = figures_when(server, lambda m: m["djl_stream_requests_waiting"] == 0)
        assert during["djl_stream_batch_rows"] == 1
        assert minus(during, before, "djl_stream_requests_cancelled_total") == 2
    after = figures_when(server, idle)
    # Only the holder was ever prefilled.
    assert minus(after, before, "djl_stream_prompt_tokens_total") == \
        prompt_tokens(smollm2_tokenizer, holder)
    assert minus(after, before, "djl_stream_requests_cancelled_total") == 3


# -- graceful shutdown ----------------------------------------------------------------------

def read_lines(lines: Iterator[str]) -> List[Any]:
    return [json.loads(line) for line in lines if line]


def refused_while_shutting_down(server: ServerProcess) -> None:
    """Once SIGTERM is handled: /ping is 503, a new generation is refused with the
    server's JSON error and its connection closed; other routes still answer."""
    deadline = time.monotonic() + DEADLINE
    ping = server.http.get("/ping")
    while ping.status_code == 200:  # the signal is handled on the server's event loop
        assert time.monotonic() < deadline, "SIGTERM never closed the door"
        ping = server.http.get("/ping")
    assert ping.status_code == 503
    assert ping.json()["message"] == "the server is shutting down"
    refused = server.http.post("/invocations", json=generation("Too late", stream=True))
    assert refused.status_code == 503
    assert refused.json() == SHUTTING_DOWN
    assert refused.headers["connection"] == "close"
    assert server.http.get("/metrics").status_code == 200


def test_sigterm_lets_running_streams_finish_then_exits_0(long_model_dir):
    server = ServerProcess(long_model_dir, env={"DJL_STREAM_SHUTDOWN_GRACE": "600"}
                           ).wait_ready(timeout=300)
    try:
        # long enough that the streams outlast the checks below on a busy machine: once
        # they end, the server stops listening
        length = 2000
        with server.http.stream("POST", "/invocations", json=generation(
                "First", stream=True, max_new_tokens=length)) as first, \
                server.http.stream("POST", "/invocations", json=generation(
                    "Second", stream=True, max_new_tokens=length)) as second:
            streams = [first.iter_lines(), second.iter_lines()]
            heads = [next(lines) for lines in streams]  # both are running
            server.send_signal(signal.SIGTERM)
            refused_while_shutting_down(server)
            rests = [read_lines(lines) for lines in streams]
        for head, rest in zip(heads, rests):
            lines = [json.loads(head)] + rest
            assert len(lines) == length  # one line per token: every one of them
            assert not any("error" in line for line in lines)
        assert server.wait_exit() == 0
    finally:
        server.stop()


def test_sigterm_ends_what_outlasts_the_grace_period_with_errors_then_exits_0(long_model_dir):
    server = ServerProcess(long_model_dir, args=["--shutdown-grace", "2"]).wait_ready(timeout=300)
    try:
        whole: Dict[str, httpx.Response] = {}

        def ask_whole() -> None:
            with httpx.Client(base_url=server.url, timeout=DEADLINE) as client:
                whole["answer"] = client.post("/invocations", json=generation(
                    "Unstreamed", stream=False, max_new_tokens=3000))

        asker = threading.Thread(target=ask_whole)
        asker.start()
        with server.http.stream("POST", "/invocations", json=generation(
                "Streamed", stream=True, max_new_tokens=3000)) as streamed:
            lines = streamed.iter_lines()
            head = json.loads(next(lines))
            figures_when(server, lambda m: m["djl_stream_batch_rows"] == 2)  # both running
            server.send_signal(signal.SIGTERM)
            rest = read_lines(lines)
        asker.join(DEADLINE)
        # The stream ends with its own error record, as a failure mid-stream does.
        assert "output_tokens" in head and all("output_tokens" in line for line in rest[:-1])
        assert set(rest[-1]) == {"error"} and "shutting down" in rest[-1]["error"]
        assert 1 + len(rest[:-1]) < 3000
        # The answer that was not ready is a 503 another replica can take.
        assert whole["answer"].status_code == 503
        assert whole["answer"].json()["type"] == "ServiceUnavailableException"
        assert "shutting down" in whole["answer"].json()["message"]
        assert server.wait_exit() == 0
    finally:
        server.stop()
