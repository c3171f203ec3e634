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
    djl_stream.protocols.djl.request.RequestError: parameters.max_new_tokens must be at most 2048, got 5000
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      ValidationError)
from pydantic_core import PydanticCustomError

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256


class RequestError(ValueError):
    """The request is malformed; answered with HTTP 400 and :meth:`to_dict` as the body.

    ``field`` is a dotted path into the body (``parameters.top_p``, ``inputs[1]``,
    ``messages[0].role``), or ``body`` for the body as a whole.

    >>> RequestError("parameters.top_p", "parameters.top_p must be at most 1, got 2").to_dict()
    {'code': 400, 'type': 'RequestError', 'field': 'parameters.top_p', 'message': 'parameters.top_p must be at most 1, got 2'}
    """

    code = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "type": "RequestError", "field": self.field,
                "message": self.message}


@dataclasses.dataclass(frozen=True)
class SamplingParameters:
    """Validated generation parameters.

    As in transformers' ``generate()``, sampling happens only when ``do_sample`` is true:
    ``temperature``, ``top_k``, ``top_p`` and ``typical_p`` are accepted on their own but
    change nothing while decoding stays greedy. ``top_k=0`` switches top-k off;
    ``manual_seed`` makes sampling repeatable.

    >>> SamplingParameters(max_new_tokens=16, do_sample=True, stop=("\\n\\n",)).as_kwargs()["stop"]
    ['\\n\\n']
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = False
    manual_seed: int | None = None
    stop: tuple[str, ...] = ()

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a stream generator (``**parameters``).

        ``stop`` becomes a list; ``manual_seed`` is left out when unset.
        """
        kwargs = dataclasses.asdict(self)
        kwargs["stop"] = list(self.stop)
        if self.manual_seed is None:
            del kwargs["manual_seed"]
        return kwargs


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One parsed request.

    ``prompts`` has one entry per sequence to generate; for a chat request it is the one
    prompt the chat template rendered, and ``messages`` keeps what the client sent.
    ``batched`` is true when ``inputs`` was a list, so a non-streaming answer is a list too.
    ``stream`` is ``None`` when the client left it to the server's default.
    """

    prompts: tuple[str, ...]
    parameters: SamplingParameters
    stream: bool | None = None
    batched: bool = False
    messages: tuple[dict[str, str], ...] | None = None


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


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "an object",
    "dict_type": "an object",
}
_EXPECTED_BY_FIELD = {
    "inputs": "a string or a list of strings",
    "parameters.stop": "a string or a list of strings",
    "messages": "a list of {\"role\", \"content\"} objects",
}
_BOUNDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "at least"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "at most"),
}


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def _describe(value: Any) -> str:
    """A JSON-ish rendering of what the client sent, short enough for a message."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        text = json.dumps(value if len(value) <= 40 else value[:40] + "...", ensure_ascii=False)
        return f"{text} (a string)"
    if isinstance(value, float):
        return _number(value)
    return json.dumps(value)


def _field_path(loc: tuple[Any, ...], body: Any) -> str:
    # Walk the raw body next to the error location, dropping the index pydantic added
    # where a single string was wrapped in a list: the client wrote "inputs", not "inputs[0]".
    path, raw = "", body
    for part in loc:
        if isinstance(part, int):
            if not isinstance(raw, list):
                continue
            path += f"[{part}]"
            raw = raw[part] if 0 <= part < len(raw) else None
        else:
            path += f".{part}" if path else str(part)
            raw = raw.get(part) if isinstance(raw, dict) else None
    return path or "body"


def _known_keys(model: type[BaseModel]) -> list[str]:
    return sorted(model.model_fields)


def _unknown_key_message(field: str) -> str:
    parent, _, name = field.rpartition(".")
    model, what = (_Parameters, "parameter") if parent == "parameters" else (
        _Message, "message key") if parent.startswith("messages") else (_Body, "key")
    known = _known_keys(model)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{field} is not a known {what}; {hint}known: {', '.join(known)}"


def _to_request_error(error: ValidationError, body: Any) -> RequestError:
    first = error.errors(include_url=False)[0]
    kind, ctx, value = first["type"], first.get("ctx") or {}, first.get("input")
    field = _field_path(tuple(first["loc"]), body)
    if kind == "extra_forbidden":
        message = _unknown_key_message(field)
    elif kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        message = f"{field} must be {words} {_number(ctx[key])}, got {_describe(value)}"
    elif kind in _EXPECTED:
        expected = _EXPECTED_BY_FIELD.get(field, _EXPECTED[kind])
        message = f"{field} must be {expected}, got {_describe(value)}"
    elif kind == "too_short" and ctx.get("min_length") == 1:
        message = f"{field} must not be empty"
    elif kind == "too_long":
        message = (f"{field} must have at most {ctx['max_length']} entries, "
                   f"got {ctx.get('actual_length', len(value))}")
    elif kind == "blank":
        message = f"{field} must not be empty or whitespace only"
    elif kind == "string_too_short":
        message = f"{field} must not be empty"
    elif kind == "string_too_long":
        message = (f"{field} must be at most {ctx['max_length']} characters long, "
                   f"got {len(value)}")
    elif kind == "literal_error":
        message = f"{field} must be one of {ctx['expected']}, got {_describe(value)}"
    elif kind == "finite_number":
        message = f"{field} must be a finite number, got {_describe(value)}"
    elif kind == "missing":
        message = f"{field} is required"
    else:
        message = f"{field}: {first['msg']}"
    return RequestError(field, message)


# ---------------------------------------------------------------------------------------
# Entry points


def parse_json_body(raw: bytes | bytearray | memoryview | str) -> Any:
    """Decode a request body; anything but UTF-8 JSON is a :class:`RequestError` on ``body``.

    ``NaN`` and ``Infinity`` are refused too: they are not JSON, only Python accepts them.

    >>> parse_json_body(b'{"inputs": "\\xe4\\xbd\\xa0\\xe5\\xa5\\xbd"}')
    {'inputs': '你好'}
    """
    if isinstance(raw, str):
        text = raw
    else:
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError("body", f"the request body is not valid JSON: it is not UTF-8 "
                                       f"(byte {err.start})") from None
    if not text.strip():
        raise RequestError("body", "the request body is not valid JSON: it is empty")

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a JSON value")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError as err:  # JSONDecodeError is a ValueError, and so is refuse()'s
        raise RequestError("body", f"the request body is not valid JSON: {err}") from None


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
                                   f"or \"messages\", got {_describe(body)}")
    if body.get("inputs") is not None and body.get("messages") is not None:
        raise RequestError("body", "give either inputs or messages, not both")
    try:
        parsed = _Body.model_validate(body)
    except ValidationError as err:
        raise _to_request_error(err, body) from None
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


def check_input_length(field: str, n_tokens: int, limit: int) -> None:
    """Refuse a prompt longer than ``option.max_input_length``.

    >>> check_input_length("inputs[0]", 5000, 4096)
    Traceback (most recent call last):
    ...
    djl_stream.protocols.djl.request.RequestError: inputs[0] is 5000 tokens long; the limit (option.max_input_length) is 4096
    """
    if n_tokens > limit:
        raise RequestError(field, f"{field} is {n_tokens} tokens long; "
                                  f"the limit (option.max_input_length) is {limit}")
