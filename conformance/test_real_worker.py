"""model/ in djl-serving's real Python worker, as an HTTP client sees it, and djl-stream serve
answering the same.

Every scenario runs on every target of :mod:`targets`: the real worker of djl-serving
0.33 (the LMI image's) and 0.30 (the Neuron image's) in the synchronous mode, the 0.33
worker in async mode, and ``djl-stream serve``. Each test checks what the answer must be,
then that ``djl-stream serve`` answers byte for byte what djl-serving 0.33 answers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import pytest

from djl_frontend import DjlWorker
from targets import ALL, ASYNC_033, LOCAL, REAL, SYNC_030, SYNC_033, Fleet

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def embedded(djl_src, embedded_dir):
    fleet = Fleet(embedded_dir, djl_src)
    yield fleet
    fleet.stop()


@pytest.fixture(scope="module")
def tiny(djl_src, tiny_dir):
    fleet = Fleet(tiny_dir, djl_src)
    yield fleet
    fleet.stop()


def assert_same_answer(answers, reference=SYNC_033, targets=(SYNC_030, LOCAL)):
    """The answers of ``targets`` equal the reference's: status, content type and body."""
    expected = answers[reference]
    for target in targets:
        got = answers[target]
        assert (got.status, got.content_type, got.body) == \
            (expected.status, expected.content_type, expected.body), target.name


def output_tokens(answer):
    """The ``output_tokens`` lists of a JSON-lines stream, one per line."""
    records = [json.loads(line) for line in answer.lines()]
    assert all(set(record) == {"output_tokens"} for record in records), records
    return [record["output_tokens"] for record in records]


@pytest.fixture(scope="module")
def greedy_reference(embedded_dir):
    """transformers' own greedy generate() for PROMPT (as one chat turn, the way
    model/ wraps plain inputs): the new token ids and their text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(embedded_dir))
    model = AutoModelForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    return new, tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("target", REAL, ids=lambda t: t.name)
def test_the_init_call_succeeds_with_djl_servings_own_keys(embedded, target):
    worker = embedded[target].worker
    assert worker.init_output.code == 204  # handle() returned None
    # what broke the first release: engine=Python reaches the handler, as djl sends it
    assert worker.config.init_properties["engine"] == "Python"


def test_streaming_gives_one_line_per_decode_step(embedded, greedy_reference):
    new_ids, text = greedy_reference
    answers = embedded.ask_all({"inputs": PROMPT, "parameters": {"max_new_tokens": 12},
                                "stream": True})
    for target, answer in answers.items():
        assert answer.status == 200, (target.name, answer.body)
        assert answer.content_type == "application/jsonlines"
        assert answer.chunked
        steps = output_tokens(answer)
        assert all(len(step) == 1 for step in steps)
        assert len(steps) == len(new_ids), target.name  # one line per generated token
        assert "".join(step[0] for step in steps) == text
    assert answers[ASYNC_033].body == answers[SYNC_033].body
    assert_same_answer(answers)


def test_non_streaming_answers_the_whole_text(embedded, greedy_reference):
    _, text = greedy_reference
    answers = embedded.ask_all({"inputs": PROMPT, "parameters": {"max_new_tokens": 12},
                                "stream": False})
    for target, answer in answers.items():
        assert (answer.status, answer.content_type) == (200, "application/json"), target.name
        assert not answer.chunked
        assert answer.json() == {"generated_text": text}
    assert_same_answer(answers, targets=(SYNC_030, ASYNC_033, LOCAL))


def test_a_bad_request_is_a_400_naming_the_field_and_the_limit(embedded):
    answers = embedded.ask_all({"inputs": PROMPT, "parameters": {"max_new_tokens": 100000}})
    message = "parameters.max_new_tokens must be at most 2048, got 100000"
    for target in (SYNC_033, SYNC_030, LOCAL):
        error = answers[target].json()
        assert answers[target].status == 400
        assert (error["field"], error["message"]) == ("parameters.max_new_tokens", message)
    # async mode: djl's front end answers {"code", "error"} from the async map's fields
    assert answers[ASYNC_033].status == 400
    assert answers[ASYNC_033].json() == {"code": 400, "error": message}
    assert_same_answer(answers)


def test_messages_go_through_the_chat_template(embedded, greedy_reference, djl_src,
                                              embedded_dir):
    _, text = greedy_reference
    # A messages body is an OpenAI chat completion, as LMI answers one...
    answers = embedded.ask_all({"messages": [{"role": "user", "content": PROMPT}],
                                "max_tokens": 12, "temperature": 0})
    for target, answer in answers.items():
        assert answer.json()["choices"][0]["message"]["content"] == text, target.name
    # ...and djl's answer with option.chat_protocol=djl.
    fleet = Fleet(embedded_dir, djl_src, {"OPTION_CHAT_PROTOCOL": "djl"})
    try:
        answers = fleet.ask_all({"messages": [{"role": "user", "content": PROMPT}],
                                 "parameters": {"max_new_tokens": 12}, "stream": False},
                                targets=(SYNC_033, LOCAL))
    finally:
        fleet.stop()
    for target, answer in answers.items():
        assert answer.json() == {"generated_text": text}, target.name
    assert_same_answer(answers, targets=(LOCAL,))


def normalised(answer):
    """``answer`` with its ids and creation times (which differ per answer) replaced."""
    body = re.sub(rb'"id":"chatcmpl-[0-9a-f]{32}"', b'"id":"chatcmpl-ID"', answer.body)
    body = re.sub(rb'"created":[0-9]+', b'"created":0', body)
    return dataclasses.replace(answer, chunks=[body])


def sse_records(answer):
    """The JSON records of a server-sent-events body that ends with ``data: [DONE]``."""
    events = [event for event in answer.body.decode("utf-8").split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), events
    assert events[-1] == "data: [DONE]"
    return [json.loads(event[len("data: "):]) for event in events[:-1]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_openai_chat_body_is_a_chat_completion_on_every_target(embedded, greedy_reference,
                                                                 stream):
    """What an OpenAI client posting to /invocations gets (LMI 0.33's front end also sends
    /v1/chat/completions there): the same chat completion from every worker, the same
    bytes from djl-stream serve as from djl-serving 0.33 but for ids and times."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    new_ids, text = greedy_reference
    finish = "stop" if new_ids[-1] == 2 else "length"  # 2: SmolLM2's <|im_end|>
    body = {"model": "model", "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 12, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    answers = embedded.ask_all(body)
    for target, answer in answers.items():
        assert answer.status == 200, (target.name, answer.body)
        if stream:
            assert answer.content_type == "text/event-stream", target.name
            records = sse_records(answer)
            chunks = [ChatCompletionChunk.model_validate(record) for record in records]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text
            assert chunks[-2].choices[0].finish_reason == finish
            usage = chunks[-1].usage
        else:
            assert answer.content_type == "application/json", target.name
            completion = ChatCompletion.model_validate(answer.json())
            assert completion.choices[0].message.content == text
            assert completion.choices[0].finish_reason == finish
            usage = completion.usage
        assert usage.completion_tokens == len(new_ids), target.name
    answers = {target: normalised(answer) for target, answer in answers.items()}
    assert_same_answer(answers, targets=(SYNC_030, ASYNC_033, LOCAL))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_is_read_back_on_every_target(embedded, stream):
    """A chat body with tools, through the real workers: the call comes back as OpenAI's
    tool_calls, the same from every target but for ids and times."""
    body = {"model": "model", "stream": stream, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "What's the weather like in Paris today?"}],
            "tools": [WEATHER], "tool_choice": "required"}
    answers = embedded.ask_all(body)
    for target, answer in answers.items():
        assert answer.status == 200, (target.name, answer.body)
        if stream:
            deltas = [(record["choices"][0]["delta"], record["choices"][0]["finish_reason"])
                      for record in sse_records(answer)]
            calls = [call for delta, _ in deltas for call in delta.get("tool_calls", ())]
            finish = deltas[-1][1]
        else:
            choice = answer.json()["choices"][0]
            calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
        assert finish == "tool_calls", target.name
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls] == [("get_weather", {"city": "Paris"})], target.name
    call_ids = re.compile(rb'"id":"[A-Za-z0-9]{9}"')
    answers = {target: dataclasses.replace(
        normalised(answer), chunks=[call_ids.sub(b'"id":"CALL"', normalised(answer).body)])
        for target, answer in answers.items()}
    assert_same_answer(answers, targets=(SYNC_030, ASYNC_033, LOCAL))


def test_several_prompts_stream_side_by_side(tiny):
    body = {"inputs": ["Hello there", "Once upon a time"], "parameters": {"max_new_tokens": 6}}
    streamed = tiny.ask_all({**body, "stream": True})
    whole = tiny.ask_all({**body, "stream": False})
    for target in ALL:
        steps = output_tokens(streamed[target])
        assert all(len(step) == 2 for step in steps), target.name
        texts = ["".join(step[i] for step in steps) for i in range(2)]
        assert whole[target].json() == {"generated_text": texts}, target.name
    assert_same_answer(streamed, targets=(SYNC_030, ASYNC_033, LOCAL))
    assert_same_answer(whole)


def test_an_error_before_the_first_item_is_a_424(tiny):
    answers = tiny.ask_all({"inputs": "fail at 0", "stream": True})
    for target in (SYNC_033, SYNC_030, LOCAL):
        assert answers[target].status == 424, (target.name, answers[target].body)
        assert answers[target].json() == {"code": 424, "message": "invoke handler failure",
                                          "error": "injected failure at step 0"}
    assert answers[ASYNC_033].status == 424
    assert answers[ASYNC_033].json() == {"code": 424, "error": "injected failure at step 0"}
    assert_same_answer(answers)


def test_an_error_mid_stream_ends_it_with_one_error_line(tiny):
    answers = tiny.ask_all({"inputs": "fail at 2", "stream": True})
    for target, answer in answers.items():
        assert answer.status == 200, target.name
        records = [json.loads(line) for line in answer.lines()]
        assert len(records) == 3 and all("output_tokens" in r for r in records[:2])
        assert records[2] == {"error": "RuntimeError: injected failure at step 2"}
    assert_same_answer(answers, targets=(SYNC_030, ASYNC_033, LOCAL))


@pytest.mark.parametrize("formatter, content_type", [("upper_lines", "text/plain"),
                                                     ("sse", "text/event-stream")])
def test_output_formatters_from_model_py_and_built_in(djl_src, tiny_dir, formatter, content_type):
    fleet = Fleet(tiny_dir, djl_src, {"OPTION_OUTPUT_FORMATTER": formatter})
    try:
        answers = fleet.ask_all({"inputs": "Hello there", "parameters": {"max_new_tokens": 6},
                                 "stream": True})
        plain = fleet[SYNC_033].ask({"inputs": "Hello there", "parameters": {"max_new_tokens": 6},
                                     "stream": False}).json()["generated_text"]
    finally:
        fleet.stop()
    for target, answer in answers.items():
        assert (answer.status, answer.content_type) == (200, content_type), target.name
    body = answers[SYNC_033].body.decode()
    if formatter == "sse":
        events = [event for event in body.split("\n\n") if event]
        assert all(event.startswith("data: ") for event in events)
        assert "".join(json.loads(e[len("data: "):])["output_tokens"][0] for e in events) == plain
    else:
        assert body.endswith("\n") and body.replace("\n", "") == plain.upper().replace("\n", "")
    assert_same_answer(answers, targets=(SYNC_030, ASYNC_033, LOCAL))


def test_async_mode_as_lmi_starts_it_serves_concurrent_streams(djl_src, tiny_dir, tmp_path):
    """What LMI images start when SERVING_FEATURES=vllm and serving.properties names no entry
    point: the 0.33 worker in async mode, awaiting handle(). Concurrent requests overlap
    there, and each still gets exactly its own text."""
    import shutil

    directory = tmp_path / "no-entry-point"
    shutil.copytree(tiny_dir, directory)
    properties = directory / "serving.properties"
    properties.write_text(properties.read_text().replace("option.entryPoint=model.py\n", ""))
    prompts = ["Hello there", "Once upon a time", "The weather today", "In a galaxy"]
    solo = Fleet(tiny_dir, djl_src)
    worker = DjlWorker(djl_src, "0.33.0-dlc", directory, {"SERVING_FEATURES": "vllm"})
    try:
        expected = [solo[SYNC_033].ask({"inputs": p, "parameters": {"max_new_tokens": 8},
                                        "stream": True}).body for p in prompts]
        worker.start()
        assert worker.async_mode
        assert worker.config.recommended_entry_point == "djl_python.lmi_vllm.vllm_async_service"
        got = [None] * len(prompts)

        def ask(i):
            got[i] = worker.invoke({"inputs": prompts[i], "parameters": {"max_new_tokens": 8},
                                    "stream": True}).body

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    finally:
        solo.stop()
        worker.stop()
    assert got == expected
