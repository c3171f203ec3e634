"""The limits every protocol shares (djl_stream.protocols.schema): the same engine behind
djl's, OpenAI's and TGI's routes refuses the same values, naming the field and the limit."""

from __future__ import annotations

import pytest

from djl_stream.protocols.djl.request import parse_request as parse_djl
from djl_stream.protocols.openai.request import parse_chat, parse_completion
from djl_stream.protocols.protocol import ParseContext
from djl_stream.protocols.schema import (MAX_REPETITION_PENALTY, MAX_STOP_LENGTH,
                                         MAX_STOP_SEQUENCES, MAX_TEMPERATURE)
from djl_stream.protocols.tgi.request import parse_request as parse_tgi
from djl_stream.protocols.validation import RequestError

CONTEXT = ParseContext(default_max_new_tokens=50, max_new_tokens_limit=256, max_batch_size=8,
                       model_name="tiny", render_chat=lambda messages: messages[-1]["content"])
MESSAGES = [{"role": "user", "content": "Hi"}]


def djl(**parameters):
    return parse_djl({"inputs": "Hi", "parameters": parameters}, default_max_new_tokens=50,
                     max_new_tokens_limit=256)


def tgi(**parameters):
    return parse_tgi({"inputs": "Hi", "parameters": parameters}, CONTEXT, route_stream=False)


def chat(**parameters):
    return parse_chat({"model": "tiny", "messages": MESSAGES, **parameters}, CONTEXT)


def completion(**parameters):
    return parse_completion({"model": "tiny", "prompt": "Hi", **parameters}, CONTEXT)


#: Each protocol's parser, and where its parameters sit in a field's name.
PROTOCOLS = {"djl": (djl, "parameters."), "tgi": (tgi, "parameters."), "chat": (chat, ""),
             "completion": (completion, "")}


@pytest.fixture(params=sorted(PROTOCOLS))
def protocol(request):
    return PROTOCOLS[request.param]


def refusal(parse, **parameters) -> RequestError:
    with pytest.raises(RequestError) as caught:
        parse(**parameters)
    return caught.value


def test_one_stop_string_more_than_the_limit_is_refused(protocol):
    parse, prefix = protocol
    assert parse(stop=["."] * MAX_STOP_SEQUENCES).parameters.stop == (".",) * MAX_STOP_SEQUENCES
    error = refusal(parse, stop=["."] * (MAX_STOP_SEQUENCES + 1))
    assert error.field == f"{prefix}stop"
    assert f"at most {MAX_STOP_SEQUENCES}" in str(error)


def test_a_stop_string_longer_than_the_limit_is_refused(protocol):
    parse, prefix = protocol
    assert parse(stop="x" * MAX_STOP_LENGTH).parameters.stop == ("x" * MAX_STOP_LENGTH,)
    error = refusal(parse, stop="x" * (MAX_STOP_LENGTH + 1))
    assert error.field.startswith(f"{prefix}stop")
    assert f"at most {MAX_STOP_LENGTH} characters" in str(error)


def test_a_repetition_penalty_above_the_limit_is_refused(protocol):
    parse, prefix = protocol
    accepted = parse(repetition_penalty=MAX_REPETITION_PENALTY)
    assert accepted.parameters.repetition_penalty == MAX_REPETITION_PENALTY
    error = refusal(parse, repetition_penalty=MAX_REPETITION_PENALTY * 1.5)
    assert error.field == f"{prefix}repetition_penalty"
    assert "at most 10" in str(error)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_temperature_that_is_not_finite_is_refused(protocol, value):
    parse, prefix = protocol
    assert refusal(parse, temperature=value).field == f"{prefix}temperature"


def test_djl_and_tgi_share_the_temperature_limit():
    for parse in (djl, tgi):
        assert parse(do_sample=True, temperature=MAX_TEMPERATURE).parameters.temperature == \
            MAX_TEMPERATURE
        assert "at most 100" in str(refusal(parse, do_sample=True,
                                            temperature=MAX_TEMPERATURE * 2))
