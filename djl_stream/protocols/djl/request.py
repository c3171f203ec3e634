"""Request parsing at the edge: JSON body -> :class:`GenerationRequest`, or a 400.

Two body forms, exactly one of ``inputs`` / ``messages``::

    {"inputs": "text" | ["text", ...], "parameters": {...}, "stream": true}
    {"messages": [{"role": "user", "content": "..."}], "parameters": {...}}

Generation parameters map onto :class:`SamplingParameters` (``seed`` is another name for
``manual_seed``; ``top_logprobs`` implies ``logprobs``). ``details`` and
``return_full_text`` only shape the answer: they travel in :class:`DjlAnswer`, with the
prompts as the client sent them.

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
    djl_stream.generation.errors.RequestError: parameters.max_new_tokens must be at most 2048, got 5000
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Callable, ClassVar, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from djl_stream.protocols.request import GenerationRequest, SamplingParameters
from djl_stream.protocols.schema import (FINITE, MAX_REPETITION_PENALTY, MAX_TEMPERATURE,
                                         MIN_REPETITION_PENALTY, MIN_TEMPERATURE, Prompt,
                                         StopList, one_or_many)
from djl_stream.protocols.validation import RequestError, describe, request_error

#: The most alternatives per token (``top_logprobs``): the engine's limit,
#: ``djl_stream.generation.sampling.MAX_TOP_LOGPROBS``, which is not imported here because
#: that module imports torch and ``model.py`` must import cheaply.
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class DjlAnswer:
    """What djl's answer writers need beyond the generation (``GenerationRequest.answer``).

    ``inputs`` are the prompts as the client sent them (``return_full_text`` puts them in
    front of the generated text, even where the chat template wrapped them for the model).
    ``details`` is the request's ``details``: ``None`` when it gave none (then the output
    formatter decides for a stream: ``jsonlines_details`` writes them), turned on by
    ``logprobs``/``top_logprobs``. ``top_logprobs`` asks each token record for that many
    alternatives.

    >>> DjlAnswer(("Hi",), details=True).details
    True
    """

    inputs: tuple[str, ...]
    details: Optional[bool] = None
    return_full_text: bool = False
    top_logprobs: int = 0


# ---------------------------------------------------------------------------------------
# The schema (its pieces shared with the other protocols: djl_stream.protocols.schema).
# Strings and lists that may also be one string are normalised to lists before
# validation; RequestError paths are mapped back to what the client sent.


class DjlParameters(BaseModel):
    """Generation parameters of djl-serving's request."""

    model_config = ConfigDict(strict=True, extra="forbid")

    # The upper bound of max_new_tokens is a model property, checked after validation.
    max_new_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE,
                                         **FINITE)
    top_k: Optional[int] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1, **FINITE)
    typical_p: Optional[float] = Field(None, gt=0, le=1, **FINITE)
    repetition_penalty: Optional[float] = Field(None, ge=MIN_REPETITION_PENALTY,
                                                le=MAX_REPETITION_PENALTY, **FINITE)
    do_sample: Optional[bool] = None
    manual_seed: Optional[int] = Field(None, ge=0, lt=2**63)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)  # another name for manual_seed
    stop: StopList = None
    # The upper bound of min_new_tokens is the request's max_new_tokens, checked after.
    min_new_tokens: Optional[int] = Field(None, ge=0)
    ignore_eos: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    details: Optional[bool] = None
    return_full_text: Optional[bool] = None

    #: Keys that shape the answer, not the generation (they go to DjlAnswer).
    ANSWER_KEYS: ClassVar[tuple[str, ...]] = ("details", "return_full_text")


class DjlMessage(BaseModel):
    """One chat message."""

    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: Prompt


class DjlRequest(BaseModel):
    """djl-serving's request: ``inputs`` (one prompt or several) or ``messages``, with
    ``parameters``; ``stream`` overrides ``option.enable_streaming``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    # The length bound inside Optional: around it, pydantic applies it to None and raises
    # a TypeError (a 424) for "inputs": null.
    inputs: Annotated[Optional[Annotated[list[Prompt], Field(min_length=1)]],
                      BeforeValidator(one_or_many)] = None
    messages: Optional[list[DjlMessage]] = Field(None, min_length=1)
    parameters: Optional[DjlParameters] = None
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
        return DjlParameters, "parameter"
    if parent.startswith("messages"):
        return DjlMessage, "message key"
    return DjlRequest, "key"


# ---------------------------------------------------------------------------------------
# Entry points


def parse_request(body: Any, *, default_max_new_tokens: int, max_new_tokens_limit: int,
                  apply_chat_template: Callable[[list[dict[str, str]]], str] | None = None
                  ) -> GenerationRequest:
    """Validate a decoded body into a :class:`GenerationRequest`.

    ``max_new_tokens`` defaults to ``default_max_new_tokens`` and may not exceed
    ``max_new_tokens_limit``; ``min_new_tokens`` may not exceed ``max_new_tokens``.
    ``messages`` are rendered with ``apply_chat_template``; without one, a chat request is
    refused. ``seed`` becomes ``manual_seed`` (giving both is refused), ``top_logprobs``
    turns ``logprobs`` on, and either turns ``details`` on unless it is ``false`` (refused:
    the scores are only written in the details).

    >>> req = parse_request({"inputs": "Hi", "parameters": {"seed": 7, "top_logprobs": 2}},
    ...                     default_max_new_tokens=50, max_new_tokens_limit=2048)
    >>> req.parameters.manual_seed, req.parameters.logprobs, req.answer
    (7, True, DjlAnswer(inputs=('Hi',), details=True, return_full_text=False, top_logprobs=2))

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
        parsed = DjlRequest.model_validate(body)
    except ValidationError as err:
        raise request_error(err, body, _known_keys, _EXPECTED_BY_FIELD) from None
    if parsed.inputs is None and parsed.messages is None:
        raise RequestError("inputs", "inputs is required (or messages, for a chat request)")

    params = parsed.parameters or DjlParameters()
    parameters = _sampling_parameters(params, default_max_new_tokens, max_new_tokens_limit)
    answer = _answer(params, parsed)

    if parsed.inputs is not None:
        return GenerationRequest(prompts=tuple(parsed.inputs), parameters=parameters,
                                 stream=parsed.stream, batched=isinstance(body["inputs"], list),
                                 answer=answer)

    if apply_chat_template is None:
        raise RequestError("messages", "messages need a chat template and this model has "
                                       "none; send inputs instead")
    messages = tuple({"role": m.role, "content": m.content} for m in parsed.messages)
    try:
        prompt = apply_chat_template([dict(m) for m in messages])
    except Exception as err:  # a template raising on odd turn orders is the client's to fix
        raise RequestError("messages", f"the chat template rejected the messages: {err}") from None
    return GenerationRequest(prompts=(prompt,), parameters=parameters, stream=parsed.stream,
                             batched=False, messages=messages, answer=answer)


def _sampling_parameters(params: DjlParameters, default_max_new_tokens: int,
                         max_new_tokens_limit: int) -> SamplingParameters:
    """The generation parameters of a validated ``parameters`` object, with the limits
    that depend on the model or on other parameters checked."""
    if params.max_new_tokens is not None and params.max_new_tokens > max_new_tokens_limit:
        raise RequestError("parameters.max_new_tokens",
                           f"parameters.max_new_tokens must be at most {max_new_tokens_limit}, "
                           f"got {params.max_new_tokens}")
    max_new_tokens = params.max_new_tokens or default_max_new_tokens
    if params.min_new_tokens is not None and params.min_new_tokens > max_new_tokens:
        limit = (f"parameters.max_new_tokens ({max_new_tokens})"
                 if params.max_new_tokens is not None
                 else f"max_new_tokens ({max_new_tokens}, option.default_max_new_tokens)")
        raise RequestError("parameters.min_new_tokens",
                           f"parameters.min_new_tokens must be at most {limit}, "
                           f"got {params.min_new_tokens}")
    if params.seed is not None and params.manual_seed is not None:
        raise RequestError("parameters.seed",
                           "give parameters.seed or parameters.manual_seed, not both "
                           "(seed is another name for manual_seed)")
    if params.details is False and (params.logprobs or params.top_logprobs):
        asked = "top_logprobs" if params.top_logprobs else "logprobs"
        raise RequestError(f"parameters.{asked}",
                           f"parameters.{asked} are written in the per-token details; "
                           f"leave parameters.details true or unset")

    set_values = params.model_dump(exclude_none=True, exclude=set(DjlParameters.ANSWER_KEYS))
    set_values["max_new_tokens"] = max_new_tokens
    set_values["stop"] = tuple(set_values.get("stop", ()))
    if "seed" in set_values:
        set_values["manual_seed"] = set_values.pop("seed")
    if set_values.get("top_logprobs"):
        set_values["logprobs"] = True
    return SamplingParameters(**set_values)


def _answer(params: DjlParameters, parsed: DjlRequest) -> DjlAnswer:
    if params.return_full_text and parsed.messages is not None:
        raise RequestError("parameters.return_full_text",
                           "parameters.return_full_text needs inputs: a messages request's "
                           "prompt is the chat template's rendering of the conversation, "
                           "not text the client sent; send inputs, or leave it out")
    details = params.details
    if details is None and (params.logprobs or params.top_logprobs):
        details = True  # the scores are only ever written in the details
    return DjlAnswer(inputs=tuple(parsed.inputs or ()), details=details,
                     return_full_text=bool(params.return_full_text),
                     top_logprobs=params.top_logprobs or 0)
