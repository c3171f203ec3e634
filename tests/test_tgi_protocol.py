"""TGI's protocol without a model: requests parsed, hand-built Steps written as TGI's
router writes them, and read back by huggingface_hub's own parsers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from huggingface_hub import TextGenerationOutput
from huggingface_hub.errors import GenerationError
from huggingface_hub.inference._common import _format_text_generation_stream_output

from djl_stream.generation.step import Generation, Step
from djl_stream.protocols.protocol import Failure, ParseContext
from djl_stream.protocols.tgi.protocol import TgiProtocol
from djl_stream.protocols.tgi.request import MAX_TOP_N_TOKENS, UNSUPPORTED, parse_request
from djl_stream.protocols.tgi.writers import TgiStreamEncoder, Vocabulary
from djl_stream.protocols.validation import RequestError, describe

CONTEXT = ParseContext(default_max_new_tokens=50, max_new_tokens_limit=256, max_batch_size=8,
                       model_name="tiny")
#: Every parameter as the `text-generation` client sends it by default: null or false.
NULL_PARAMETERS = {
    "best_of": None, "decoder_input_details": False, "details": True, "do_sample": False,
    "frequency_penalty": None, "grammar": None, "max_new_tokens": 20,
    "repetition_penalty": None, "return_full_text": False, "seed": None, "stop": [],
    "temperature": None, "top_k": None, "top_n_tokens": None, "top_p": None,
    "truncate": None, "typical_p": None, "watermark": False, "adapter_id": None,
}
VOCABULARY = Vocabulary(lambda token_id: f"<{token_id}>", special_ids={2})


def parse(parameters: dict, route_stream: bool | None = False, **kwargs: Any):
    return parse_request({"inputs": "Hello", "parameters": parameters}, CONTEXT,
                         route_stream=route_stream, **kwargs)


def refusal(body: Any, route_stream: bool | None = False, **kwargs: Any) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse_request(body, CONTEXT, route_stream=route_stream, **kwargs)
    return caught.value


def events(chunks: list[bytes]) -> list[dict]:
    """The JSON of each server-sent event, checking TGI's framing on the way."""
    wire = b"".join(chunks).decode()
    assert wire.endswith("\n\n")
    records = wire[:-2].split("\n\n")
    assert all(r.startswith("data:{") for r in records)
    return [json.loads(r[len("data:"):]) for r in records]


def gen(token_id: int, text: str, finish: str | None = None, **kwargs: Any) -> Generation:
    return Generation("r", token_id, text, finish, **kwargs)


# -- requests -------------------------------------------------------------------------


def test_the_clients_nulls_and_defaults_parse_to_plain_greedy_decoding():
    request = parse(NULL_PARAMETERS)
    params = request.parameters
    assert request.prompts == ("Hello",)
    assert (params.max_new_tokens, params.do_sample, params.manual_seed, params.stop) == \
        (20, False, None, ())
    assert (params.temperature, params.top_k, params.top_p, params.typical_p,
            params.repetition_penalty) == (1.0, 0, 1.0, 1.0, 1.0)
    assert request.answer.details and not request.answer.return_full_text
    assert request.stream is False


def test_an_absent_parameters_object_takes_the_models_default_length():
    request = parse_request({"inputs": "Hello"}, CONTEXT, route_stream=True)
    assert request.parameters.max_new_tokens == CONTEXT.default_max_new_tokens
    assert request.stream is True


@pytest.mark.parametrize("parameters", [{"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9},
                                        {"typical_p": 0.5}, {"do_sample": True}])
def test_a_sampling_warper_samples_even_without_do_sample_as_in_tgi(parameters):
    assert parse(parameters).parameters.do_sample


@pytest.mark.parametrize("parameters", [{"temperature": 1.0}, {"top_p": 1.0},
                                        {"typical_p": 1.0}, {"repetition_penalty": 1.2}])
def test_neutral_warpers_and_the_repetition_penalty_stay_greedy(parameters):
    assert not parse(parameters).parameters.do_sample


def test_a_sampled_request_without_a_seed_gets_a_drawn_one_reported_in_details():
    drawn = iter([1234])
    request = parse({"do_sample": True}, draw_seed=lambda: next(drawn))
    assert request.parameters.manual_seed == request.answer.seed == 1234


def test_a_given_seed_is_used_and_a_greedy_request_reports_none():
    assert parse({"do_sample": True, "seed": 2**64 - 1}).answer.seed == 2**64 - 1
    greedy = parse({"seed": 7}, draw_seed=lambda: pytest.fail("greedy requests draw no seed"))
    assert greedy.parameters.manual_seed is None and greedy.answer.seed is None


def test_an_engine_without_seeds_samples_unseeded():
    request = parse({"do_sample": True}, draw_seed=None)
    assert request.parameters.do_sample and request.parameters.manual_seed is None
    assert request.answer.seed is None


@pytest.mark.parametrize("route_stream, details, wanted", [
    (True, False, True),    # every stream event carries its token's logprob
    (False, True, True),    # details.tokens do
    (False, False, False),  # a bare generated_text needs none
])
def test_logprobs_are_asked_for_only_where_the_answer_shows_them(route_stream, details, wanted):
    request = parse({"details": details, "top_n_tokens": 3}, route_stream)
    assert request.parameters.logprobs is wanted
    assert request.parameters.top_logprobs == (3 if wanted else 0)


def test_an_engine_without_scores_gets_no_logprobs_and_refuses_top_n_tokens():
    assert parse({"details": True}, scores=False).parameters.logprobs is False
    error = refusal({"inputs": "Hi", "parameters": {"top_n_tokens": 2}}, scores=False,
                    engine="transformers-neuronx")
    assert error.field == "parameters.top_n_tokens"
    assert "transformers-neuronx engine" in error.message


def test_top_n_tokens_shares_the_engines_limit():
    from djl_stream.generation.sampling import MAX_TOP_LOGPROBS

    assert MAX_TOP_N_TOKENS == MAX_TOP_LOGPROBS
    error = refusal({"inputs": "Hi", "parameters": {"top_n_tokens": MAX_TOP_N_TOKENS + 1}})
    assert error.message == f"parameters.top_n_tokens must be at most {MAX_TOP_N_TOKENS}, got 21"


@pytest.mark.parametrize("name, value", [
    ("best_of", 2), ("decoder_input_details", True), ("truncate", 10), ("watermark", True),
    ("adapter_id", "my-lora"),
])
def test_a_parameter_we_cannot_honour_is_refused_by_name(name, value):
    error = refusal({"inputs": "Hi", "parameters": {name: value}})
    assert error.field == f"parameters.{name}"
    assert error.message.startswith(f"parameters.{name} is not supported by djl-stream (")
    assert error.message.endswith(f"got {describe(value)}")


def test_frequency_penalty_reaches_the_engine():
    assert parse({"frequency_penalty": 0.5}).parameters.frequency_penalty == 0.5


def test_the_same_parameters_at_their_defaults_are_accepted():
    neutral = {name: allowed[-1] for name, (allowed, _, _) in UNSUPPORTED.items()}
    assert neutral == {"best_of": 1, "decoder_input_details": False, "truncate": None,
                       "watermark": False, "adapter_id": None}
    assert parse(neutral).parameters.max_new_tokens == 50


@pytest.mark.parametrize("body, field, message", [
    ({"parameters": {}}, "inputs", "inputs is required"),
    ({"inputs": ""}, "inputs", "inputs must not be empty or whitespace only"),
    ({"inputs": " \n\t "}, "inputs", "inputs must not be empty or whitespace only"),
    ({"inputs": ["a", "b"]}, "inputs", "inputs must be a string, got a list"),
    ({"inputs": "Hi", "parameters": {"top_p": 3}}, "parameters.top_p",
     "parameters.top_p must be at most 1, got 3"),
    ({"inputs": "Hi", "parameters": {"top_k": 0}}, "parameters.top_k",
     "parameters.top_k must be greater than 0, got 0"),
    ({"inputs": "Hi", "parameters": {"max_new_tokens": 300}}, "parameters.max_new_tokens",
     "parameters.max_new_tokens must be at most 256, got 300"),
    ({"inputs": "Hi", "parameters": {"seed": -1}}, "parameters.seed",
     "parameters.seed must be at least 0, got -1"),
    ({"inputs": "Hi", "parameters": {"temperature": "hot"}}, "parameters.temperature",
     'parameters.temperature must be a number, got "hot" (a string)'),
    ({"inputs": "Hi", "parameters": {"stop": [""]}}, "parameters.stop[0]",
     "parameters.stop[0] must not be empty"),
])
def test_a_malformed_request_names_the_field_and_the_limit(body, field, message):
    error = refusal(body)
    assert (error.field, error.message) == (field, message)


def test_an_unknown_parameter_is_refused_with_the_closest_name():
    error = refusal({"inputs": "Hi", "parameters": {"max_tokens": 5}})
    assert error.field == "parameters.max_tokens"
    assert "did you mean max_new_tokens?" in error.message


def test_a_stream_flag_the_route_does_not_answer_points_to_the_right_route():
    error = refusal({"inputs": "Hi", "stream": True}, route_stream=False)
    assert error.field == "stream" and "POST /generate_stream" in error.message
    assert "POST /generate " in refusal({"inputs": "Hi", "stream": False}, route_stream=True).message
    assert parse_request({"inputs": "Hi", "stream": True}, CONTEXT, route_stream=True).stream


def test_the_compat_route_reads_stream_from_the_body_and_answers_a_list():
    streamed = parse_request({"inputs": "Hi", "stream": True}, CONTEXT, route_stream=None)
    assert streamed.stream is True and not streamed.answer.as_list
    plain = parse_request({"inputs": "Hi"}, CONTEXT, route_stream=None)
    assert plain.stream is False and plain.answer.as_list


def test_the_chat_template_wraps_the_prompt_and_full_text_keeps_what_was_sent():
    context = ParseContext(50, 256, 8, "m", render_chat=lambda m: f"<user>{m[0]['content']}<bot>",
                           wrap_prompts_in_chat=True)
    request = parse_request({"inputs": "Hi"}, context, route_stream=False)
    assert request.prompts == ("<user>Hi<bot>",)
    assert request.answer.inputs == "Hi"


# -- the stream -----------------------------------------------------------------------


def stream_of(steps: list[Step], **answer: Any) -> tuple[TgiStreamEncoder, list[bytes]]:
    request = parse_request({"inputs": "Say", "parameters": answer}, CONTEXT,
                            route_stream=True, draw_seed=lambda: 99)
    encoder = TgiProtocol(True, vocabulary=VOCABULARY).stream_encoder(request, [4])
    chunks = [encoder.step(step) for step in steps] + [encoder.end()]
    return encoder, [c for c in chunks if c]


STEPS = [Step.of([gen(10, "Hel", logprob=-0.25, top_logprobs=((10, -0.25), (11, -2.0)))]),
         Step.of([gen(11, "", logprob=-1.5, top_logprobs=((11, -1.5), (2, -3.0)))]),
         Step.of([gen(12, "lo!", logprob=-0.5, top_logprobs=((12, -0.5), (10, -4.0)))]),
         Step.of([gen(2, "", "eos", logprob=-0.125, special=True,
                      top_logprobs=((2, -0.125), (12, -5.0)))])]


def test_one_event_per_token_the_last_with_generated_text_and_details():
    _, chunks = stream_of(STEPS, details=True)
    records = events(chunks)
    assert [r["index"] for r in records] == [1, 2, 3, 4]
    assert [r["token"] for r in records] == [
        {"id": 10, "text": "Hel", "logprob": -0.25, "special": False},
        {"id": 11, "text": "", "logprob": -1.5, "special": False},
        {"id": 12, "text": "lo!", "logprob": -0.5, "special": False},
        {"id": 2, "text": "", "logprob": -0.125, "special": True},
    ]
    assert [r["generated_text"] for r in records] == [None, None, None, "Hello!"]
    assert [r["details"] for r in records[:3]] == [None] * 3
    assert records[-1]["details"] == {"finish_reason": "eos_token", "generated_tokens": 4,
                                      "seed": None, "input_length": 4}
    assert all("top_tokens" not in r for r in records)


def test_huggingface_hubs_own_parser_reads_the_events():
    _, chunks = stream_of(STEPS, details=True, top_n_tokens=2)
    lines = b"".join(chunks).decode().split("\n")
    parsed = [_format_text_generation_stream_output(line, details=True) for line in lines]
    outputs = [p for p in parsed if p is not None]
    assert [o.token.id for o in outputs] == [10, 11, 12, 2]
    assert "".join(o.token.text for o in outputs) == outputs[-1].generated_text == "Hello!"
    assert outputs[-1].details.finish_reason == "eos_token"
    assert [[t.id for t in o.top_tokens] for o in outputs] == [[10, 11], [11, 2], [12, 10], [2, 12]]
    assert outputs[1].top_tokens[1].special and outputs[1].top_tokens[1].text == "<2>"
    texts = [_format_text_generation_stream_output(line, details=False) for line in lines]
    assert [t for t in texts if t is not None] == ["Hel", "", "lo!", ""]


@pytest.mark.parametrize("ours, theirs", [("length", "length"), ("stop", "stop_sequence"),
                                          ("eos", "eos_token")])
def test_finish_reasons_in_tgis_words(ours, theirs):
    _, chunks = stream_of([Step.of([gen(5, "a")]), Step.of([gen(6, "b", ours)])], details=True)
    assert events(chunks)[-1]["details"]["finish_reason"] == theirs


def test_return_full_text_prepends_the_inputs_as_sent_and_the_seed_is_reported():
    _, chunks = stream_of(STEPS, details=True, return_full_text=True, do_sample=True)
    last = events(chunks)[-1]
    assert last["generated_text"] == "SayHello!"
    assert last["details"]["seed"] == 99


def test_without_details_the_last_event_still_carries_the_text():
    _, chunks = stream_of(STEPS)
    last = events(chunks)[-1]
    assert last["generated_text"] == "Hello!" and last["details"] is None


def test_an_error_after_the_first_event_is_an_error_event_the_client_raises():
    encoder, _ = stream_of(STEPS[:1])
    line = encoder.error("RuntimeError: boom").decode().strip()
    assert json.loads(line[len("data:"):]) == {"error": "RuntimeError: boom",
                                               "error_type": "generation"}
    with pytest.raises(GenerationError, match="boom"):
        _format_text_generation_stream_output(line, details=True)


def test_a_stream_that_ends_without_its_last_token_says_so():
    _, chunks = stream_of(STEPS[:2])
    assert events(chunks)[-1] == {"error": "Incomplete generation stream",
                                  "error_type": "incomplete_generation_stream"}


def test_an_engine_without_token_detail_is_held_back_one_step_to_find_the_last():
    encoder, _ = stream_of([])
    encoder.max_new_tokens = 3
    assert encoder.step(Step(["a"])) == b""  # not known yet whether it is the last
    first = events([encoder.step(Step(["b"]))])
    assert first[0]["token"] == {"id": None, "text": "a", "logprob": None, "special": False}
    last = events([encoder.end()])[0]
    assert last["generated_text"] == "ab" and last["index"] == 2


def test_a_logprob_that_is_not_finite_is_written_as_null():
    _, chunks = stream_of([Step.of([gen(5, "a", "length", logprob=float("-inf"))])])
    assert events(chunks)[0]["token"]["logprob"] is None


# -- the JSON answer and errors ----------------------------------------------------------


def complete(steps: list[Step], route_stream: bool | None = False, **parameters: Any) -> Any:
    protocol = TgiProtocol(route_stream, vocabulary=VOCABULARY)
    request = protocol.parse({"inputs": "Say", "parameters": parameters}, CONTEXT)
    return protocol.complete(request, steps, [4])


def test_generate_answers_the_text_alone_without_details():
    assert complete(STEPS) == {"generated_text": "Hello!"}


def test_details_list_every_token_and_huggingface_hub_reads_them():
    body = complete(STEPS, details=True, top_n_tokens=2)
    details = body["details"]
    assert (details["finish_reason"], details["generated_tokens"], details["seed"],
            details["prefill"]) == ("eos_token", 4, None, [])
    assert [t["id"] for t in details["tokens"]] == [10, 11, 12, 2]
    assert [[t["id"] for t in top] for top in details["top_tokens"]] == \
        [[10, 11], [11, 2], [12, 10], [2, 12]]
    output = TextGenerationOutput.parse_obj_as_instance(body)
    assert output.generated_text == "".join(t.text for t in output.details.tokens) == "Hello!"
    assert output.details.tokens[-1].special


def test_the_compat_route_answers_a_one_element_list():
    assert complete(STEPS, route_stream=None, return_full_text=True) == \
        [{"generated_text": "SayHello!"}]


@pytest.mark.parametrize("kind, code, error_type", [("invalid", 422, "validation"),
                                                    ("busy", 429, "overloaded"),
                                                    ("failed", 424, "generation"),
                                                    ("out_of_memory", 424, "generation")])
def test_errors_take_tgis_statuses_and_shape(kind, code, error_type):
    answer = TgiProtocol(False).error(Failure(kind, "what happened"))
    assert answer.code == code
    assert answer.body["error_type"] == error_type
    assert answer.body["error"].endswith("what happened")


def test_an_engines_refusal_names_the_parameter_as_tgi_calls_it():
    failure = Failure("invalid", "parameters.manual_seed is not supported by the "
                                 "transformers-neuronx engine (...); leave it unset",
                      "parameters.manual_seed")
    assert TgiProtocol(False).error(failure).body["error"] == (
        "Input validation error: parameters.seed is not supported by the "
        "transformers-neuronx engine (...); leave it unset")
