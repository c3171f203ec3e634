"""The djl protocol: which answer a request gets (text or per-token details), and the bytes
of each shape, from hand-built Steps."""

from __future__ import annotations

import json
import types

import pytest

from djl_stream.generation.step import Generation, Step
from djl_stream.protocols.djl.formatters import resolve_formatter
from djl_stream.protocols.djl.protocol import DjlProtocol
from djl_stream.protocols.protocol import EncodedStream, ParseContext
from djl_stream.protocols.validation import RequestError

CONTEXT = ParseContext(default_max_new_tokens=16, max_new_tokens_limit=256, max_batch_size=8,
                       model_name="tiny")


def chat_context() -> ParseContext:
    def render(messages):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    return ParseContext(16, 256, 8, "tiny", render_chat=render, wrap_prompts_in_chat=True)


def protocol(formatter="jsonlines", **kwargs) -> DjlProtocol:
    fmt = resolve_formatter(formatter, types.SimpleNamespace(upper=lambda p: "".join(p).upper()))
    kwargs.setdefault("token_text", lambda token_id: f"<{token_id}>")
    return DjlProtocol(fmt, **kwargs)


def parse(body, formatter="jsonlines", context=CONTEXT, **kwargs):
    return protocol(formatter, **kwargs).parse(body, context)


def refused(body, formatter="jsonlines", **kwargs) -> RequestError:
    with pytest.raises(RequestError) as raised:
        parse(body, formatter, **kwargs)
    return raised.value


def two_prompts_steps():
    """Prompt 0 says " Paris." then eos; prompt 1 runs to max_new_tokens (3)."""
    return [
        Step.of([Generation(0, 11, " Paris", logprob=-0.5, top_logprobs=((11, -0.5), (12, -1.0))),
                 Generation(1, 21, "Red", logprob=-0.25, top_logprobs=((21, -0.25), (22, -2.0)))]),
        Step.of([Generation(0, 13, ".", logprob=-0.125, top_logprobs=((13, -0.125), (14, -3.0))),
                 Generation(1, 23, ",", logprob=-1.0, top_logprobs=((23, -1.0), (24, -1.5)))]),
        Step.of([Generation(0, 2, "", "eos", logprob=-0.0625, top_logprobs=((2, -0.0625), (15, -4.0)),
                            special=True),
                 Generation(1, 25, " blue", "length", logprob=-0.5,
                            top_logprobs=((25, -0.5), (26, -0.75)))]),
    ]


def encode(request, steps, prompt_tokens=(5, 4), proto=None) -> list[bytes]:
    proto = proto or protocol()
    return list(EncodedStream(iter(steps), proto.stream_encoder(request, list(prompt_tokens))))


# -- which answer -----------------------------------------------------------------------


def test_a_plain_request_streams_text_lines_byte_for_byte_as_before():
    request = parse({"inputs": ["a", "b"]})
    chunks = encode(request, two_prompts_steps())

    assert chunks == [b'{"output_tokens": [" Paris", "Red"]}\n',
                      b'{"output_tokens": [".", ","]}\n',
                      b'{"output_tokens": ["", " blue"]}\n']  # and no closing record
    assert request.parameters.logprobs is False


def test_details_are_asked_for_by_the_request_or_given_by_the_formatter():
    assert parse({"inputs": "a", "parameters": {"details": True}}).answer.details is True
    assert parse({"inputs": "a"}, "jsonlines_details").answer.details is True
    assert parse({"inputs": "a"}, "sse").answer.details is False


def test_jsonlines_details_is_a_stream_format_only():
    # a non-streaming answer gets details when the request asks, whatever the formatter
    assert parse({"inputs": "a", "stream": False}, "jsonlines_details").answer.details is False
    assert parse({"inputs": "a"}, "jsonlines_details",
                 enable_streaming=False).answer.details is False


def test_details_come_with_scores_where_the_engine_has_them():
    assert parse({"inputs": "a", "parameters": {"details": True}}).parameters.logprobs is True
    assert parse({"inputs": "a"}, "jsonlines_details").parameters.logprobs is True
    unscored = parse({"inputs": "a", "parameters": {"details": True}}, scores=False)
    assert unscored.parameters.logprobs is False and unscored.answer.details is True


def test_a_custom_formatter_cannot_stream_details():
    error = refused({"inputs": "a", "parameters": {"details": True}}, "upper")
    assert error.field == "parameters.details"
    assert "option.output_formatter=upper" in error.message and '"stream": false' in error.message
    error = refused({"inputs": "a", "parameters": {"top_logprobs": 2}}, "upper")
    assert error.field == "parameters.details"
    # the JSON answer can carry them
    assert parse({"inputs": "a", "parameters": {"details": True}, "stream": False},
                 "upper").answer.details is True


def test_return_full_text_cannot_go_into_a_details_stream():
    error = refused({"inputs": "a", "parameters": {"details": True, "return_full_text": True}})
    assert error.field == "parameters.return_full_text"
    assert "per-token details" in error.message
    assert parse({"inputs": "a", "stream": False,
                  "parameters": {"details": True, "return_full_text": True}}).answer.details


def test_prompts_wrapped_in_the_chat_template_keep_what_the_client_sent():
    request = parse({"inputs": "Hi", "parameters": {"return_full_text": True}},
                    context=chat_context())
    assert request.prompts == ("<user>Hi<assistant>",)
    assert request.answer.inputs == ("Hi",) and request.answer.return_full_text


# -- streams ----------------------------------------------------------------------------


def test_a_details_stream_is_one_tokens_record_per_step_then_the_details():
    request = parse({"inputs": ["a", "b"], "parameters": {"details": True}})
    lines = [json.loads(chunk) for chunk in encode(request, two_prompts_steps())]

    assert lines[0] == {"tokens": [
        {"id": 11, "text": " Paris", "logprob": -0.5, "special": False},
        {"id": 21, "text": "Red", "logprob": -0.25, "special": False}]}
    assert lines[2]["tokens"][0] == {"id": 2, "text": "", "logprob": -0.0625, "special": True}
    assert lines[3] == {"details": [
        {"finish_reason": "eos_token", "generated_tokens": 3, "prompt_tokens": 5},
        {"finish_reason": "length", "generated_tokens": 3, "prompt_tokens": 4}]}
    assert len(lines) == 4


def test_top_logprobs_carry_the_alternatives_texts():
    request = parse({"inputs": ["a", "b"], "parameters": {"top_logprobs": 1}})
    first = json.loads(encode(request, two_prompts_steps())[0])

    assert first["tokens"][0]["top_logprobs"] == [{"id": 11, "text": "<11>", "logprob": -0.5}]
    assert first["tokens"][1]["top_logprobs"] == [{"id": 21, "text": "<21>", "logprob": -0.25}]


def test_a_prompt_that_finished_earlier_is_null_and_counted_no_more():
    steps = [Step.of([Generation(0, 7, "x", "stop"), Generation(1, 8, "y")]),
             Step.of([None, Generation(1, 9, "z", "length")])]
    request = parse({"inputs": ["a", "b"], "parameters": {"details": True}})
    lines = [json.loads(chunk) for chunk in encode(request, steps, (1, 2))]

    assert lines[1]["tokens"][0] is None
    assert lines[2]["details"] == [
        {"finish_reason": "stop_sequence", "generated_tokens": 1, "prompt_tokens": 1},
        {"finish_reason": "length", "generated_tokens": 2, "prompt_tokens": 2}]


def test_sse_frames_the_details_as_events():
    request = parse({"inputs": ["a", "b"], "parameters": {"details": True}}, "sse")
    chunks = encode(request, two_prompts_steps(), proto=protocol("sse"))

    assert all(chunk.startswith(b"data: {") and chunk.endswith(b"}\n\n") for chunk in chunks)
    assert json.loads(chunks[-1][len(b"data: "):])["details"][1]["finish_reason"] == "length"


def test_details_false_on_a_details_formatter_streams_text():
    proto = protocol("jsonlines_details")
    request = proto.parse({"inputs": ["a", "b"], "parameters": {"details": False}}, CONTEXT)
    chunks = encode(request, two_prompts_steps(), proto=proto)
    assert chunks[0] == b'{"output_tokens": [" Paris", "Red"]}\n' and len(chunks) == 3


def test_a_details_stream_that_fails_ends_with_the_error_record_not_the_details():
    def failing():
        yield two_prompts_steps()[0]
        raise RuntimeError("device lost")

    request = parse({"inputs": ["a", "b"], "parameters": {"details": True}})
    chunks = list(EncodedStream(failing(), protocol().stream_encoder(request, [5, 4])))
    assert [list(json.loads(c)) for c in chunks] == [["tokens"], ["error"]]


def test_return_full_text_puts_each_prompt_before_its_first_piece():
    request = parse({"inputs": ["Q1 ", "Q2 "], "parameters": {"return_full_text": True}})
    chunks = encode(request, two_prompts_steps())
    assert json.loads(chunks[0]) == {"output_tokens": ["Q1  Paris", "Q2 Red"]}
    assert json.loads(chunks[1]) == {"output_tokens": [".", ","]}


# -- JSON answers -----------------------------------------------------------------------


def test_the_json_answer_without_details_is_as_before():
    proto = protocol()
    assert proto.complete(parse({"inputs": "a"}), [Step(["x"]), Step(["y"])], [3]) == {
        "generated_text": "xy"}


def test_the_json_answer_with_details_for_one_prompt():
    proto = protocol()
    steps = [Step.of([s.generations[0]]) for s in two_prompts_steps()]
    body = proto.complete(parse({"inputs": "a", "parameters": {"details": True}}), steps, [5])

    assert body == {"generated_text": " Paris.", "details": {
        "finish_reason": "eos_token", "generated_tokens": 3, "prompt_tokens": 5, "tokens": [
            {"id": 11, "text": " Paris", "logprob": -0.5, "special": False},
            {"id": 13, "text": ".", "logprob": -0.125, "special": False},
            {"id": 2, "text": "", "logprob": -0.0625, "special": True}]}}


def test_the_json_answer_of_a_list_has_a_list_of_details():
    proto = protocol()
    request = parse({"inputs": ["a", "b"], "parameters": {"top_logprobs": 2}})
    body = proto.complete(request, two_prompts_steps(), [5, 4])

    assert body["generated_text"] == [" Paris.", "Red, blue"]
    assert [d["finish_reason"] for d in body["details"]] == ["eos_token", "length"]
    assert body["details"][1]["tokens"][2]["top_logprobs"] == [
        {"id": 25, "text": "<25>", "logprob": -0.5}, {"id": 26, "text": "<26>", "logprob": -0.75}]


def test_the_json_answer_has_the_same_token_records_as_the_stream():
    proto = protocol()
    request = parse({"inputs": ["a", "b"], "parameters": {"top_logprobs": 2}})
    streamed = [json.loads(c) for c in encode(request, two_prompts_steps(), proto=proto)]
    body = proto.complete(request, two_prompts_steps(), [5, 4])

    for i in range(2):
        assert [line["tokens"][i] for line in streamed[:-1]] == body["details"][i]["tokens"]
        assert {k: v for k, v in body["details"][i].items() if k != "tokens"} == \
            streamed[-1]["details"][i]


def test_return_full_text_in_the_json_answer():
    proto = protocol()
    body = proto.complete(parse({"inputs": ["Q1 ", "Q2 "], "parameters": {"return_full_text": True}}),
                          two_prompts_steps(), [5, 4])
    assert body == {"generated_text": ["Q1  Paris.", "Q2 Red, blue"]}


def test_an_engine_without_token_details_still_gets_counted_text():
    proto = protocol()
    request = parse({"inputs": "a", "parameters": {"details": True}, "stream": False})
    body = proto.complete(request, [Step(["x"]), Step([""]), Step(["y"])], [2])
    assert body["details"] == {"finish_reason": None, "generated_tokens": 2, "prompt_tokens": 2,
                               "tokens": [{"id": None, "text": "x", "logprob": None, "special": False},
                                          {"id": None, "text": "y", "logprob": None, "special": False}]}
