"""huggingface_hub's ``InferenceClient.text_generation`` against a real ``djl-stream serve``:
the tiny random model for the protocol's behaviour, the embedded SmolLM2 for real text
(greedy output equal to djl-serving's route, end-of-sequence finishes)."""

from __future__ import annotations

import json
import math
import re

import pytest
from huggingface_hub import InferenceClient, TextGenerationOutput
from huggingface_hub.errors import ValidationError
from server_process import ServerProcess, serving

PROMPT = "Paris is"
#: The random tiny model repeats itself under greedy decoding; a penalty makes its tokens
#: differ, so that texts adding up and stop strings test something.
VARIED = {"repetition_penalty": 2.0}


def djl_text(server: ServerProcess, prompt: str, max_new_tokens: int) -> str:
    """What djl-serving's own route generates for ``prompt`` (greedy)."""
    response = server.http.post("/invocations", json={
        "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}, "stream": False},
        timeout=120)  # a deadline only: a busy machine generates slowly
    assert response.status_code == 200, response.text
    return response.json()["generated_text"]


def stream_details(client: InferenceClient, prompt: str, **kwargs):
    return list(client.text_generation(prompt, stream=True, details=True, **kwargs))


def assert_adds_up(outputs) -> None:
    """Indexes count from 1, only the last event carries text and details, and the token
    texts add up to that text."""
    assert [o.index for o in outputs] == list(range(1, len(outputs) + 1))
    assert all(o.generated_text is None and o.details is None for o in outputs[:-1])
    assert "".join(o.token.text for o in outputs) == outputs[-1].generated_text
    assert outputs[-1].details.generated_tokens == len(outputs)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server) -> InferenceClient:
    return InferenceClient(base_url=server.url, timeout=60)


def test_text_generation_returns_what_the_djl_route_generates(server, client):
    assert client.text_generation(PROMPT, max_new_tokens=8) == djl_text(server, PROMPT, 8)


def test_a_detailed_stream_adds_up_and_ends_at_the_length(client):
    outputs = stream_details(client, PROMPT, max_new_tokens=8, **VARIED)
    assert len(outputs) == 8
    assert_adds_up(outputs)
    assert len({o.token.id for o in outputs}) > 1  # the penalty did make tokens differ
    last = outputs[-1].details
    assert (last.finish_reason, last.generated_tokens, last.seed) == ("length", 8, None)
    assert last.input_length == 2  # "Paris is": two tokens of the SmolLM2 tokenizer
    assert not any(o.token.special for o in outputs)


def test_streamed_non_streamed_and_detailed_answers_agree(client):
    text = client.text_generation(PROMPT, max_new_tokens=8, **VARIED)
    pieces = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, **VARIED))
    detailed = client.text_generation(PROMPT, max_new_tokens=8, details=True, **VARIED)
    streamed = stream_details(client, PROMPT, max_new_tokens=8, **VARIED)
    assert isinstance(detailed, TextGenerationOutput)
    assert "".join(pieces) == text == detailed.generated_text == streamed[-1].generated_text
    assert [t.id for t in detailed.details.tokens] == [o.token.id for o in streamed]
    assert [t.text for t in detailed.details.tokens] == pieces
    assert detailed.details.prefill == []
    assert (detailed.details.finish_reason, detailed.details.generated_tokens) == ("length", 8)


def test_each_token_carries_its_logprob_and_greedy_picks_the_top_one(client):
    outputs = stream_details(client, PROMPT, max_new_tokens=6, top_n_tokens=3)
    for output in outputs:
        assert math.isfinite(output.token.logprob) and output.token.logprob < 0
        top = output.top_tokens
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # no penalty: greedy decoding is the argmax of the very logits the logprobs come from
        assert (top[0].id, top[0].logprob) == (output.token.id, output.token.logprob)
    detailed = client.text_generation(PROMPT, max_new_tokens=6, details=True, top_n_tokens=3)
    assert [t.logprob for t in detailed.details.tokens] == [o.token.logprob for o in outputs]
    # huggingface_hub leaves the lists of lists as plain dicts
    assert [[t["id"] for t in top] for top in detailed.details.top_tokens] == \
        [[t.id for t in o.top_tokens] for o in outputs]


def test_a_stop_sequence_ends_the_text_before_it(client):
    full = client.text_generation(PROMPT, max_new_tokens=12, **VARIED)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    detailed = client.text_generation(PROMPT, max_new_tokens=12, stop=[stop], details=True,
                                      **VARIED)
    assert detailed.details.finish_reason == "stop_sequence"
    assert detailed.generated_text == full[:full.index(stop)]


def test_the_token_of_a_stop_string_is_neither_listed_nor_counted(client):
    full = client.text_generation(PROMPT, max_new_tokens=12, details=True, **VARIED)
    texts = [token.text for token in full.details.tokens]
    # a whole token's text, first seen at position k, as the stop string
    k = next(i for i, text in enumerate(texts) if i > 1 and text.strip()
             and text not in "".join(texts[:i]))
    detailed = client.text_generation(PROMPT, max_new_tokens=12, stop=[texts[k]],
                                      details=True, **VARIED)
    assert detailed.details.finish_reason == "stop_sequence"
    assert [token.text for token in detailed.details.tokens] == texts[:k]
    assert detailed.details.generated_tokens == k
    assert "".join(texts[:k]) == detailed.generated_text
    streamed = stream_details(client, PROMPT, max_new_tokens=12, stop=[texts[k]], **VARIED)
    assert streamed[-1].details.generated_tokens == k


def test_a_seed_replays_a_sampled_generation(client):
    drawn = stream_details(client, PROMPT, max_new_tokens=8, do_sample=True)
    seed = drawn[-1].details.seed
    assert isinstance(seed, int)
    replay = client.text_generation(PROMPT, max_new_tokens=8, details=True, seed=seed,
                                    do_sample=True)
    assert replay.details.seed == seed
    assert replay.generated_text == drawn[-1].generated_text


def test_return_full_text_prepends_the_prompt(client):
    text = client.text_generation(PROMPT, max_new_tokens=4)
    assert client.text_generation(PROMPT, max_new_tokens=4, return_full_text=True) == PROMPT + text


@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_parameter_raises_the_clients_error_with_our_message(client, stream):
    with pytest.raises(ValidationError, match=r"parameters\.watermark is not supported"):
        answer = client.text_generation(PROMPT, max_new_tokens=4, stream=stream, watermark=True)
        list(answer) if stream else None
    with pytest.raises(ValidationError, match=r"parameters\.max_new_tokens must be at most 256"):
        client.text_generation(PROMPT, max_new_tokens=1000, stream=stream)


def test_the_routes_on_the_wire(server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    generate = server.http.post("/generate", json=body, timeout=60)
    assert generate.status_code == 200
    assert generate.headers["content-type"] == "application/json"
    assert set(generate.json()) == {"generated_text"}
    compat = server.http.post("/", json=body, timeout=60)
    assert compat.json() == [generate.json()]
    stream = server.http.post("/generate_stream", json=body, timeout=60)
    assert stream.headers["content-type"] == "text/event-stream"
    records = stream.text.split("\n\n")
    assert records[-1] == "" and all(r.startswith("data:{") for r in records[:-1])
    events = [json.loads(r[len("data:"):]) for r in records[:-1]]
    assert [e["index"] for e in events] == [1, 2, 3]
    assert events[-1]["generated_text"] == generate.json()["generated_text"]


def test_a_bad_request_is_tgis_422_and_a_mismatched_stream_flag_names_the_route(server):
    refused = server.http.post("/generate", json={"inputs": PROMPT, "stream": True})
    assert refused.status_code == 422
    assert refused.json()["error_type"] == "validation"
    assert "POST /generate_stream" in refused.json()["error"]
    too_long = server.http.post("/generate", json={"inputs": "word " * 100})
    assert too_long.status_code == 422
    assert re.search(r"inputs is \d+ tokens long; the limit \(option.max_input_length\) is 64",
                     too_long.json()["error"])


# -- the embedded SmolLM2 --------------------------------------------------------------

CAPITAL = "What is the capital of France?"


@pytest.fixture(scope="module")
def embedded(embedded_model_dir):
    with serving(embedded_model_dir) as process:
        yield process


@pytest.mark.embedded
def test_the_embedded_model_answers_as_the_djl_route_and_ends_at_eos(embedded):
    client = InferenceClient(base_url=embedded.url, timeout=120)
    expected = djl_text(embedded, CAPITAL, 48)
    assert "Paris" in expected
    assert client.text_generation(CAPITAL, max_new_tokens=48) == expected
    outputs = stream_details(client, CAPITAL, max_new_tokens=48)
    assert_adds_up(outputs)
    assert outputs[-1].generated_text == expected
    assert outputs[-1].details.finish_reason == "eos_token"
    assert len(outputs) < 48
    # the end-of-sequence token is the last token, special, and adds no text
    assert outputs[-1].token.special and outputs[-1].token.text == ""
    assert not any(o.token.special for o in outputs[:-1])
    assert all(math.isfinite(o.token.logprob) and o.token.logprob <= 0 for o in outputs)


@pytest.mark.embedded
def test_the_embedded_model_stops_at_the_length(embedded):
    client = InferenceClient(base_url=embedded.url, timeout=120)
    detailed = client.text_generation(CAPITAL, max_new_tokens=3, details=True)
    assert (detailed.details.finish_reason, detailed.details.generated_tokens) == ("length", 3)
    assert detailed.generated_text == djl_text(embedded, CAPITAL, 3)
