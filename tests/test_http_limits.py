"""``djl-stream serve`` against clients that send too much, too slowly, or not at all
on raw sockets to a real uvicorn process: bodies too large or too slow, heads too large,
requests framed twice, and connections held idle.

The server runs the word-streaming fixture handler of ``test_server`` with small limits
(a 1000-byte body, one second for a head, for a body and for an idle connection). Each test
asserts the answer (a JSON 408 or 413 that closes the connection) and that the server goes
on serving. Deadlines are generous (:data:`DEADLINE`) and only bound how long a test waits
for what must eventually happen.
"""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest
from server_process import ServerProcess, serving
from test_server import write_model_dir

#: How long a test waits for an answer or a log line that must come; never a speed target.
DEADLINE = 60.0
LIMITS = ["--timeout-header", "1", "--timeout-body", "1", "--timeout-keep-alive", "1"]
#: One limit from its variable, as a container would set it (the 413s below name it).
LIMITS_ENV = {"DJL_STREAM_MAX_REQUEST_SIZE": "1000"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = write_model_dir(tmp_path_factory.mktemp("limits") / "wordmodel")
    with serving(model_dir, args=LIMITS, env=LIMITS_ENV) as running:
        yield running


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(DEADLINE)
    return sock


def head(method: str = "POST", path: str = "/invocations", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost",
             *(f"{name.replace('_', '-')}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Answer:
    """One response read off a socket up to the server's closing it."""

    def __init__(self, raw: bytes) -> None:
        head_bytes, _, self.body = raw.partition(b"\r\n\r\n")
        status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {name.lower(): value.strip() for name, _, value in
                        (line.partition(":") for line in header_lines)}

    def json(self) -> dict:
        return json.loads(self.body)


def read_until_closed(sock: socket.socket) -> bytes:
    """Every byte the server sends until it closes the connection; a server that never
    does fails the test at :data:`DEADLINE` (socket.timeout)."""
    raw = b""
    while chunk := sock.recv(65536):
        raw += chunk
    return raw


def answer_then_close(sock: socket.socket) -> Answer:
    """The one response read off a socket up to the server's closing it."""
    raw = read_until_closed(sock)
    assert raw, "the server closed the connection without an answer"
    return Answer(raw)


def assert_still_serving(server: ServerProcess) -> None:
    # A new connection each time: the server closes idle ones after a second.
    with httpx.Client(base_url=server.url, timeout=DEADLINE) as client:
        assert client.get("/ping").status_code == 200
        answer = client.post("/invocations", json={"words": ["still", "here"]})
        assert answer.status_code == 200
        assert [json.loads(line) for line in answer.text.splitlines()] == [
            {"output_tokens": ["still"]}, {"output_tokens": ["here"]}]


# -- the request body's size --

def test_a_content_length_over_the_limit_is_refused_before_the_body_is_read(server):
    with connect(server) as sock:
        # Not a byte of the body is sent: the answer cannot wait for it.
        sock.sendall(head(content_type="application/json", content_length="1001"))
        answer = answer_then_close(sock)
    assert answer.status == 413
    assert answer.headers["connection"] == "close"
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {
        "code": 413, "type": "RequestEntityTooLargeException",
        "message": "the request body is 1001 bytes (content-length); "
                   "the limit (--max-request-size) is 1000 bytes"}
    assert_still_serving(server)


def test_a_body_over_the_limit_on_openais_routes_is_refused_in_openais_shape(server):
    with connect(server) as sock:
        sock.sendall(head(path="/v1/chat/completions", content_type="application/json",
                          content_length="1001"))
        answer = answer_then_close(sock)
    assert answer.status == 413
    assert answer.json() == {"error": {
        "message": "the request body is 1001 bytes (content-length); the limit "
                   "(--max-request-size) is 1000 bytes",
        "type": "invalid_request_error", "param": None, "code": None}}


def test_a_client_expecting_100_continue_is_refused_without_sending_its_body(server):
    with connect(server) as sock:
        sock.sendall(head(content_length="50000000", expect="100-continue"))
        answer = answer_then_close(sock)  # a 100 Continue first would fail the parse below
    assert answer.status == 413


def test_a_chunked_body_is_refused_as_soon_as_it_outgrows_the_limit(server):
    with connect(server) as sock:
        # 1200 bytes in two chunks and no last chunk: the answer comes without the rest.
        chunk = b"258\r\n" + b"a" * 600 + b"\r\n"
        sock.sendall(head(transfer_encoding="chunked") + chunk + chunk)
        answer = answer_then_close(sock)
    assert answer.status == 413
    assert answer.json() == {
        "code": 413, "type": "RequestEntityTooLargeException",
        "message": "the request body is larger than the limit (--max-request-size) of 1000 bytes"}
    assert_still_serving(server)


def test_a_body_within_the_limit_is_served(server):
    words = ["w" * 900]  # 915 bytes of JSON
    with httpx.Client(base_url=server.url, timeout=DEADLINE) as client:
        answer = client.post("/invocations", json={"words": words})
    assert answer.status_code == 200
    assert json.loads(answer.text) == {"output_tokens": words}


# -- time --

def test_a_body_shorter_than_its_content_length_is_answered_408(server):
    with connect(server) as sock:
        sock.sendall(head(content_type="application/json", content_length="100") + b'{"words"')
        answer = answer_then_close(sock)
    assert answer.status == 408
    assert answer.headers["connection"] == "close"
    assert answer.json() == {
        "code": 408, "type": "RequestTimeoutException",
        "message": "the request body was not complete within 1 s (--timeout-body): "
                   "8 of 100 bytes arrived"}
    assert_still_serving(server)


def test_a_chunked_body_without_its_last_chunk_is_answered_408(server):
    with connect(server) as sock:
        sock.sendall(head(transfer_encoding="chunked") + b"8\r\n{\"words\"\r\n")
        answer = answer_then_close(sock)
    assert answer.status == 408
    assert answer.json()["message"] == ("the request body was not complete within 1 s "
                                        "(--timeout-body): 8 bytes arrived")
    assert_still_serving(server)


def test_a_head_sent_slowly_is_answered_408(server):
    # Slowloris: one header line at a time, each well within any per-read timeout.
    lines = iter([b"POST /invocations HTTP/1.1\r\n", b"Host: localhost\r\n",
                  *(b"X-Drip-%d: 1\r\n" % i for i in range(100_000))])
    deadline = time.monotonic() + DEADLINE
    with connect(server) as sock:
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                break
            sock.sendall(next(lines))
        answer = answer_then_close(sock)
    assert answer.status == 408
    assert answer.headers["connection"] == "close"
    assert answer.json() == {
        "code": 408, "type": "RequestTimeoutException",
        "message": "the request head was not complete within 1 s (--timeout-header)"}
    assert_still_serving(server)


def read_answer(sock: socket.socket) -> Answer:
    """One response with a Content-Length, leaving the connection open."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536) or pytest.fail(f"closed after {raw!r}")
    length = int(Answer(raw).headers["content-length"])
    while len(raw.partition(b"\r\n\r\n")[2]) < length:
        raw += sock.recv(65536) or pytest.fail(f"closed after {raw!r}")
    return Answer(raw)


def test_a_body_answered_without_being_read_is_dropped_and_the_connection_serves_on(server):
    with connect(server) as sock:
        # Another model's route answers 404 before reading the body, which comes later.
        sock.sendall(head(path="/predictions/othermodel", content_length="20"))
        assert read_answer(sock).status == 404
        sock.sendall(b"x" * 20)
        sock.sendall(head("GET", "/ping"))
        answer = read_answer(sock)
    assert answer.status == 200
    assert answer.json() == {"status": "Healthy"}


def test_a_body_answered_without_being_read_must_still_arrive_in_time(server):
    with connect(server) as sock:
        sock.sendall(head(path="/predictions/othermodel", content_length="1000"))
        assert read_answer(sock).status == 404
        # A byte at a time, never idle long enough for the keep-alive timeout.
        deadline = time.monotonic() + DEADLINE
        while True:
            assert time.monotonic() < deadline, "the connection was never closed"
            if select.select([sock], [], [], 0.2)[0]:
                try:
                    assert sock.recv(1) == b""  # closed, without another answer
                except ConnectionResetError:
                    pass  # closed as a byte was on its way
                break
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                break
    assert_still_serving(server)


def test_connections_that_send_nothing_are_closed(server):
    # Half-open connections used to stay for good (200 of them, still there after 90 s).
    idle = [connect(server) for _ in range(20)]
    try:
        for sock in idle:
            assert sock.recv(1) == b""  # closed without an answer; socket.timeout if never
    finally:
        for sock in idle:
            sock.close()
    assert_still_serving(server)


def test_a_connection_idle_after_its_answer_is_closed(server):
    with connect(server) as sock:
        sock.sendall(head("GET", "/ping"))
        answer = answer_then_close(sock)  # uvicorn's keep-alive timeout, set by the flag
    assert answer.status == 200
    assert answer.json() == {"status": "Healthy"}


def test_a_malformed_request_gets_a_json_400(server):
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = answer_then_close(sock)
    assert answer.status == 400
    assert answer.json() == {"code": 400, "type": "BadRequestException",
                             "message": "Invalid HTTP request received."}
    assert_still_serving(server)


# -- a client that leaves while uploading --

def test_an_upload_cut_off_midway_logs_one_line_and_no_traceback(server):
    since = len(server.logs())
    with connect(server) as sock:
        sock.sendall(head(content_type="application/json", content_length="900") + b"{" * 100)
    server.wait_for_log("client-disconnected", since)
    # Whatever else the cut-off request logs is logged before this request's own line.
    assert_still_serving(server)
    log = server.wait_for_log("POST /invocations 200", since)
    assert "Traceback" not in log
    assert "ERROR" not in log
    cut_off = [line for line in log.splitlines() if "POST /invocations" in line
               and " 200 " not in line]
    assert len(cut_off) == 1
    assert " 499 " in cut_off[0] and "client-disconnected" in cut_off[0]


# -- requests smuggled inside a body, heads too large --

def test_a_request_framed_twice_is_refused_and_what_its_body_hides_never_runs(server):
    # Content-Length says 60 bytes of body; chunked says the body ends at "0\r\n\r\n",
    # after which a second request waits. RFC 9112 6.3: refuse (or answer) and close.
    hidden = head("GET", "/v1/models", connection="close")
    with connect(server) as sock:
        sock.sendall(head(content_length=str(5 + len(hidden)), transfer_encoding="chunked")
                     + b"0\r\n\r\n" + hidden)
        raw = read_until_closed(sock)
    assert raw.count(b"HTTP/1.1 ") == 1, raw  # one answer: the hidden request never ran
    answer = Answer(raw)
    assert answer.status == 400
    assert answer.headers["connection"] == "close"
    assert answer.json() == {
        "code": 400, "type": "BadRequestException",
        "message": "the request has both Content-Length and Transfer-Encoding; "
                   "send one of them"}
    assert_still_serving(server)


def test_a_head_over_the_limit_sent_at_once_is_answered_431(server):
    with connect(server) as sock:
        sock.sendall(head("GET", "/ping", x_padding="p" * 64 * 1024))
        answer = answer_then_close(sock)
    assert answer.status == 431
    assert answer.json()["type"] == "RequestHeaderFieldsTooLargeException"
    assert answer.json()["message"].startswith("the request head is ")
    assert answer.json()["message"].endswith("; the limit (--max-head-size) is 16384 bytes")
    assert_still_serving(server)


def test_a_head_over_the_limit_sent_in_pieces_is_answered_431(server):
    with connect(server) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: localhost\r\n")
        try:
            for _ in range(40):  # 40 KiB of one header that never ends
                sock.sendall(b"X-Padding: " + b"p" * 1024)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered before the rest was sent
        answer = answer_then_close(sock)
    assert answer.status == 431
    assert answer.json()["message"] == ("the request head is over the limit "
                                        "(--max-head-size) of 16384 bytes")
    assert_still_serving(server)


def test_a_target_over_the_limit_is_answered_414(server):
    with connect(server) as sock:
        sock.sendall(head("GET", "/ping?" + "q" * 100_000))
        answer = answer_then_close(sock)
    assert answer.status == 414
    assert answer.json() == {
        "code": 414, "type": "RequestUriTooLongException",
        "message": "the request target is 100006 bytes; the limit (--max-head-size) is "
                   "16384 bytes"}
    assert_still_serving(server)


def test_a_head_just_within_the_limit_is_served(server):
    request = head("GET", "/ping", connection="close")
    padding = 16 * 1024 - len(request) - len("X-Padding: \r\n")
    with connect(server) as sock:
        sock.sendall(head("GET", "/ping", connection="close", x_padding="p" * padding))
        assert answer_then_close(sock).status == 200


# -- the concurrency limit counts requests, not connections --

def test_idle_connections_take_no_request_slots_and_ping_always_answers(tmp_path: Path):
    model_dir = write_model_dir(tmp_path / "wordmodel")
    # A keep-alive long enough that the idle connections below stay open.
    args = ["--limit-concurrency", "2", "--timeout-keep-alive", "600"]
    with serving(model_dir, args=args) as running:
        idle = [connect(running) for _ in range(50)]
        try:
            with httpx.Client(base_url=running.url, timeout=DEADLINE) as client:
                assert client.get("/ping").status_code == 200
                served = client.post("/invocations", json={"words": ["a", "b"]})
                assert served.status_code == 200
                # two streams in progress take both slots: a third request is refused,
                # /ping still answers
                with client.stream("POST", "/invocations",
                                   json={"words": ["held", "on"], "gate": "one"}) as one, \
                        client.stream("POST", "/invocations",
                                      json={"words": ["held", "on"], "gate": "two"}) as two:
                    assert one.status_code == two.status_code == 200
                    with httpx.Client(base_url=running.url, timeout=DEADLINE) as other:
                        refused = other.post("/invocations", json={"words": ["x"]})
                        assert other.get("/ping").status_code == 200
                    (model_dir / "gate-one").touch()
                    (model_dir / "gate-two").touch()
                    one.read(), two.read()
                assert client.post("/invocations", json={"words": ["c"]}).status_code == 200
        finally:
            for sock in idle:
                sock.close()
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json() == {
        "code": 503, "type": "ServiceUnavailableException",
        "message": "the server has 2 requests in progress, its limit (--limit-concurrency); "
                   "retry later"}
