"""The local server's HTTP contract, against a real uvicorn process on a loopback port.

The model directory is a temporary one whose ``model.py`` is a small real handler
(``FIXTURE_MODEL`` below): it follows the djl contract, streams word lists with a pause
between items, can be told to fail before the first item or after N items, and writes what
happened to its stream (items produced, whether ``close()`` was called) to a JSON file in
the model directory, so the tests can see generation stop.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from server_process import ServerProcess

FIXTURE_MODEL = textwrap.dedent('''
    """A djl-style handler for the server's contract tests."""
    from __future__ import annotations

    import json
    import os
    import threading
    import time
    from pathlib import Path

    from djl_stream.serving.compat import Output
    from djl_stream.protocols.djl.formatters import resolve_formatter

    HERE = Path(__file__).parent


    def _write(name, record):
        path = HERE / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)  # readers never see half a file


    def jsonlines(words):
        return json.dumps({"output_tokens": words}) + "\\n"


    class WordStream:
        """An iterator with close(), recording what the server did with it."""

        def __init__(self, words, delay, fail_after, tag, gate=None):
            self.words, self.delay, self.fail_after, self.tag = words, delay, fail_after, tag
            self.gate = gate
            self.produced = 0
            self.closed = False
            self.close_during_next = False
            self.in_next = False
            self.lock = threading.Lock()
            self.record()

        def record(self):
            if self.tag:
                _write(f"record-{self.tag}.json", {
                    "produced": self.produced, "closed": self.closed,
                    "close_during_next": self.close_during_next, "time": time.time()})

        def __iter__(self):
            return self

        def __next__(self):
            self.in_next = True
            try:
                if self.closed or self.produced >= len(self.words):
                    raise StopIteration
                if self.fail_after is not None and self.produced >= self.fail_after:
                    raise RuntimeError(f"failed after {self.produced} items")
                if self.gate and self.produced == 1:
                    # after the first item, wait until the test opens the gate
                    deadline = time.monotonic() + 60
                    while not (HERE / f"gate-{self.gate}").exists():
                        if time.monotonic() > deadline:
                            raise RuntimeError("the gate never opened")
                        time.sleep(0.01)
                time.sleep(self.delay)
                word = self.words[self.produced]
                self.produced += 1
                self.record()
                return [word]
            finally:
                self.in_next = False

        def close(self):
            self.close_during_next = self.in_next
            self.closed = True
            self.record()


    def handle(inputs):
        if inputs.is_empty():
            props = inputs.get_properties()
            _write("init.json", dict(props))
            time.sleep(float(props.get("init_delay", "0")))
            if props.get("fail_init") == "true":
                raise RuntimeError(f"weights are missing from {HERE}")
            return None
        request = inputs.get_as_json()
        if request.get("raise"):
            raise ValueError("handler exploded")
        if "status" in request:
            return Output().error(request.get("message", "bad input"), code=request["status"])
        if request.get("echo"):
            content = inputs.get_content()
            return (Output().add_property("content-type", "application/json")
                    .add_as_json({"properties": inputs.get_properties(),
                                  "content": {k: bytes(v).decode() for k, v in
                                              zip(content.get_keys(), content.get_values())}}))
        if request.get("fail_before"):
            def failing():
                raise RuntimeError("no tokens for you")
                yield
            stream = failing()
        else:
            stream = WordStream(request.get("words", ["a", "b", "c"]),
                                request.get("delay", 0.0), request.get("fail_after"),
                                request.get("tag"), request.get("gate"))
        formatter = resolve_formatter("sse") if request.get("format") == "sse" else jsonlines
        out = Output()
        if request.get("format") != "sse":
            out.add_property("content-type", "application/jsonlines")
        out.add_property("x-fixture", "yes")
        return out.add_stream_content(stream, output_formatter=formatter)
''')

READY_TIMEOUT = 30.0


def write_model_dir(path: Path, properties: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.py").write_text(FIXTURE_MODEL)
    (path / "serving.properties").write_text("engine=Python\n" + properties)
    return path


class Server(ServerProcess):
    """The fixture model's server; its log lives in the model directory, beside the
    records the fixture handler writes."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir, log_path=model_dir / "server.log")

    def first_ping(self, timeout: float = READY_TIMEOUT) -> httpx.Response:
        return super().first_ping(timeout)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> "Server":
        super().wait_ready(timeout)
        return self

    def record(self, tag: str) -> dict:
        return json.loads((self.model_dir / f"record-{tag}.json").read_text())

    def open_gate(self, gate: str) -> None:
        """Let the streams started with ``"gate": gate`` go past their first item."""
        (self.model_dir / f"gate-{gate}").touch()

    def wait_for(self, tag: str, produced: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        path = self.model_dir / f"record-{tag}.json"
        while not path.exists() or self.record(tag)["produced"] < produced:
            assert time.monotonic() < deadline, f"stream {tag} never produced {produced} items"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(write_model_dir(tmp_path_factory.mktemp("fixture") / "wordmodel"))
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def lines_of(response: httpx.Response) -> list[Any]:
    return [json.loads(line) for line in response.text.splitlines() if line]


# -- loading --

def test_ping_is_503_while_loading_then_200(tmp_path: Path) -> None:
    running = Server(write_model_dir(tmp_path / "slow", "option.init_delay=3\n"))
    try:
        ping = running.first_ping()
        assert ping.status_code == 503
        assert ping.json()["modelStatus"] == "LOADING"
        refused = running.http.post("/invocations", json={"words": ["x"]})
        assert refused.status_code == 503
        assert refused.json() == {"code": 503, "type": "ServiceUnavailableException",
                                  "message": "model slow is loading"}
        running.wait_ready()
        assert running.http.get("/ping").json() == {"status": "Healthy"}
        # The init call got the options without their prefix, plus djl's own keys.
        init = json.loads((tmp_path / "slow" / "init.json").read_text())
        assert init["init_delay"] == "3"
        assert init["handler"] == "handle"
        assert init["device_id"] in ("-1", "0")
        assert init["model_dir"] == str((tmp_path / "slow").resolve())
    finally:
        running.stop()


def test_failed_load_is_reported_by_ping_and_models(tmp_path: Path) -> None:
    running = Server(write_model_dir(tmp_path / "broken", "option.fail_init=true\n"))
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while (ping := running.first_ping()).json()["modelStatus"] == "LOADING":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Clients get a short reason; the loader's own text (here naming the model
        # directory's path, as a missing file does) goes to the log only.
        short = "model broken failed to load (RuntimeError); the server log has the details"
        assert ping.status_code == 503
        assert ping.json()["message"] == short
        assert running.http.get("/models").json()["models"][0]["status"] == "FAILED"
        refused = running.http.post("/invocations", json={})
        assert refused.status_code == 503
        assert refused.json()["message"] == short
        path = str((tmp_path / "broken").resolve())
        for answer in (ping, refused, running.http.get("/models")):
            assert path not in answer.text
        # (ping says FAILED a moment before the traceback is written)
        running.wait_for_log(f"RuntimeError: weights are missing from {path}")
    finally:
        running.stop()


# -- streaming --

def test_each_item_is_its_own_chunk_sent_as_soon_as_it_exists(server: Server) -> None:
    words = ["one", "two", "three", "four", "five"]
    payload = {"words": words, "tag": "chunks", "gate": "chunks"}
    with server.http.stream("POST", "/invocations", json=payload) as response:
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.headers["content-type"] == "application/jsonlines"
        assert response.headers["x-fixture"] == "yes"
        chunks = response.iter_raw()
        # the stream waits behind the gate after its first item: the first chunk must
        # reach the client without waiting for the rest
        first = next(chunks)
        assert server.record("chunks")["produced"] == 1
        server.open_gate("chunks")
        rest = list(chunks)
    assert b"".join([first] + rest).decode().splitlines() == \
        [json.dumps({"output_tokens": [w]}) for w in words]


# A handler's stream that raises is answered as djl-serving answers it (make conformance
# holds the two together): djl-stream's own handler never lets that happen, see
# tests/test_service.py.

def test_stream_error_before_first_item_is_a_200_carrying_the_error_text(server: Server) -> None:
    response = server.http.post("/invocations", json={"fail_before": True})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/jsonlines"
    assert response.text == "no tokens for you"


def test_stream_error_after_first_item_appends_the_error_text(server: Server) -> None:
    payload = {"words": ["a", "b", "c", "d"], "fail_after": 2, "tag": "fail-after"}
    # httpx raises RemoteProtocolError on broken chunked framing, so reading the whole
    # body also checks that the stream was closed cleanly.
    response = server.http.post("/invocations", json=payload)
    assert response.status_code == 200
    assert response.text == ('{"output_tokens": ["a"]}\n{"output_tokens": ["b"]}\n'
                             "failed after 2 items")
    # The next request on the same connection still works.
    assert server.http.get("/ping").status_code == 200


def test_client_disconnect_stops_generation(server: Server) -> None:
    # 2000 items 50 ms apart: stopped anywhere near its start is stopped by the disconnect,
    # with room for a busy machine to notice it late
    words = [f"w{i}" for i in range(2000)]
    payload = {"words": words, "delay": 0.05, "tag": "disconnect"}
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        with client.stream("POST", "/invocations", json=payload) as response:
            received = 0
            for _ in response.iter_lines():
                received += 1
                if received == 3:
                    break
    # Leaving the block closed the connection mid-stream.
    deadline = time.monotonic() + 60.0
    while not (record := server.record("disconnect"))["closed"]:
        assert time.monotonic() < deadline, "the stream iterator was never closed"
        time.sleep(0.05)
    time.sleep(0.5)
    final = server.record("disconnect")
    assert final["produced"] == record["produced"], "generation went on after close()"
    assert final["produced"] < 200, final
    assert not final["close_during_next"], "close() must wait for the next() in flight"


def test_ping_answers_during_a_long_generation(server: Server) -> None:
    payload = {"words": ["a", "b", "c"], "tag": "long", "gate": "long"}
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        with client.stream("POST", "/invocations", json=payload) as response:
            lines = response.iter_lines()
            next(lines)
            # the generation is held mid-stream; the server must still answer
            assert server.http.get("/ping").status_code == 200
            assert server.record("long")["produced"] == 1
            server.open_gate("long")
            assert len(list(lines)) == 2


def test_concurrent_streams_run_together(server: Server) -> None:
    results: dict[int, list[str]] = {}

    def one(i: int) -> None:
        payload = {"words": ["a", "b", "c"], "tag": f"together-{i}", "gate": "together"}
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            results[i] = client.post("/invocations", json=payload).text.splitlines()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    # every stream stops after its first item until the gate opens: all eight get there
    # only if the server runs them at the same time
    for i in range(8):
        server.wait_for(f"together-{i}", produced=1)
    server.open_gate("together")
    for thread in threads:
        thread.join(60)
    assert [len(results[i]) for i in range(8)] == [3] * 8


# -- non-streaming answers and errors --

def test_handler_error_status_is_passed_through(server: Server) -> None:
    response = server.http.post("/invocations", json={"status": 400, "message": "inputs is empty"})
    assert response.status_code == 400
    assert response.json() == {"code": 400, "message": "invoke handler failure",
                               "error": "inputs is empty"}
    assert server.http.post("/invocations", json={"words": ["ok"]}).status_code == 200


def test_handler_exception_is_424(server: Server) -> None:
    response = server.http.post("/invocations", json={"raise": True})
    assert response.status_code == 424
    assert response.json()["error"] == "handler exploded"


def test_headers_and_query_parameters_reach_the_input(server: Server) -> None:
    response = server.http.post("/invocations?mode=fast&lang=fr", json={"echo": True},
                                headers={"X-Custom-Header": "Value"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    seen = response.json()
    assert seen["properties"]["x-custom-header"] == "Value"
    assert seen["properties"]["content-type"] == "application/json"
    assert len(seen["properties"]["requestId"]) == 36
    assert seen["content"] == {"data": '{"echo":true}', "mode": "fast", "lang": "fr"}


# -- routes --

def test_predictions_route_by_model_name(server: Server) -> None:
    response = server.http.post("/predictions/wordmodel", json={"words": ["hi"]})
    assert lines_of(response) == [{"output_tokens": ["hi"]}]
    missing = server.http.post("/predictions/gpt5", json={"words": ["hi"]})
    assert missing.status_code == 404
    assert missing.json() == {"code": 404, "type": "ModelNotFoundException",
                              "message": "Model not found: gpt5"}


def test_a_trailing_slash_names_the_same_route_and_never_redirects(server: Server) -> None:
    # Starlette answered a 307 to http://<the Host header>/predictions/wordmodel
    response = server.http.post("/predictions/wordmodel/", json={"words": ["hi"]},
                                headers={"host": "evil.example:666"})
    assert response.status_code == 200
    assert "location" not in response.headers
    assert lines_of(response) == [{"output_tokens": ["hi"]}]
    assert server.http.get("/ping/").json() == {"status": "Healthy"}


def test_models_lists_the_model_without_its_path(server: Server) -> None:
    listing = server.http.get("/models").json()
    assert listing == {"models": [{"modelName": "wordmodel", "modelUrl": "wordmodel",
                                   "status": "READY"}]}


def test_framework_errors_are_json(server: Server) -> None:
    unknown = server.http.get("/nowhere")
    assert unknown.status_code == 404
    assert unknown.json()["type"] == "ResourceNotFoundException"
    wrong_method = server.http.get("/invocations")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["code"] == 405


def test_framework_errors_under_v1_are_in_openais_shape(server: Server) -> None:
    wrong_method = server.http.get("/v1/chat/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {"error": {"message": "Method Not Allowed",
                                             "type": "invalid_request_error",
                                             "param": None, "code": None}}
    unknown = server.http.post("/v1/nowhere", json={})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "invalid_request_error"


def test_an_unhandled_error_is_a_500_naming_only_its_type(server: Server) -> None:
    # A status that is no number breaks the server's own answer: the exception's text goes
    # to the log, not to the client (it may name paths).
    answer = server.http.post("/invocations", json={"status": "teapot", "message": "x"})
    assert answer.status_code == 500
    assert answer.headers["connection"] == "close"  # uvicorn closes it after an exception
    assert answer.json() == {"code": 500, "type": "InternalServerException",
                             "message": "internal server error (ValueError); "
                                        "the server log has the details"}
    server.wait_for_log("invalid literal for int() with base 10: 'teapot'")


def test_one_log_line_per_request(server: Server) -> None:
    since = len(server.logs())
    server.http.post("/invocations", json={"words": ["x", "y"]})

    def ours(log: str) -> list:  # (another test's request may end in this log too)
        return [line for line in log.splitlines()
                if "POST /invocations 200" in line and "items=2" in line]

    log = server.wait_for_log(ours, since)
    assert len(ours(log)) == 1 and "first_chunk=" in ours(log)[0]


# -- the client against the real server --

def test_client_stream_reads_records_and_raises_server_errors(server: Server) -> None:
    from djl_stream.shipping.client import StreamingError, stream

    url = f"{server.url}/invocations"
    assert [r["output_tokens"][0] for r in stream(url, {"words": ["x", "y"]})] == ["x", "y"]
    with pytest.raises(StreamingError, match="failed after 1 items"):
        list(stream(url, {"words": ["x", "y"], "fail_after": 1}))
    # djl-serving's answer to a stream failing at once: a 200 whose body is the error text
    with pytest.raises(StreamingError, match="no tokens for you"):
        list(stream(url, {"fail_before": True}))
    with pytest.raises(StreamingError, match="HTTP 400: inputs is empty"):
        list(stream(url, {"status": 400, "message": "inputs is empty"}))
