"""End to end: `djl-stream serve model/` on the embedded SmolLM2, streamed over real HTTP.

The server runs as its own process on a free loopback port, exactly as `make serve` runs it.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.embedded

CAPITAL = "What is the capital of France?"
COLOUR = "Name a primary colour."


@pytest.fixture(scope="module")
def server(embedded_model_dir):
    process = ServerProcess(embedded_model_dir)
    try:
        # a deadline, not a speed target: the machine that runs the tests may be busy
        yield process.wait_ready(timeout=300)
    finally:
        process.stop()


def stream(server, body):
    """POST body; return (response, [(arrival time, parsed line), ...], end time)."""
    lines = []
    start = time.monotonic()
    with httpx.stream("POST", server.url + "/invocations", json=body, timeout=120) as response:
        buffer = b""
        for chunk in response.iter_raw():
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                lines.append((time.monotonic() - start, json.loads(line)))
    return response, lines, time.monotonic() - start


def text_of(lines, index=0):
    return "".join(record["output_tokens"][index] for _, record in lines)


def generated(server, body):
    response = httpx.post(server.url + "/invocations", json={**body, "stream": False}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def test_tokens_arrive_one_decode_iteration_at_a_time(server):
    body = {"inputs": [CAPITAL, COLOUR], "parameters": {"max_new_tokens": 32}}
    response, lines, total = stream(server, body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/jsonlines"
    assert response.headers.get("transfer-encoding") == "chunked"
    assert len(lines) > 5
    assert all(len(record["output_tokens"]) == 2 for _, record in lines)


def test_greedy_capital_of_france_mentions_paris(server):
    _, lines, _ = stream(server, {"inputs": CAPITAL, "parameters": {"max_new_tokens": 32}})
    assert "Paris" in text_of(lines)
    # a messages body is an OpenAI chat completion (option.chat_protocol=openai)
    chat = httpx.post(server.url + "/invocations", timeout=120,
                      json={"messages": [{"role": "user", "content": CAPITAL}],
                            "max_tokens": 32, "temperature": 0})
    assert "Paris" in chat.json()["choices"][0]["message"]["content"]


def test_batched_prompts_give_the_same_text_as_each_prompt_alone(server):
    prompts = [CAPITAL, COLOUR, "Write a haiku about the sea."]
    together = generated(server, {"inputs": prompts, "parameters": {"max_new_tokens": 24}})
    alone = [generated(server, {"inputs": p, "parameters": {"max_new_tokens": 24}}) for p in prompts]
    assert together == alone
    _, lines, _ = stream(server, {"inputs": prompts, "parameters": {"max_new_tokens": 24}})
    assert [text_of(lines, i) for i in range(3)] == alone


def test_emoji_and_accents_stream_intact(server):
    body = {"inputs": "Reply with three emoji that describe the ocean, and the French word for sea.",
            "parameters": {"max_new_tokens": 40}}
    _, lines, _ = stream(server, body)
    streamed = text_of(lines)
    assert "\ufffd" not in streamed
    assert streamed == generated(server, body)


def test_a_bad_request_gets_400_and_the_next_request_still_works(server):
    response = httpx.post(server.url + "/invocations",
                          json={"inputs": CAPITAL, "parameters": {"max_new_tokens": 100000}}, timeout=30)
    assert response.status_code == 400
    error = response.json()
    assert error["field"] == "parameters.max_new_tokens"
    assert "2048" in error["message"]
    assert "Paris" in generated(server, {"inputs": CAPITAL, "parameters": {"max_new_tokens": 16}})


def test_predictions_route_and_ping(server):
    assert httpx.get(server.url + "/ping", timeout=60).status_code == 200
    response = httpx.post(server.url + "/predictions/model", timeout=120,
                          json={"inputs": CAPITAL, "parameters": {"max_new_tokens": 8}, "stream": False})
    assert response.status_code == 200
    assert response.json()["generated_text"].startswith("The capital of France")
