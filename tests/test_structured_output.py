"""Structured output: OpenAI's ``response_format`` and TGI's ``grammar``, followed while
decoding (llguidance), each row with its own matcher inside the running batch.

Through the real clients against a real server on the tiny random model: the openai SDK
(streamed and not, 100 sampled answers under a schema, beside unconstrained requests) and
huggingface_hub's ``grammar``; the parsing of each shape and its errors; and LangChain's
``with_structured_output`` on the embedded model."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pytest
from server_process import serving

from djl_stream.generation.errors import RequestError
from djl_stream.protocols.openai.request import parse_chat
from djl_stream.protocols.protocol import ParseContext
from djl_stream.protocols.tgi.request import parse_request

#: Bounded, so that even a random model's sampled answers end within the token budget.
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3}},
          "required": ["name", "age", "role", "tags"], "additionalProperties": False}
HI = [{"role": "user", "content": "Describe a person."}]


def context(check=lambda spec: None) -> ParseContext:
    return ParseContext(16, 256, 8, "m", render_chat=lambda ms: ms[-1]["content"],
                        check_grammar=check)


@pytest.mark.parametrize("response_format, grammar", [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, ("json_object", "")),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}},
     ("json_schema", json.dumps(PERSON))),
])
def test_response_format_becomes_the_grammar(response_format, grammar):
    body = {"messages": HI, "response_format": response_format}
    assert parse_chat(body, context()).parameters.grammar == grammar


@pytest.mark.parametrize("response_format, field, words", [
    ({"type": "xml"}, "response_format.type", "must be one of text, json_object or json_schema"),
    ({"type": "json_schema"}, "response_format.json_schema", "must be an object with name"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": []}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ("json", "response_format", "must be an object with a type"),
])
def test_a_bad_response_format_names_its_field(response_format, field, words):
    with pytest.raises(RequestError) as refused:
        parse_chat({"messages": HI, "response_format": response_format}, context())
    assert refused.value.field == field and words in refused.value.message


def test_an_engine_without_constrained_decoding_refuses_a_grammar():
    with pytest.raises(RequestError, match="response_format is not supported by this engine"):
        parse_chat({"messages": HI, "response_format": {"type": "json_object"}},
                   context(check=None))


@pytest.mark.parametrize("grammar, expected", [
    ({"type": "json", "value": PERSON}, ("json_schema", json.dumps(PERSON))),
    ({"type": "json_object", "value": json.dumps(PERSON)}, ("json_schema", json.dumps(PERSON))),
    ({"type": "regex", "value": "[0-9]+"}, ("regex", "[0-9]+")),
])
def test_tgi_grammar_becomes_the_grammar(grammar, expected):
    request = parse_request({"inputs": "Hi", "parameters": {"grammar": grammar}}, context(),
                            route_stream=False)
    assert request.parameters.grammar == expected


def test_a_schema_the_grammar_library_refuses_is_a_400_with_its_words(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "p", "schema": {"type": "wat"}}})
    assert refused.value.body["param"] == "response_format.json_schema.schema"
    assert refused.value.body["message"].startswith(
        "response_format.json_schema.schema cannot be followed: ")


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_a_hundred_sampled_answers_all_follow_the_schema_beside_free_requests(client):
    answers, free = [], []

    def constrained(seeds):
        for seed in seeds:  # (3 choices a request: the tiny model's input limit)
            reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=60,
                                                   temperature=1.0, n=3, seed=seed,
                                                   response_format=PERSON_FORMAT)
            answers.extend(choice.message.content for choice in reply.choices)

    def unconstrained():
        reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=30,
                                               temperature=0)
        free.append(reply.choices[0].message.content)

    seeds = [3 * k for k in range(34)]  # (choice i of seed s draws with s + i: all apart)
    threads = [threading.Thread(target=constrained, args=(seeds[start::4],))
               for start in range(4)]
    threads += [threading.Thread(target=unconstrained) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert len(answers) == 102
    for answer in answers:
        jsonschema.validate(json.loads(answer), PERSON)
    assert len(set(answers)) > 80  # sampled: they differ
    # the batch mates without a grammar got their own free text, not JSON
    assert len(free) == 2 and free[0] == free[1]
    with pytest.raises(ValueError):
        json.loads(free[0])


def test_a_streamed_answer_follows_the_schema_too(client):
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=HI, max_tokens=60, temperature=0, stream=True,
        response_format=PERSON_FORMAT) if chunk.choices]
    assert len(pieces) > 3
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


def test_json_object_mode_gives_a_json_object(client):
    reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=200,
                                           temperature=0, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # the random model may write a long object: what came is a JSON object's start
        assert reply.choices[0].message.content.startswith("{")


def test_tgi_s_grammar_through_huggingface_hub(server):
    from huggingface_hub import InferenceClient

    tgi = InferenceClient(base_url=server.url)
    phone = tgi.text_generation("Call me at", max_new_tokens=20, grammar={
        "type": "regex", "value": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone)
    person = tgi.text_generation("Describe a person.", max_new_tokens=60, do_sample=True,
                                 seed=3, grammar={"type": "json", "value": PERSON})
    jsonschema.validate(json.loads(person), PERSON)


@pytest.mark.embedded
def test_langchain_s_structured_output_gets_a_valid_object_from_the_embedded_model(
        embedded_model_dir):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Capital(BaseModel):
        """A country's capital city."""

        city: str
        country: str

    with serving(embedded_model_dir) as process:
        llm = ChatOpenAI(base_url=process.url + "/v1", api_key="unused", model="model",
                         temperature=0, max_tokens=48)
        # LangChain's default: OpenAI's response_format json_schema, strict
        answer = llm.with_structured_output(Capital).invoke("What is the capital of France?")
    assert isinstance(answer, Capital)
    assert answer.city and answer.country


def test_without_llguidance_a_grammar_is_refused_saying_what_is_missing():
    from djl_stream.generation.grammar import GrammarsUnavailable

    with pytest.raises(RequestError) as refused:
        parse_chat({"messages": HI, "response_format": {"type": "json_object"}},
                   context(check=GrammarsUnavailable().check))
    assert refused.value.field == "response_format"
    assert "needs the llguidance package" in refused.value.message
