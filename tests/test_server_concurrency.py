"""Many clients at once over real HTTP: streams share decode steps, nothing is mixed up."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_process import ServerProcess

PROMPTS = ["Hi", "The quick brown fox", "Once upon a time there was", "A", "Colours", "One two three four"]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir):
    server = ServerProcess(tiny_model_dir)
    try:
        yield server.wait_ready(timeout=120).url
    finally:
        server.stop()


def streamed_text(url, prompt, max_new_tokens):
    text, lines = "", 0
    with httpx.stream("POST", url + "/invocations", timeout=120,
                      json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                text += json.loads(line)["output_tokens"][0]
                lines += 1
    return text, lines


def test_concurrent_clients_each_get_their_own_solo_text(server_url):
    lengths = [40, 25, 60, 10, 33, 50]
    solo = [streamed_text(server_url, p, n) for p, n in zip(PROMPTS, lengths)]
    results: dict[int, tuple[str, int]] = {}

    def client(i):
        time.sleep(0.05 * i)  # staggered arrivals
        results[i] = streamed_text(server_url, PROMPTS[i], lengths[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    pings = []
    while any(t.is_alive() for t in threads):
        pings.append(httpx.get(server_url + "/ping", timeout=5).status_code)
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(PROMPTS))] == solo
    assert [r[1] for r in solo] == lengths  # one line per decode step, as many as asked
    assert pings and set(pings) == {200}


def test_a_client_that_leaves_is_dropped_from_the_batch(tiny_model_dir):
    server = ServerProcess(tiny_model_dir).wait_ready(timeout=120)
    try:
        with httpx.stream("POST", server.url + "/invocations", timeout=60,
                          json={"inputs": "Hello", "parameters": {"max_new_tokens": 250}}) as response:
            lines = response.iter_lines()
            next(lines)
            next(lines)
        # the connection is closed here, long before 250 tokens
        # the scheduler's line and the request's access-log line (written when its handler
        # returns, on the event loop) come in either order
        deadline = time.monotonic() + 30
        while not all(line in server.logs() for line in (
                "dropped 1 cancelled request(s) from the batch; 0 row(s) remain",
                "client-disconnected")):
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.1)
        # and the server goes on serving
        assert streamed_text(server.url, "Hi", 3)[1] == 3
    finally:
        server.stop()
