"""What the chat page shows when the server cannot answer: a full queue, and a server that
shuts down mid-answer. Both read as messages in the page, never as an answer that waits
for ever. Each test saves a screenshot."""

from __future__ import annotations

import json
import signal

import pytest
from websockets.sync.client import connect

from page import ask, errors, gauge, open_page, streaming, tokens_shown, wait_for
from server_process import ServerProcess

LONG = {"content": "Write a long story about a dragon who learns to bake bread.",
        "parameters": {"max_new_tokens": 400, "do_sample": False}}


def model_dir_with(source, target, extra_properties: str):
    """``source``'s files linked into ``target``, its serving.properties with more keys."""
    for path in source.iterdir():
        if path.name != "serving.properties":
            (target / path.name).symlink_to(path.resolve())
    (target / "serving.properties").write_text(
        (source / "serving.properties").read_text() + "\n" + extra_properties)
    return target


@pytest.fixture(scope="module")
def one_row_server(embedded_model_dir, tmp_path_factory):
    """One row decoding, one request waiting: a third is refused (503)."""
    directory = model_dir_with(embedded_model_dir, tmp_path_factory.mktemp("one-row"),
                               "option.max_rolling_batch_size=1\njob_queue_size=1\n")
    process = ServerProcess(directory).wait_ready(timeout=300)
    yield process
    process.stop()


def test_a_full_queue_reads_as_a_message(browser, one_row_server, screenshots):
    url = one_row_server.url.replace("http://", "ws://") + "/ws/chat"
    page = open_page(browser, one_row_server)
    with connect(url) as running, connect(url) as waiting:
        running.send(json.dumps(LONG))
        assert json.loads(running.recv())["type"] == "token"
        waiting.send(json.dumps(LONG))
        wait_for(lambda: gauge(one_row_server, "djl_stream_requests_waiting") == 1)
        ask(page, "Hello!", max_new_tokens=8)
        error = wait_for(lambda: errors(page))[-1]
        page.save_screenshot(str(screenshots / "queue-full.png"))
        for socket in (running, waiting):
            socket.send(json.dumps({"type": "cancel"}))
    assert "Error 503" in error.text and "job_queue_size" in error.text, error.text
    assert not streaming(page)


def test_a_server_that_shuts_down_mid_answer_reads_as_a_message(browser, embedded_model_dir,
                                                                screenshots):
    server = ServerProcess(embedded_model_dir, args=["--shutdown-grace", "1"])
    try:
        server.wait_ready(timeout=300)
        page = open_page(browser, server)
        ask(page, LONG["content"], max_new_tokens=400)
        wait_for(lambda: tokens_shown(page) >= 3)
        server.send_signal(signal.SIGTERM)
        error = wait_for(lambda: errors(page))[-1]
        page.save_screenshot(str(screenshots / "shutdown.png"))
        assert not streaming(page)
        assert "closed before the answer ended" in error.text or "shutting down" in error.text, \
            error.text
        assert server.wait_exit() == 0
    finally:
        server.stop()
