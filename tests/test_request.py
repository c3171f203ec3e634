"""Request parsing: a JSON body becomes a GenerationRequest, or one clear 400."""

from __future__ import annotations

import dataclasses

import pytest

from djl_stream.protocols.djl.request import parse_request
from djl_stream.protocols.request import GenerationRequest, SamplingParameters
from djl_stream.protocols.validation import RequestError, check_input_length, parse_json_body

LIMIT = 2048


def chat_template(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


def parse(body, **kwargs) -> GenerationRequest:
    kwargs.setdefault("default_max_new_tokens", 50)
    kwargs.setdefault("max_new_tokens_limit", LIMIT)
    return parse_request(body, **kwargs)


def refused(body, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as raised:
        parse(body, **kwargs)
    return raised.value


def with_params(**parameters):
    return {"inputs": "Hello", "parameters": parameters}


# -- the happy paths --------------------------------------------------------------------


def test_a_single_prompt_gets_the_defaults():
    req = parse({"inputs": "Hello"})

    assert req.prompts == ("Hello",)
    assert req.batched is False
    assert req.stream is None
    assert req.messages is None
    assert req.parameters == SamplingParameters(max_new_tokens=50)


def test_a_list_of_prompts_is_a_batched_request():
    req = parse({"inputs": ["a", "b"], "stream": True})

    assert req.prompts == ("a", "b")
    assert req.batched is True
    assert req.stream is True


def test_a_list_of_one_is_still_batched_so_the_answer_is_a_list():
    assert parse({"inputs": ["a"]}).batched is True


def test_every_parameter_is_carried_into_sampling_parameters():
    req = parse(with_params(max_new_tokens=7, temperature=0.7, top_k=40, top_p=0.9,
                            typical_p=0.95, repetition_penalty=1.2, do_sample=True,
                            manual_seed=42, stop=["\n\n", "User:"]))

    assert req.parameters == SamplingParameters(
        max_new_tokens=7, temperature=0.7, top_k=40, top_p=0.9, typical_p=0.95,
        repetition_penalty=1.2, do_sample=True, manual_seed=42, stop=("\n\n", "User:"))


def test_sampling_settings_alone_do_not_switch_sampling_on():
    # transformers' rule: temperature & co. only matter when do_sample is true.
    assert parse(with_params(temperature=0.5, top_k=10)).parameters.do_sample is False


def test_an_integer_is_a_valid_float():
    params = parse(with_params(temperature=1, top_p=1)).parameters
    assert params.temperature == 1.0 and isinstance(params.temperature, float)


def test_null_means_not_given():
    req = parse({"inputs": "x", "parameters": {"max_new_tokens": None}, "stream": None})
    assert req.parameters.max_new_tokens == 50
    assert parse({"inputs": "x", "parameters": None}).parameters == SamplingParameters(50)


def test_a_single_stop_string_is_normalised_to_a_tuple():
    assert parse(with_params(stop="###")).parameters.stop == ("###",)
    assert parse(with_params(stop=[])).parameters.stop == ()


def test_as_kwargs_is_ready_for_a_stream_generator():
    params = parse(with_params(max_new_tokens=3, stop="x")).parameters

    assert params.as_kwargs() == {"max_new_tokens": 3, "temperature": 1.0, "top_k": 0,
                                  "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0,
                                  "do_sample": False, "stop": ["x"]}
    assert SamplingParameters(1, manual_seed=0).as_kwargs()["manual_seed"] == 0


def test_the_parsed_request_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse({"inputs": "x"}).parameters.max_new_tokens = 9  # type: ignore[misc]


def test_utf8_prompts_survive_parsing():
    body = parse_json_body('{"inputs": ["你好", "👋🏽 café"]}'.encode("utf-8"))
    assert parse(body).prompts == ("你好", "👋🏽 café")


# -- messages ---------------------------------------------------------------------------


def test_messages_are_rendered_with_the_chat_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse({"messages": messages, "parameters": {"max_new_tokens": 5}},
                apply_chat_template=chat_template)

    assert req.prompts == ("<|system|>Be brief.\n<|user|>Hi\n<|assistant|>",)
    assert req.messages == tuple(messages)
    assert req.batched is False
    assert req.parameters.max_new_tokens == 5


def test_messages_need_a_chat_template():
    error = refused({"messages": [{"role": "user", "content": "Hi"}]})
    assert error.field == "messages"
    assert "chat template" in error.message


def test_a_template_that_rejects_the_conversation_is_a_request_error():
    def strict_template(messages):
        raise ValueError("Conversation roles must alternate user/assistant")

    error = refused({"messages": [{"role": "user", "content": "a"}]},
                    apply_chat_template=strict_template)
    assert error.field == "messages"
    assert "must alternate" in error.message


@pytest.mark.parametrize("messages, field, words", [
    ([], "messages", "must not be empty"),
    ("hi", "messages", "must be a list"),
    ([{"role": "bot", "content": "x"}], "messages[0].role", "'system', 'user', 'assistant' or 'tool'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": " "}],
     "messages[1].content", "must not be empty"),
    ([{"role": "user", "content": 3}], "messages[0].content", "must be a string"),
    ([{"role": "user"}], "messages[0].content", "is required"),
    ([{"role": "user", "content": "a", "name": "x"}], "messages[0].name", "not a known"),
    (["hello"], "messages[0]", "must be an object"),
])
def test_bad_messages_name_the_message_and_key(messages, field, words):
    error = refused({"messages": messages}, apply_chat_template=chat_template)
    assert error.field == field
    assert words in error.message
    assert error.message.startswith(field)


# -- the body as a whole ----------------------------------------------------------------


@pytest.mark.parametrize("body", [["Hello"], "Hello", None, 5])
def test_a_body_that_is_not_an_object_is_refused(body):
    error = refused(body)
    assert error.field == "body"
    assert "JSON object" in error.message


def test_inputs_or_messages_is_required():
    error = refused({"parameters": {}})
    assert error.field == "inputs"
    assert "required" in error.message


def test_inputs_and_messages_together_are_refused():
    error = refused({"inputs": "a", "messages": [{"role": "user", "content": "b"}]},
                    apply_chat_template=chat_template)
    assert error.field == "body"
    assert "not both" in error.message


def test_an_unknown_top_level_key_is_refused_with_a_suggestion():
    error = refused({"input": "Hello"})
    assert error.field == "input"
    assert "did you mean inputs?" in error.message


def test_stream_must_be_a_boolean():
    error = refused({"inputs": "a", "stream": "true"})
    assert error.field == "stream"
    assert error.message == 'stream must be true or false, got "true" (a string)'


# -- prompts ----------------------------------------------------------------------------


@pytest.mark.parametrize("inputs, field, words", [
    ("", "inputs", "must not be empty"),
    ("  \n\t", "inputs", "must not be empty or whitespace only"),
    ([], "inputs", "must not be empty"),
    (["ok", ""], "inputs[1]", "must not be empty"),
    (["ok", "fine", "   "], "inputs[2]", "whitespace only"),
    (["ok", 5], "inputs[1]", "must be a string, got 5"),
    (5, "inputs", "must be a string or a list of strings, got 5"),
    ({"text": "a"}, "inputs", "must be a string or a list of strings, got an object"),
])
def test_bad_prompts_are_refused_at_their_index(inputs, field, words):
    error = refused({"inputs": inputs})
    assert error.field == field
    assert words in error.message


# -- parameters -------------------------------------------------------------------------


@pytest.mark.parametrize("parameters, message", [
    ({"max_new_tokens": 5000}, "parameters.max_new_tokens must be at most 2048, got 5000"),
    ({"max_new_tokens": 0}, "parameters.max_new_tokens must be at least 1, got 0"),
    ({"max_new_tokens": "5"}, 'parameters.max_new_tokens must be an integer, got "5" (a string)'),
    ({"max_new_tokens": True}, "parameters.max_new_tokens must be an integer, got true"),
    ({"max_new_tokens": 5.0}, "parameters.max_new_tokens must be an integer, got 5"),
    ({"temperature": 0}, "parameters.temperature must be at least 0.0001, got 0"),
    # Values the scores are divided by: near 0 they overflowed and failed the whole batch.
    ({"temperature": 1e-37}, "parameters.temperature must be at least 0.0001, got 1e-37"),
    ({"repetition_penalty": 1e-300},
     "parameters.repetition_penalty must be at least 0.01, got 1e-300"),
    ({"temperature": 101}, "parameters.temperature must be at most 100, got 101"),
    ({"temperature": False}, "parameters.temperature must be a number, got false"),
    ({"temperature": float("inf")}, "parameters.temperature must be a finite number, got inf"),
    ({"top_k": -1}, "parameters.top_k must be at least 0, got -1"),
    ({"top_k": 1.5}, "parameters.top_k must be an integer, got 1.5"),
    ({"top_p": 0}, "parameters.top_p must be greater than 0, got 0"),
    ({"top_p": 1.01}, "parameters.top_p must be at most 1, got 1.01"),
    ({"typical_p": -0.5}, "parameters.typical_p must be greater than 0, got -0.5"),
    ({"typical_p": 2}, "parameters.typical_p must be at most 1, got 2"),
    ({"repetition_penalty": 0}, "parameters.repetition_penalty must be at least 0.01, got 0"),
    ({"repetition_penalty": 10.5}, "parameters.repetition_penalty must be at most 10, got 10.5"),
    ({"do_sample": "yes"}, 'parameters.do_sample must be true or false, got "yes" (a string)'),
    ({"do_sample": 1}, "parameters.do_sample must be true or false, got 1"),
    ({"manual_seed": -1}, "parameters.manual_seed must be at least 0, got -1"),
    ({"manual_seed": 2**63}, f"parameters.manual_seed must be less than {2**63}, got {2**63}"),
])
def test_out_of_range_or_mistyped_parameters_name_the_field_and_the_limit(parameters, message):
    [name] = parameters
    error = refused(with_params(**parameters))

    assert error.field == f"parameters.{name}"
    assert error.message == message


def test_the_max_new_tokens_limit_itself_is_allowed():
    assert parse(with_params(max_new_tokens=LIMIT)).parameters.max_new_tokens == LIMIT


def test_the_limit_comes_from_the_caller():
    error = refused(with_params(max_new_tokens=200), max_new_tokens_limit=128)
    assert error.message == "parameters.max_new_tokens must be at most 128, got 200"


def test_the_bounds_are_inclusive_where_documented():
    params = parse(with_params(top_p=1, typical_p=1.0, temperature=100, repetition_penalty=10,
                               top_k=0, manual_seed=2**63 - 1)).parameters
    assert (params.top_p, params.temperature, params.manual_seed) == (1.0, 100.0, 2**63 - 1)


def test_an_unknown_parameter_is_refused_with_a_suggestion():
    error = refused(with_params(max_tokens=10))

    assert error.field == "parameters.max_tokens"
    assert "not a known parameter" in error.message
    assert "did you mean max_new_tokens?" in error.message


def test_parameters_must_be_an_object():
    error = refused({"inputs": "a", "parameters": [1]})
    assert (error.field, error.message) == ("parameters", "parameters must be an object, got a list")


@pytest.mark.parametrize("stop, field, words", [
    ("", "parameters.stop", "must not be empty"),
    (["a", ""], "parameters.stop[1]", "must not be empty"),
    (["x" * 257], "parameters.stop[0]", "at most 256 characters long, got 257"),
    (["s"] * 17, "parameters.stop", "at most 16 entries, got 17"),
    (5, "parameters.stop", "must be a string or a list of strings"),
    (["a", 5], "parameters.stop[1]", "must be a string"),
])
def test_stop_sequences_are_checked(stop, field, words):
    error = refused(with_params(stop=stop))
    assert error.field == field
    assert words in error.message


def test_only_the_first_problem_is_reported():
    error = refused(with_params(top_k=-1, top_p=5))
    assert error.field == "parameters.top_k"


# -- the error body ---------------------------------------------------------------------


def test_to_dict_is_the_400_body():
    error = refused(with_params(max_new_tokens=5000))

    assert error.to_dict() == {
        "code": 400, "type": "RequestError", "field": "parameters.max_new_tokens",
        "message": "parameters.max_new_tokens must be at most 2048, got 5000"}
    assert str(error) == error.message


# -- raw bodies -------------------------------------------------------------------------


def test_parse_json_body_decodes_utf8_json():
    assert parse_json_body('{"inputs": "héllo"}'.encode("utf-8")) == {"inputs": "héllo"}
    assert parse_json_body(bytearray(b"[1]")) == [1]


@pytest.mark.parametrize("raw", [
    b"", b"   ", b"{", b"{'inputs': 'x'}", b'{"inputs": "x"} trailing',
    b"\xff\xfe{}", '{"inputs": "é"}'.encode("latin-1"), b'{"t": NaN}', b"Infinity",
])
def test_parse_json_body_refuses_what_is_not_utf8_json(raw):
    with pytest.raises(RequestError) as raised:
        parse_json_body(raw)

    assert raised.value.field == "body"
    assert "not valid JSON" in raised.value.message


# -- input length -----------------------------------------------------------------------


def test_check_input_length_names_the_prompt_and_the_option():
    with pytest.raises(RequestError) as raised:
        check_input_length("inputs[0]", 5000, 4096)

    assert raised.value.field == "inputs[0]"
    assert raised.value.message == (
        "inputs[0] is 5000 tokens long; the limit (option.max_input_length) is 4096")


def test_check_input_length_allows_a_prompt_at_the_limit():
    check_input_length("inputs", 4096, 4096)


# -- the parameters for benchmarks and scores, and the answer's shape -------------------


def test_the_newer_generation_parameters_are_carried_into_sampling_parameters():
    params = parse(with_params(max_new_tokens=9, min_new_tokens=4, ignore_eos=True,
                               logprobs=True)).parameters

    assert (params.min_new_tokens, params.ignore_eos, params.logprobs) == (4, True, True)
    assert params.top_logprobs == 0
    assert params.as_kwargs()["min_new_tokens"] == 4


def test_left_out_the_newer_parameters_reach_no_engine():
    # A custom engine written before them must not be handed unknown keywords.
    kwargs = parse(with_params(max_new_tokens=3, details=True, return_full_text=True)
                   ).parameters.as_kwargs()
    assert not {"min_new_tokens", "ignore_eos", "logprobs", "top_logprobs", "details",
                "return_full_text", "seed"} & set(kwargs)


def test_seed_is_another_name_for_manual_seed():
    assert parse(with_params(seed=7)).parameters.manual_seed == 7
    assert parse(with_params(seed=0)).parameters.as_kwargs()["manual_seed"] == 0


def test_seed_and_manual_seed_together_are_refused():
    error = refused(with_params(seed=1, manual_seed=1))
    assert error.field == "parameters.seed"
    assert "not both" in error.message and "manual_seed" in error.message


def test_top_logprobs_implies_logprobs_and_details():
    req = parse(with_params(top_logprobs=3))
    assert (req.parameters.logprobs, req.parameters.top_logprobs) == (True, 3)
    assert req.answer.details is True and req.answer.top_logprobs == 3


def test_logprobs_turn_details_on_and_an_explicit_false_is_refused():
    assert parse(with_params(logprobs=True)).answer.details is True
    for asked in ({"logprobs": True}, {"top_logprobs": 1}):
        error = refused(with_params(details=False, **asked))
        [name] = asked
        assert error.field == f"parameters.{name}"
        assert "parameters.details true or unset" in error.message


def test_details_is_left_to_the_protocol_when_not_given():
    assert parse({"inputs": "x"}).answer.details is None
    assert parse(with_params(details=False)).answer.details is False
    assert parse(with_params(details=True)).parameters.logprobs is False  # the protocol decides


def test_the_answer_keeps_the_prompts_as_sent():
    req = parse({"inputs": ["a", "b"], "parameters": {"return_full_text": True}})
    assert req.answer.inputs == ("a", "b") and req.answer.return_full_text is True


def test_return_full_text_needs_inputs_not_messages():
    error = refused({"messages": [{"role": "user", "content": "Hi"}],
                     "parameters": {"return_full_text": True}}, apply_chat_template=chat_template)
    assert error.field == "parameters.return_full_text"
    assert "chat template" in error.message and "send inputs" in error.message
    # false is harmless
    parse({"messages": [{"role": "user", "content": "Hi"}],
           "parameters": {"return_full_text": False}}, apply_chat_template=chat_template)


def test_min_new_tokens_may_not_exceed_max_new_tokens():
    assert parse(with_params(max_new_tokens=5, min_new_tokens=5)).parameters.min_new_tokens == 5
    error = refused(with_params(max_new_tokens=5, min_new_tokens=6))
    assert (error.field, error.message) == (
        "parameters.min_new_tokens",
        "parameters.min_new_tokens must be at most parameters.max_new_tokens (5), got 6")


def test_min_new_tokens_is_held_to_the_default_max_new_tokens_too():
    error = refused(with_params(min_new_tokens=51))
    assert error.message == ("parameters.min_new_tokens must be at most max_new_tokens "
                             "(50, option.default_max_new_tokens), got 51")


@pytest.mark.parametrize("parameters, message", [
    ({"min_new_tokens": -1}, "parameters.min_new_tokens must be at least 0, got -1"),
    ({"min_new_tokens": 2.5}, "parameters.min_new_tokens must be an integer, got 2.5"),
    ({"ignore_eos": "true"}, 'parameters.ignore_eos must be true or false, got "true" (a string)'),
    ({"ignore_eos": 1}, "parameters.ignore_eos must be true or false, got 1"),
    ({"seed": -3}, "parameters.seed must be at least 0, got -3"),
    ({"seed": 2**63}, f"parameters.seed must be less than {2**63}, got {2**63}"),
    ({"seed": "7"}, 'parameters.seed must be an integer, got "7" (a string)'),
    ({"logprobs": 1}, "parameters.logprobs must be true or false, got 1"),
    ({"top_logprobs": 21}, "parameters.top_logprobs must be at most 20, got 21"),
    ({"top_logprobs": -1}, "parameters.top_logprobs must be at least 0, got -1"),
    ({"top_logprobs": True}, "parameters.top_logprobs must be an integer, got true"),
    ({"details": "yes"}, 'parameters.details must be true or false, got "yes" (a string)'),
    ({"return_full_text": 0}, "parameters.return_full_text must be true or false, got 0"),
])
def test_the_newer_parameters_name_the_field_and_the_limit(parameters, message):
    [name] = parameters
    error = refused(with_params(**parameters))

    assert error.field == f"parameters.{name}"
    assert error.message == message


def test_the_largest_top_logprobs_is_the_engines():
    from djl_stream.generation.sampling import MAX_TOP_LOGPROBS
    from djl_stream.protocols.djl.request import MAX_TOP_LOGPROBS as SCHEMA_LIMIT

    assert SCHEMA_LIMIT == MAX_TOP_LOGPROBS
    assert parse(with_params(top_logprobs=SCHEMA_LIMIT)).parameters.top_logprobs == SCHEMA_LIMIT


@pytest.mark.parametrize("typo, suggestion", [
    ("detail", "details"), ("logprob", "logprobs"), ("top_logprob", "top_logprobs"),
    ("return_fulltext", "return_full_text"), ("ignore_eos_token", "ignore_eos"),
    ("min_tokens", "min_new_tokens"), ("max_tokens", "max_new_tokens"), ("sed", "seed"),
])
def test_unknown_keys_suggest_the_newer_parameters_too(typo, suggestion):
    error = refused(with_params(**{typo: 1}))
    assert error.field == f"parameters.{typo}"
    assert f"did you mean {suggestion}?" in error.message
