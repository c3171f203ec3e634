"""Many clients at once over real HTTP: streams share decode steps, nothing is mixed up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

PROMPTS = ["Hi", "The quick brown fox", "Once upon a time there was", "A", "Colours", "One two three four"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("log") / "server.log", "w+")
    process = subprocess.Popen([sys.executable, "-m", "djl_stream", "serve", str(tiny_model_dir), "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, "server exited"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()


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
    start = time.monotonic()
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
