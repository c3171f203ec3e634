"""``/ws/chat`` with the real ``websockets`` client, the way the Ray Serve guide's chatbot
client is written: connect, send a turn, read until the end of the turn, send the next.
The tiny random model's text means nothing, so memory is shown by equality: a second turn's
answer is the answer to the whole conversation sent at once over HTTP. Answers are sampled
with a seed (reproducible alone or batched): the tiny model's greedy answers to a chat
prompt are blank lines, which a conversation cannot carry."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from websockets.sync.client import connect

from server_process import ServerProcess

SEEDED = {"max_new_tokens": 8, "do_sample": True, "seed": 7}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = ServerProcess(tiny_model_dir).wait_ready(timeout=120)
    yield process
    process.stop()


def socket_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/ws/chat"


def read_turn(socket) -> tuple[str, dict]:
    """The answer's text, and the message that ended the turn (its end or its error)."""
    text = ""
    while True:
        message = json.loads(socket.recv(timeout=120))
        if message["type"] != "token":
            return text, message
        text += message["text"]


def chat(socket, content, **parameters) -> tuple[str, dict]:
    socket.send(json.dumps({"content": content, "parameters": {**SEEDED, **parameters}}))
    return read_turn(socket)


def http_answer(server, messages, **parameters) -> str:
    """The djl protocol's answer to ``messages`` over HTTP, not streamed."""
    response = httpx.post(server.url + "/invocations", timeout=120, json={
        "messages": messages, "stream": False, "parameters": {**SEEDED, **parameters}},
        headers={"djl_stream_protocol": "djl"})
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def test_plain_text_is_a_user_turn_answered_token_by_token(server):
    with connect(socket_url(server)) as socket:
        socket.send("Space the final")
        tokens = []
        while (message := json.loads(socket.recv(timeout=120)))["type"] == "token":
            tokens.append(message["text"])
    assert message["type"] == "end" and message["finish_reason"] in ("length", "eos_token")
    assert message["generated_tokens"] == len(tokens) >= 1 and message["dropped_turns"] == 0
    assert message["prompt_tokens"] > 0


def test_a_second_turn_is_answered_with_the_first_in_its_history(server):
    with connect(socket_url(server)) as socket:
        first, end = chat(socket, "Space the final")
        second, second_end = chat(socket, "frontier", max_new_tokens=16)
    history = [{"role": "user", "content": "Space the final"},
               {"role": "assistant", "content": first},
               {"role": "user", "content": "frontier"}]
    assert first.strip() and first == http_answer(server, history[:1])
    assert second == http_answer(server, history, max_new_tokens=16)
    assert second_end["prompt_tokens"] > end["prompt_tokens"] + end["generated_tokens"]


@pytest.fixture(scope="module")
def embedded_server(embedded_model_dir):
    process = ServerProcess(embedded_model_dir).wait_ready(timeout=300)
    yield process
    process.stop()


def test_the_embedded_model_remembers_the_first_turn(embedded_server):
    with connect(socket_url(embedded_server)) as socket:
        chat(socket, "My name is Ada. Please remember it.", do_sample=False, max_new_tokens=24)
        answer, end = chat(socket, "What is my name?", do_sample=False, max_new_tokens=16)
    assert "Ada" in answer, answer
    assert end["finish_reason"] in ("eos_token", "length")


def test_concurrent_sockets_each_get_their_solo_greedy_text(embedded_server):
    prompts = ["What is the capital of France?", "Name a primary colour.", "Say hello.",
               "Count to three."]
    greedy = {"do_sample": False, "max_new_tokens": 12}
    solo = [http_answer(embedded_server, [{"role": "user", "content": p}], **greedy)
            for p in prompts]
    answers: dict[int, str] = {}

    def talk(i):
        with connect(socket_url(embedded_server)) as socket:
            answers[i], _ = chat(socket, prompts[i], **greedy)

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [answers[i] for i in range(len(prompts))] == solo
    assert len(set(solo)) == len(solo)


def test_a_bad_parameter_is_an_error_message_and_the_socket_stays_usable(server):
    with connect(socket_url(server)) as socket:
        text, error = chat(socket, "hello", top_p=3)
        assert text == "" and error["type"] == "error"
        assert (error["code"], error["field"]) == (400, "parameters.top_p")
        assert "at most 1" in error["message"]
        socket.send("not json {")  # (plain text: a turn)
        _, end = read_turn(socket)
        assert end["type"] == "end"
        socket.send('{"type": "dance"}')
        assert json.loads(socket.recv(timeout=60))["field"] == "type"
    with connect(socket_url(server)) as fresh:
        _, fresh_end = chat(fresh, "not json {")
    # the refused turn is not in the history: the next turn's prompt is a first turn's
    assert end["prompt_tokens"] == fresh_end["prompt_tokens"]


def running_rows(server) -> float:
    """The running rows, over every model the server names (one here)."""
    rows = [float(line.split()[-1])
            for line in httpx.get(server.url + "/metrics", timeout=30).text.splitlines()
            if line.startswith(("djl_stream_batch_rows ", "djl_stream_batch_rows{"))]
    assert rows, "no djl_stream_batch_rows gauge"
    return sum(rows)


def test_cancel_stops_the_running_turn(server):
    with connect(socket_url(server)) as socket:
        socket.send(json.dumps({"content": "Count", "parameters": {
            "max_new_tokens": 250, "ignore_eos": True}}))
        assert json.loads(socket.recv(timeout=120))["type"] == "token"
        socket.send('{"type": "cancel"}')
        text, end = read_turn(socket)
        assert end["type"] == "end" and end["finish_reason"] == "cancelled"
        assert end["generated_tokens"] < 250
        deadline = time.monotonic() + 30
        while running_rows(server) != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # and the conversation goes on, with the stopped answer in its history
        _, after = chat(socket, "again")
        assert after["type"] == "end" and after["finish_reason"] != "cancelled"


def test_a_new_turn_while_one_streams_stops_it_and_is_answered(server):
    with connect(socket_url(server)) as socket:
        socket.send(json.dumps({"content": "Count", "parameters": {
            "max_new_tokens": 250, "ignore_eos": True}}))
        assert json.loads(socket.recv(timeout=120))["type"] == "token"
        socket.send(json.dumps({"content": "Stop", "parameters": SEEDED}))
        _, stopped = read_turn(socket)
        assert stopped["finish_reason"] == "cancelled"
        _, answered = read_turn(socket)
        assert answered["type"] == "end" and answered["finish_reason"] != "cancelled"


def test_a_client_that_disconnects_frees_its_row(tiny_model_dir):
    server = ServerProcess(tiny_model_dir).wait_ready(timeout=120)
    try:
        with connect(socket_url(server)) as socket:
            socket.send(json.dumps({"content": "Count", "parameters": {
                "max_new_tokens": 250, "ignore_eos": True}}))
            socket.recv(timeout=120)
        deadline = time.monotonic() + 30
        while "dropped 1 cancelled request(s) from the batch; 0 row(s) remain" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.1)
    finally:
        server.stop()


def test_the_oldest_turns_are_dropped_when_the_history_outgrows_the_limit(server):
    # the tiny model directory's option.max_input_length is 64 tokens
    turn = "tell me more about " + "the sea " * 6
    with connect(socket_url(server)) as socket:
        socket.send(json.dumps({"system": "Be brief.", "content": turn, "parameters": SEEDED}))
        ends = [read_turn(socket)[1]]
        for _ in range(3):
            ends.append(chat(socket, turn)[1])
    assert all(end["type"] == "end" for end in ends), ends
    assert ends[0]["dropped_turns"] == 0 and max(e["dropped_turns"] for e in ends) >= 1
    assert all(end["prompt_tokens"] <= 64 for end in ends)


FAILING_ENGINE = """

from djl_stream import register_engine


@register_engine("Fails-after-two")
def fails_after_two(model, tokenizer, inputs, **parameters):
    if "at once" in inputs[0]:
        raise RuntimeError("cannot prefill")
    yield ["a" for _ in inputs]
    yield ["b" for _ in inputs]
    raise RuntimeError("device lost")
"""


def test_a_generation_that_fails_is_an_error_message_and_the_socket_goes_on(tmp_path,
                                                                           tiny_model_dir):
    import shutil

    directory = tmp_path / "failing"
    shutil.copytree(tiny_model_dir, directory)
    with open(directory / "model.py", "a") as f:
        f.write(FAILING_ENGINE)
    with open(directory / "serving.properties", "a") as f:
        f.write("option.stream_engine=Fails-after-two\n")
    server = ServerProcess(directory).wait_ready(timeout=120)
    try:
        with connect(socket_url(server)) as socket:
            midway, failed = chat(socket, "Hello")
            at_once, refused = chat(socket, "fail at once")
    finally:
        server.stop()
    assert (midway, failed["type"], failed["code"]) == ("ab", "error", 500), failed
    assert "device lost" in failed["message"]
    assert (at_once, refused["type"], refused["code"]) == ("", "error", 424), refused
    assert "cannot prefill" in refused["message"]
