"""Request parsing at the edge: JSON body -> :class:`GenerationRequest`, or a 400.

Two body forms, exactly one of ``inputs`` / ``messages``::

    {"inputs": "text" | ["text", ...], "parameters": {...}, "stream": true}
    {"messages": [{"role": "user", "content": "..."}], "parameters": {...}}

Validation is strict (``"5"`` is not an integer, ``true`` is not a number) and stops at
the first problem, reported as a :class:`RequestError` that names the field and the limit.
Past this module nothing checks types again.

    >>> req = parse_request({"inputs": "Hello", "parameters": {"max_new_tokens": 8}},
    ...                     default_max_new_tokens=50, max_new_tokens_limit=2048)
    >>> req.prompts, req.parameters.max_new_tokens, req.parameters.do_sample
    (('Hello',), 8, False)
    >>> parse_request({"inputs": "Hi", "parameters": {"max_new_tokens": 5000}},
    ...               default_max_new_tokens=50, max_new_tokens_limit=2048)
    Traceback (most recent call last):
    ...
    djl_stream.protocols.validation.RequestError: parameters.max_new_tokens must be at most 2048, got 5000
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError)
from pydantic_core import PydanticCustomError

from djl_stream.protocols.request import GenerationRequest, SamplingParameters
from djl_stream.protocols.validation import RequestError, describe, request_error

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256


# ---------------------------------------------------------------------------------------
# The schema. Strings and lists that may also be one string are normalised to lists
# before validation; RequestError paths are mapped back to what the client sent.


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _not_blank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("blank", "must not be empty or whitespace only")
    return text


_Prompt = Annotated[str, AfterValidator(_not_blank)]
_Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
_Float = dict(allow_inf_nan=False)


class _Parameters(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    # The upper bound of max_new_tokens is a model property, checked after validation.
    max_new_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, gt=0, le=100, **_Float)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1, **_Float)
    typical_p: Optional[float] = Field(None, gt=0, le=1, **_Float)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10, **_Float)
    do_sample: Optional[bool] = None
    manual_seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Annotated[Optional[list[_Stop]],
                    BeforeValidator(_as_list), Field(max_length=MAX_STOP_SEQUENCES)] = None


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: _Prompt


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    inputs: Annotated[Optional[list[_Prompt]], BeforeValidator(_as_list),
                      Field(min_length=1)] = None
    messages: Optional[list[_Message]] = Field(None, min_length=1)
    parameters: Optional[_Parameters] = None
    stream: Optional[bool] = None


# ---------------------------------------------------------------------------------------
# pydantic errors -> one RequestError


_EXPECTED_BY_FIELD = {
    "inputs": "a string or a list of strings",
    "parameters.stop": "a string or a list of strings",
    "messages": "a list of {\"role\", \"content\"} objects",
}


def _known_keys(parent: str) -> tuple[type[BaseModel], str]:
    if parent == "parameters":
        return _Parameters, "parameter"
    if parent.startswith("messages"):
        return _Message, "message key"
    return _Body, "key"


# ---------------------------------------------------------------------------------------
# Entry points


def parse_request(body: Any, *, default_max_new_tokens: int, max_new_tokens_limit: int,
                  apply_chat_template: Callable[[list[dict[str, str]]], str] | None = None
                  ) -> GenerationRequest:
    """Validate a decoded body into a :class:`GenerationRequest`.

    ``max_new_tokens`` defaults to ``default_max_new_tokens`` and may not exceed
    ``max_new_tokens_limit``. ``messages`` are rendered with ``apply_chat_template``;
    without one, a chat request is refused.

    >>> template = lambda msgs: "".join(f"<{m['role']}>{m['content']}" for m in msgs)
    >>> req = parse_request({"messages": [{"role": "user", "content": "Hi"}]},
    ...                     default_max_new_tokens=50, max_new_tokens_limit=2048,
    ...                     apply_chat_template=template)
    >>> req.prompts, req.batched
    (('<user>Hi',), False)
    """
    if not isinstance(body, dict):
        raise RequestError("body", "the request body must be a JSON object with \"inputs\" "
                                   f"or \"messages\", got {describe(body)}")
    if body.get("inputs") is not None and body.get("messages") is not None:
        raise RequestError("body", "give either inputs or messages, not both")
    try:
        parsed = _Body.model_validate(body)
    except ValidationError as err:
        raise request_error(err, body, _known_keys, _EXPECTED_BY_FIELD) from None
    if parsed.inputs is None and parsed.messages is None:
        raise RequestError("inputs", "inputs is required (or messages, for a chat request)")

    params = parsed.parameters or _Parameters()
    if params.max_new_tokens is not None and params.max_new_tokens > max_new_tokens_limit:
        raise RequestError("parameters.max_new_tokens",
                           f"parameters.max_new_tokens must be at most {max_new_tokens_limit}, "
                           f"got {params.max_new_tokens}")
    set_values = params.model_dump(exclude_none=True)
    set_values["max_new_tokens"] = set_values.get("max_new_tokens", default_max_new_tokens)
    set_values["stop"] = tuple(set_values.get("stop", ()))
    parameters = SamplingParameters(**set_values)

    if parsed.inputs is not None:
        return GenerationRequest(prompts=tuple(parsed.inputs), parameters=parameters,
                                 stream=parsed.stream, batched=isinstance(body["inputs"], list))

    if apply_chat_template is None:
        raise RequestError("messages", "messages need a chat template and this model has "
                                       "none; send inputs instead")
    messages = tuple({"role": m.role, "content": m.content} for m in parsed.messages)
    try:
        prompt = apply_chat_template([dict(m) for m in messages])
    except Exception as err:  # a template raising on odd turn orders is the client's to fix
        raise RequestError("messages", f"the chat template rejected the messages: {err}") from None
    return GenerationRequest(prompts=(prompt,), parameters=parameters, stream=parsed.stream,
                             batched=False, messages=messages)


