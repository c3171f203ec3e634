"""OpenAI chat completions and completions: request parsing, and answers written from
hand-built Steps, checked against the openai SDK's own response types.

The last section goes through model.py's ``handle()`` on the tiny model: which protocol a
body selects, and what the service passes to the protocol (prompt lengths, limits).
"""

from __future__ import annotations

import json
import uuid

import pytest
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from djl_stream.generation.step import Generation, Step
from djl_stream.protocols.openai.protocol import ChatCompletionsProtocol, CompletionsProtocol
from djl_stream.protocols.openai.request import parse_chat, parse_completion
from djl_stream.protocols.openai.responses import TokenText
from djl_stream.protocols.protocol import EncodedStream, Failure, ParseContext
from djl_stream.protocols.validation import RequestError

HI = [{"role": "user", "content": "Hi"}]


def template(messages):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


CONTEXT = ParseContext(default_max_new_tokens=50, max_new_tokens_limit=256, max_batch_size=4,
                       model_name="smollm2", render_chat=template)


def chat(**body):
    return parse_chat({"model": "anything", "messages": HI, **body}, CONTEXT)


def completion(**body):
    return parse_completion({"model": "anything", "prompt": "Once", **body}, CONTEXT)


def refused(parse, **body) -> RequestError:
    with pytest.raises(RequestError) as raised:
        parse(**body)
    return raised.value


# -- parsing ----------------------------------------------------------------------------


def test_openais_defaults_sample_at_temperature_1_up_to_the_default_length():
    request = chat()
    params = request.parameters
    assert (params.do_sample, params.temperature, params.top_p) == (True, 1.0, 1.0)
    assert params.max_new_tokens == 50
    assert request.prompts == ("<user>Hi<assistant>",)
    assert request.stream is False  # OpenAI's default, whatever option.enable_streaming says


def test_temperature_0_is_greedy_and_the_other_parameters_map_to_the_engines():
    params = chat(temperature=0, top_p=0.5, max_completion_tokens=7, stop="\n", seed=3,
                  top_k=-1, repetition_penalty=1.2, min_tokens=2, ignore_eos=True).parameters
    assert (params.do_sample, params.max_new_tokens, params.stop, params.manual_seed) == \
        (False, 7, ("\n",), 3)
    assert (params.top_k, params.repetition_penalty, params.min_new_tokens, params.ignore_eos) \
        == (0, 1.2, 2, True)
    assert chat(temperature=0.7, max_tokens=9).parameters.as_kwargs()["temperature"] == 0.7


@pytest.mark.parametrize("body, field, words", [
    ({"max_tokens": 257}, "max_tokens", "max_tokens must be at most 256, got 257"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "must be at least 1, got 0"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "not both"),
    ({"temperature": 2.5}, "temperature", "temperature must be at most 2, got 2.5"),
    ({"top_p": 0}, "top_p", "top_p must be greater than 0, got 0"),
    ({"n": "2"}, "n", "n must be an integer, got \"2\" (a string)"),
    ({"n": 5}, "n", "n (5) is 5 sequences; the limit (option.max_rolling_batch_size) is 4"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be at most 2, got 2.5"),
    ({"logit_bias": {"hello": 1}}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": {"42": 101}}, "logit_bias.42", "must be at most 100, got 101"),
    ({"stop": [""]}, "stop[0]", "must not be empty"),
    ({"stop": ["a"] * 17}, "stop", "at most 16 entries, got 17"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20, got 21"),
    ({"top_logprobs": 2}, "top_logprobs", "needs \"logprobs\": true"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage",
     "not a known stream option"),
    ({"max_tokenz": 5}, "max_tokenz", "did you mean max_tokens?"),
    ({"parameters": {"max_new_tokens": 5}}, "parameters", "option.chat_protocol=djl"),
    ({"messages": []}, "messages", "messages must not be empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "messages[0].content must be a string or a list of text parts, got 5"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type", "must be one of 'text'"),
])
def test_a_bad_chat_request_is_refused_naming_the_field_and_the_limit(body, field, words):
    error = refused(chat, **body)
    assert error.field == field
    assert words in error.message


@pytest.mark.parametrize("field, value", [
    ("reasoning_effort", "low"),
    ("modalities", ["text", "audio"]), ("functions", [{"name": "f"}]),
])
def test_a_parameter_this_server_cannot_honour_is_refused_never_ignored(field, value):
    error = refused(chat, **{field: value})
    assert error.field == field
    assert error.message.startswith(f"{field} is not supported by this server")


def test_what_clients_send_by_default_is_accepted():
    request = chat(user="u1", stream_options=None, presence_penalty=0, frequency_penalty=0.0,
                   logit_bias={}, tools=[], tool_choice="none", response_format={"type": "text"},
                   metadata={"k": "v"}, store=False, parallel_tool_calls=True, n=1)
    assert request.prompts == ("<user>Hi<assistant>",)


def test_penalties_and_biases_reach_the_engine_and_n_seeded_choices_get_seeds_of_their_own():
    request = chat(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"42": 5, "7": -100},
                   n=3, seed=11)
    parameters = request.parameters
    assert (parameters.presence_penalty, parameters.frequency_penalty) == (0.5, -1.0)
    assert parameters.logit_bias == ((42, 5.0), (7, -100.0))
    assert parameters.manual_seed == (11, 12, 13)
    assert chat(seed=11).parameters.manual_seed == 11


def test_messages_reach_the_template_as_roles_and_strings_and_results_with_their_call_id():
    messages = [{"role": "developer", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}], "name": "ann"},
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    request = parse_chat({"messages": messages}, CONTEXT)
    assert request.messages == ({"role": "system", "content": "Be terse."},
                                {"role": "user", "content": "Hi\nthere"},
                                {"role": "assistant", "content": ""},
                                {"role": "tool", "content": "42", "tool_call_id": "call_1"})


def test_a_model_without_a_chat_template_refuses_messages():
    context = ParseContext(50, 256, 4, "m")
    with pytest.raises(RequestError, match="/v1/completions"):
        parse_chat({"messages": HI}, context)


def test_n_repeats_each_prompt_side_by_side():
    request = parse_completion({"prompt": ["a", "b"], "n": 2, "temperature": 0}, CONTEXT)
    assert request.prompts == ("a", "a", "b", "b")
    assert chat(n=3, temperature=0).prompts == ("<user>Hi<assistant>",) * 3
    error = refused(parse_completion, body={"prompt": ["a", "b", "c"], "n": 2}, context=CONTEXT)
    assert error.message == ("n (2) × 3 prompts is 6 sequences; the limit "
                             "(option.max_rolling_batch_size) is 4")


@pytest.mark.parametrize("body, field, words", [
    ({"prompt": [1, 2.5]}, "prompt[1]", "must be a token id"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": ["a", 5]}, "prompt", "not a mix of them"),
    ({"logprobs": 21}, "logprobs", "at most 20, got 21"),
    ({"logprobs": True}, "logprobs", "must be an integer"),
    ({"echo": True}, "echo", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"suffix": "end"}, "suffix", "not supported"),
])
def test_a_bad_completions_request_is_refused_naming_the_field(body, field, words):
    error = refused(parse_completion, body={"prompt": "Once", **body}, context=CONTEXT)
    assert error.field == field
    assert words in error.message


def test_completions_logprobs_ask_the_engine_for_that_many_alternatives():
    params = completion(logprobs=3).parameters
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    params = completion(logprobs=0).parameters
    assert (params.logprobs, params.top_logprobs) == (True, 0)
    assert completion().parameters.logprobs is False


# -- answers from hand-built steps -------------------------------------------------------


def gen(text, token_id=100, finish=None, logprob=None, top=(), special=False, row=0):
    return Generation(row, token_id, text, finish, logprob, tuple(top), special)


class FakeTokenizer:
    """Token ids as text: id 100 + k is the k-th letter; 2 is the end-of-sequence token."""

    def decode(self, ids, **kwargs):
        return "".join("<eos>" if i == 2 else chr(ord("a") + i - 100) for i in ids)

    def convert_ids_to_tokens(self, token_id):
        return self.decode([token_id])


def chat_protocol():
    return ChatCompletionsProtocol("smollm2", FakeTokenizer())


def sse_records(chunks):
    body = b"".join(chunks).decode()
    assert body.endswith("data: [DONE]\n\n")
    events = [event for event in body.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events)
    return [json.loads(event[len("data: "):]) for event in events[:-1]]


def test_a_chat_completion_is_what_the_sdk_parses():
    protocol = chat_protocol()
    request = chat(max_tokens=5, logprobs=True, top_logprobs=1)
    steps = [Step.of([gen("H", 107, logprob=-0.1, top=[(107, -0.1)])]),
             Step.of([gen("i", 108, logprob=-0.2, top=[(109, -0.05)])]),
             Step.of([gen("", 2, "eos", logprob=-0.3, special=True)])]
    body = protocol.complete(request, steps, [4])
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.model == "smollm2"
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].finish_reason == "stop"
    # the end-of-sequence token counts as generated but has no logprob entry: no text
    assert parsed.usage.model_dump(exclude_none=True) == \
        {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    content = parsed.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("h", -0.1, [104]),
                                                               ("i", -0.2, [105])]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == \
        [[("h", -0.1)], [("j", -0.05)]]


def test_finish_reasons_in_openais_words():
    protocol = chat_protocol()
    request = chat(n=3, temperature=0)
    steps = [Step.of([gen("a", row=0), gen("b", row=1), gen("c", row=2)]),
             Step.of([gen("", 2, "eos", row=0), gen("x", finish="stop", row=1),
                      gen("y", finish="length", row=2)])]
    body = protocol.complete(request, steps, [5, 5, 5])
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop", "length"]
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "bx", "cy"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    # n copies of one prompt: its tokens count once
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert body["choices"][0]["logprobs"] is None


def test_a_chat_stream_is_one_choice_per_chunk_with_the_role_first_then_usage_and_done():
    protocol = chat_protocol()
    request = chat(n=2, temperature=0, stream=True, stream_options={"include_usage": True})
    steps = [Step.of([gen("He", row=0), gen("", row=1)]),
             Step.of([gen("llo", row=0), gen("Yo", finish="length", row=1)]),
             Step.of([gen("", 2, "eos", special=True, row=0), None])]
    records = sse_records(EncodedStream(iter(steps), protocol.stream_encoder(request, [3, 3])))
    chunks = [ChatCompletionChunk.model_validate(record) for record in records]
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    seen = [(c.choices[0].index, c.choices[0].delta.role, c.choices[0].delta.content,
             c.choices[0].finish_reason) for c in chunks[:-1]]
    assert seen == [(0, "assistant", "He", None), (1, "assistant", "", None),
                    (0, None, "llo", None), (1, None, "Yo", "length"), (0, None, None, "stop")]
    assert all(record["usage"] is None for record in records[:-1])
    assert records[-1]["choices"] == []
    assert records[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5,
                                    "total_tokens": 8}


def test_without_include_usage_no_chunk_carries_usage():
    protocol = chat_protocol()
    request = chat(temperature=0, stream=True)
    records = sse_records(EncodedStream(iter([Step.of([gen("a", finish="length")])]),
                                        protocol.stream_encoder(request, [3])))
    assert len(records) == 1 and "usage" not in records[0]


def test_a_tokens_logprob_waits_for_the_text_it_belongs_to():
    # The second token's text is held back (half a character, or a possible stop string)
    # and released with the third: its logprob travels with that text.
    protocol = chat_protocol()
    request = chat(temperature=0, stream=True, logprobs=True)
    steps = [Step.of([gen("a", 100, logprob=-1.0)]), Step.of([gen("", 101, logprob=-2.0)]),
             Step.of([gen("bc", 102, "length", logprob=-3.0)])]
    records = sse_records(EncodedStream(iter(steps), protocol.stream_encoder(request, [3])))
    content = [[(e["token"], e["logprob"]) for e in r["choices"][0]["logprobs"]["content"]]
               for r in records]
    assert content == [[("a", -1.0)], [("b", -2.0), ("c", -3.0)]]
    assert "".join(r["choices"][0]["delta"].get("content", "") for r in records) == "abc"


def test_a_failure_mid_stream_ends_with_an_error_event_and_done():
    protocol = chat_protocol()
    request = chat(temperature=0, stream=True)

    def failing():
        yield Step.of([gen("a")])
        raise RuntimeError("device lost")

    body = b"".join(EncodedStream(failing(), protocol.stream_encoder(request, [3]))).decode()
    events = body.split("\n\n")
    assert json.loads(events[-3][len("data: "):]) == {"error": {
        "message": "RuntimeError: device lost", "type": "server_error", "param": None,
        "code": "generation_failed"}}
    assert events[-2] == "data: [DONE]"


def test_a_completion_in_the_legacy_logprobs_shape():
    protocol = CompletionsProtocol("smollm2", FakeTokenizer())
    request = parse_completion({"prompt": ["x", "y"], "logprobs": 1, "temperature": 0,
                                "max_tokens": 2}, CONTEXT)
    steps = [Step.of([gen("ab", 100, logprob=-1.0, top=[(105, -0.5)], row=0),
                      gen("c", 102, logprob=-0.1, top=[(102, -0.1)], row=1)]),
             Step.of([gen("d", 103, "length", logprob=-2.0, top=[(103, -2.0)], row=0),
                      gen("e", 104, "length", logprob=-0.2, top=[(104, -0.2)], row=1)])]
    body = protocol.complete(request, steps, [1, 2])
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")
    assert [c.text for c in parsed.choices] == ["abd", "ce"]
    first = parsed.choices[0].logprobs
    assert (first.tokens, first.token_logprobs, first.text_offset) == \
        (["a", "d"], [-1.0, -2.0], [0, 1])
    # the alternatives, and the chosen token always among them
    assert first.top_logprobs == [{"f": -0.5, "a": -1.0}, {"d": -2.0}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_a_completions_stream_parses_as_the_sdks_completion_chunks():
    protocol = CompletionsProtocol("smollm2", FakeTokenizer())
    request = completion(temperature=0, stream=True, stream_options={"include_usage": True})
    steps = [Step.of([gen("Hel")]), Step.of([gen("lo", finish="length")])]
    records = sse_records(EncodedStream(iter(steps), protocol.stream_encoder(request, [2])))
    # The SDK reads completions chunks as Completion objects without validating them: its
    # type wants a finish_reason, which no chunk but the last has (OpenAI's neither).
    chunks = [construct_type(type_=Completion, value=record) for record in records]
    Completion.model_validate(records[-2])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == "Hello"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 4


def test_an_engine_without_token_detail_still_gets_finish_reasons():
    # A custom engine may yield plain lists: the length is then counted in pieces.
    protocol = CompletionsProtocol("smollm2")
    request = completion(temperature=0, max_tokens=2, n=2)
    body = protocol.complete(request, [Step(["a", "b"]), Step(["c", ""])], [1, 1])
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("failure, status, error_type, code, param", [
    (Failure("invalid", "n must be at least 1, got 0", "n"), 400, "invalid_request_error",
     None, "n"),
    (Failure("invalid", "the request body is not valid JSON: ...", "body"), 400,
     "invalid_request_error", None, None),
    (Failure("failed", "boom"), 424, "server_error", "generation_failed", None),
    (Failure("out_of_memory", "CUDA out of memory"), 507, "server_error", "out_of_memory", None),
    (Failure("busy", "1000 requests are waiting"), 503, "server_error", "queue_full", None),
])
def test_errors_in_openais_shape_with_djls_statuses(failure, status, error_type, code, param):
    answer = chat_protocol().error(failure)
    assert answer.code == status
    assert answer.body == {"error": {"message": failure.message, "type": error_type,
                                     "param": param, "code": code}}


def test_token_bytes_join_into_the_character_a_token_splits(smollm2_tokenizer):
    text = TokenText(smollm2_tokenizer)
    ids = smollm2_tokenizer("a 🌊 wave")["input_ids"]
    tokens = [text.token(i) for i in ids]
    partial = [token for token in tokens if token.startswith("bytes:")]
    assert partial, tokens  # the emoji spans several tokens
    # as OpenAI writes a token that holds part of a character: no U+FFFD, nothing lost
    assert not any("\ufffd" in token for token in tokens)
    assert b"".join(bytes(int(h, 16) for h in token.split("\\x")[1:]) for token in partial) \
        == " 🌊".encode()
    joined = b"".join(bytes(text.bytes(i)) for i in ids)
    assert joined.decode("utf-8") == "a 🌊 wave"


def test_text_offsets_count_characters_where_tokens_split_one(smollm2_tokenizer):
    protocol = CompletionsProtocol("smollm2", smollm2_tokenizer)
    request = parse_completion({"prompt": "x", "logprobs": 0, "temperature": 0,
                                "max_tokens": 8}, CONTEXT)
    ids = smollm2_tokenizer("a 🌊 wave")["input_ids"]
    text = TokenText(smollm2_tokenizer)
    steps = [Step.of([gen("", i, logprob=-1.0, top=[(i, -1.0)])]) for i in ids]
    body = protocol.complete(request, steps, [1])
    logprobs = body["choices"][0]["logprobs"]
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert tokens == [text.token(i) for i in ids]
    # each offset is where its token's text starts in "a 🌊 wave": " wave" after the emoji
    # (one character, whatever its tokens); the emoji's tokens start at its start or end
    assert offsets[tokens.index(" wave")] == len("a 🌊")
    assert offsets == sorted(offsets) and offsets[0] == 0


# -- through model.py's handle() ---------------------------------------------------------


def call(module, body, protocol=None):
    from djl_stream.serving.inputs import Input

    inp = Input(properties={"content-type": "application/json", "requestId": uuid.uuid4().hex})
    if protocol:
        inp.properties["djl_stream_protocol"] = protocol
    inp.add("data", body if isinstance(body, bytes) else json.dumps(body).encode())
    return module.handle(inp)


def body_of(output):
    return json.loads(bytes(output.content.value_at(0)))


@pytest.fixture(scope="module")
def handler(tiny_model_dir):
    from test_service import init, load_entry_point

    return init(load_entry_point(tiny_model_dir), tiny_model_dir)


def test_a_messages_body_is_a_chat_completion_and_a_prompt_body_a_completion(handler):
    chat_answer = call(handler, {"messages": HI, "max_tokens": 3})
    assert chat_answer.properties["content-type"] == "application/json"
    assert body_of(chat_answer)["object"] == "chat.completion"
    completion_answer = body_of(call(handler, {"prompt": "Once", "max_tokens": 3}))
    assert completion_answer["object"] == "text_completion"
    # the inputs form stays djl's
    assert "generated_text" in body_of(call(handler, {"inputs": "Once", "stream": False}))


def test_a_key_set_to_null_picks_no_protocol(handler):
    # {"inputs": ..., "messages": null} is djl's body with an empty field, not a chat
    answer = body_of(call(handler, {"inputs": "Once", "messages": None, "stream": False,
                                    "parameters": {"max_new_tokens": 2}}))
    assert "generated_text" in answer


def test_usage_counts_the_prompt_as_the_tokenizer_does(handler):
    tokenizer = handler._service.tokenizer
    body = body_of(call(handler, {"prompt": ["Once upon", "a"], "max_tokens": 2, "n": 2,
                                  "temperature": 0}))
    assert body["usage"]["prompt_tokens"] == len(tokenizer("Once upon")["input_ids"]) + \
        len(tokenizer("a")["input_ids"])
    assert body["usage"]["completion_tokens"] == 8
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # greedy: each prompt's two choices agree
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3]


def test_limits_and_messages_as_on_djls_routes(handler):
    long_prompt = "word " * 100
    length = len(handler._service.tokenizer(long_prompt)["input_ids"])
    out = call(handler, {"prompt": long_prompt, "max_tokens": 2}, "openai-completions")
    assert out.code == 400
    assert body_of(out)["error"] == {
        "message": f"prompt is {length} tokens long; the limit (option.max_input_length) is 64",
        "type": "invalid_request_error", "param": "prompt", "code": None}
    out = call(handler, {"prompt": ["a"] * 40, "max_tokens": 2}, "openai-completions")
    assert body_of(out)["error"]["message"] == \
        "prompt has 40 prompts; the limit (option.max_rolling_batch_size) is 32"
    # a body that is not JSON, on a route that names the protocol, in OpenAI's shape
    out = call(handler, b"{nope", "openai-chat")
    assert out.code == 400 and body_of(out)["error"]["param"] is None
    assert body_of(out)["error"]["message"].startswith("the request body is not valid JSON")


def test_n_copies_of_a_prompt_count_toward_what_a_request_may_bring(handler):
    prompt = " ".join(["word"] * 50)  # within max_input_length (64); three copies are not
    out = call(handler, {"prompt": prompt, "n": 3, "max_tokens": 2, "temperature": 0},
               "openai-completions")
    assert out.code == 400
    error = body_of(out)["error"]
    assert error["param"] == "prompt"
    assert error["message"].endswith("the limit (option.max_request_input_length) is 128")
    assert call(handler, {"prompt": prompt, "n": 2, "max_tokens": 2, "temperature": 0},
                "openai-completions").code == 200


def test_a_streamed_chat_answer_is_server_sent_events(handler):
    out = call(handler, {"messages": HI, "max_tokens": 4, "stream": True, "temperature": 0})
    assert out.code == 200
    assert out.properties["content-type"] == "text/event-stream"
    records = sse_records([out.format_stream_item(item) for item in out.stream_content])
    whole = body_of(call(handler, {"messages": HI, "max_tokens": 4, "temperature": 0}))
    assert "".join(r["choices"][0]["delta"].get("content", "") for r in records) == \
        whole["choices"][0]["message"]["content"]


def test_chat_protocol_djl_keeps_messages_in_djls_format(tmp_path, tiny_model_dir):
    from test_service import init, load_entry_point, variant_dir

    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.chat_protocol=djl\n")
    module = init(load_entry_point(directory), directory)
    body = body_of(call(module, {"messages": HI, "parameters": {"max_new_tokens": 3},
                                 "stream": False}))
    assert list(body) == ["generated_text"]
    # the OpenAI route still answers OpenAI's shape
    assert body_of(call(module, {"messages": HI, "max_tokens": 3}, "openai-chat"))["object"] \
        == "chat.completion"
