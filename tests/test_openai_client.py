"""The real ``openai`` SDK against a real ``djl-stream serve``: chat completions and
completions, streaming and not, on the tiny model (and greedy chat on the embedded one).

Every client is made as a user makes it, ``openai.OpenAI(base_url=server.url + "/v1",
api_key="x")``, with retries off so that each test sees the server's first answer.
"""

from __future__ import annotations

import shutil

import openai
import pytest
from server_process import ServerProcess, serving

HI = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


def chat_prompt_tokens(tokenizer, messages) -> int:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(prompt)["input_ids"])


# -- chat completions --------------------------------------------------------------------


def test_a_chat_completion_with_usage_and_logprobs(client, tiny_model_dir, smollm2_tokenizer):
    answer = client.chat.completions.create(model="tiny", messages=HI, max_tokens=6,
                                            temperature=0, logprobs=True, top_logprobs=3)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.model == tiny_model_dir.name
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    usage = answer.usage
    assert usage.prompt_tokens == chat_prompt_tokens(smollm2_tokenizer, HI)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    content = choice.logprobs.content
    assert content and len(content) <= usage.completion_tokens <= 6
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        ranked = [top.logprob for top in entry.top_logprobs]
        assert ranked == sorted(ranked, reverse=True)
        # greedy: the chosen token is the most likely one
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, ranked[0])
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == choice.message.content


def test_a_streamed_chat_completion_adds_up_to_the_whole_one(client):
    params = dict(model="tiny", messages=HI, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_n_choices_streamed_and_not(client):
    answer = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, n=2,
                                            temperature=0)
    assert [choice.index for choice in answer.choices] == [0, 1]
    # greedy: both choices are the same text
    assert answer.choices[0].message.content == answer.choices[1].message.content
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=4,
                                                 n=2, temperature=0, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks
                     if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [answer.choices[0].message.content] * 2


# -- completions -------------------------------------------------------------------------


def test_a_completion_with_legacy_logprobs(client, smollm2_tokenizer):
    answer = client.completions.create(model="tiny", prompt=["Once upon a time", "Hi"],
                                       max_tokens=5, temperature=0, logprobs=2)
    assert answer.object == "text_completion" and len(answer.choices) == 2
    assert answer.usage.prompt_tokens == sum(
        len(smollm2_tokenizer(p)["input_ids"]) for p in ("Once upon a time", "Hi"))
    for choice in answer.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset)
        assert "".join(logprobs.tokens) == choice.text
        assert logprobs.text_offset == sorted(logprobs.text_offset)
        for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                       logprobs.top_logprobs):
            assert top[token] == logprob and len(top) <= 3


def test_a_streamed_completion_adds_up_to_the_whole_one(client):
    params = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    whole = client.completions.create(**params)
    chunks = list(client.completions.create(**params, stream=True))
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_stop_string_ends_the_text_before_it(client):
    params = dict(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    text = client.completions.create(**params).choices[0].text
    # a stop string from the middle of the greedy text, found nowhere before
    stop = next(text[k:k + 3] for k in range(1, len(text) - 3)
                if text.find(text[k:k + 3]) == k and text[k:k + 3].strip())
    stopped = client.completions.create(**params, stop=[stop]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (text[:text.find(stop)], "stop")


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("params, param, message", [
    ({"max_tokens": 1000}, "max_tokens", "max_tokens must be at most 256, got 1000"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be at most 2, got 2.5"),
    ({"tool_choice": "required"}, "tool_choice",
     "tool_choice 'required' needs tools, and the request offers none"),
    ({"extra_body": {"top_q": 0.5}}, "top_q", "top_q is not a known parameter; did you mean top_"),
    ({"n": 40}, "n", "n (40) is 40 sequences; the limit (option.max_rolling_batch_size) is 32"),
])
def test_a_bad_request_raises_the_sdks_bad_request_error_with_our_message(client, params,
                                                                         param, message):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny", messages=HI, **params)
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param
    assert raised.value.body["message"].startswith(message)
    assert raised.value.body["type"] == "invalid_request_error"


def test_the_models_route_names_what_answers_say(client, tiny_model_dir):
    assert [model.id for model in client.models.list()] == [tiny_model_dir.name]


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


def test_a_failing_generation_raises_in_the_sdk(tmp_path, tiny_model_dir):
    directory = tmp_path / "failing"
    shutil.copytree(tiny_model_dir, directory)
    with open(directory / "model.py", "a") as f:
        f.write(FAILING_ENGINE)
    with open(directory / "serving.properties", "a") as f:
        f.write("option.stream_engine=Fails-after-two\n")
    with serving(directory) as process:
        client = client_of(process)
        stream = client.chat.completions.create(model="m", messages=HI, stream=True)
        received = []
        with pytest.raises(openai.APIError, match="RuntimeError: device lost"):
            for chunk in stream:
                received.append(chunk.choices[0].delta.content)
        assert received == ["a", "b"]
        # before the first chunk: an error status, not a stream
        with pytest.raises(openai.APIStatusError) as raised:
            client.completions.create(model="m", prompt="fail at once")
        assert raised.value.status_code == 424
        assert raised.value.body == {"message": "cannot prefill", "type": "server_error",
                                     "param": None, "code": "generation_failed"}


# -- the embedded model ------------------------------------------------------------------


@pytest.mark.embedded
def test_greedy_chat_says_what_the_djl_route_says_for_the_same_prompt(embedded_model_dir):
    import httpx

    prompt = "What is the capital of France?"
    with serving(embedded_model_dir) as process:
        # model/ wraps inputs in the chat template as one user turn (apply_chat_template=auto)
        djl = httpx.post(process.url + "/invocations", timeout=120, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 32}, "stream": False})
        client = client_of(process)
        messages = [{"role": "user", "content": prompt}]
        answer = client.chat.completions.create(model="model", messages=messages,
                                                max_tokens=32, temperature=0, logprobs=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           client.chat.completions.create(model="model", messages=messages,
                                                          max_tokens=32, temperature=0,
                                                          stream=True))
    text = djl.json()["generated_text"]
    assert "Paris" in text
    assert answer.choices[0].message.content == streamed == text
    # SmolLM2 ends its turn itself: a stop, whose end-of-turn token counts but shows no text
    assert answer.choices[0].finish_reason == "stop"
    assert len(answer.choices[0].logprobs.content) == answer.usage.completion_tokens - 1
