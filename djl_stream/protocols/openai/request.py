"""OpenAI request bodies at the edge: ``/v1/chat/completions`` and ``/v1/completions``.

Each body is validated with a strict pydantic model into the protocol-neutral
:class:`~djl_stream.protocols.request.GenerationRequest`, or refused with one
:class:`~djl_stream.protocols.validation.RequestError` naming the field and the limit,
worded as on djl's routes. What OpenAI's parameters become:

- ``max_completion_tokens`` (chat) or ``max_tokens`` → ``max_new_tokens`` (default
  ``option.default_max_new_tokens``, at most ``option.max_new_tokens_limit``);
- ``temperature`` 0 (or below 1e-4, which would overflow the scores, as vLLM treats
  its own epsilon) → greedy decoding; above (OpenAI's default is 1) → sampling with
  that temperature and ``top_p``; ``seed`` → ``manual_seed``; ``stop`` as on djl's routes;
- ``n`` → the prompt repeated ``n`` times (``n`` × prompts at most
  ``option.max_rolling_batch_size``);
- ``logprobs`` / ``top_logprobs`` (chat: a bool and 0–20; completions: an int 0–20) →
  the engine's ``logprobs`` / ``top_logprobs``;
- ``presence_penalty`` and ``frequency_penalty`` (-2 to 2) and ``logit_bias`` (token id
  strings to -100..100) → the engine's parameters of those names;
- ``n`` with ``seed``: one seed per choice (``seed``, ``seed + 1``...), so the choices
  differ and the whole answer repeats;
- vLLM's extensions ``top_k``, ``repetition_penalty``, ``min_tokens`` and ``ignore_eos``
  map to the engine's parameters of those names.

- ``response_format`` (chat) → a grammar the answer follows: any JSON object for
  ``json_object``, the schema for ``json_schema``
  (:mod:`djl_stream.generation.grammar`);

- ``tools`` and ``tool_choice`` (chat) → the tools shown to the model through its chat
  template, and the calls read back from its answer; a forced choice decodes under a
  grammar (:mod:`djl_stream.protocols.openai.tools`).

Parameters this server cannot honour (``functions``, ``echo``...) are accepted only at
the value that asks for nothing, and refused otherwise:
never silently ignored. What changes nothing about the answer (``model``, ``user``,
``metadata``, ``store``...) is accepted.

    >>> from djl_stream.protocols.protocol import ParseContext, checked_grammar
    >>> context = ParseContext(default_max_new_tokens=50, max_new_tokens_limit=2048,
    ...                        max_batch_size=32, model_name="model")
    >>> request = parse_completion({"prompt": "Once", "max_tokens": 8, "temperature": 0,
    ...                             "n": 2}, context)
    >>> request.prompts, request.parameters.max_new_tokens, request.parameters.do_sample
    (('Once', 'Once'), 8, False)
    >>> parse_completion({"prompt": "Once", "echo": True}, context)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: echo is not supported by this server: leave it out or set it to false, got true
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, Field, ValidationError
from pydantic_core import PydanticCustomError

from djl_stream.protocols.openai.tools import (CalledFunction, FunctionSpec, ToolCall,
                                               ToolSpec, ToolUse, chat_for_template)
from djl_stream.protocols.protocol import ParseContext, checked_grammar
from djl_stream.protocols.request import GenerationRequest, SamplingParameters
from djl_stream.protocols.schema import (FINITE, Closed, MAX_REPETITION_PENALTY,
                                         MIN_REPETITION_PENALTY, MIN_TEMPERATURE, Prompt,
                                         StopList, one_or_many)
from djl_stream.protocols.validation import RequestError, describe, request_error

#: OpenAI's own bounds.
MAX_TOP_LOGPROBS = 20
MAX_OPENAI_TEMPERATURE = 2.0


@dataclasses.dataclass(frozen=True)
class Answer:
    """What the OpenAI writers need beyond the generation (``GenerationRequest.answer``).

    ``n`` choices per prompt (the prompts were repeated ``n`` times, each prompt's copies
    side by side); ``include_usage`` asks for the closing usage chunk of a stream;
    ``logprobs`` / ``top_logprobs`` for per-token log-probabilities; ``prompt_count`` is
    how many prompts the client sent; ``max_tokens_field`` the parameter that set the
    length (``max_completion_tokens`` or ``max_tokens``), for errors about it.
    """

    n: int = 1
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_count: int = 1
    max_tokens_field: str = "max_tokens"
    #: the tools the answer may call, and how (chat only; None: its text is the answer)
    tools: Optional[ToolUse] = None


# ---------------------------------------------------------------------------------------
# The schema. Strict (``"5"`` is not an integer) and closed (an unknown key is refused
# with the closest known name), like djl's, from the pieces every protocol shares.


class StreamOptions(Closed):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: Optional[bool] = None
    # Obfuscation pads chunks against side channels on OpenAI's service; nothing to pad here.
    include_obfuscation: Optional[bool] = None


class TextPart(Closed):
    """One part of a message's ``content`` given as a list: only text parts are served."""

    type: Literal["text"]
    text: str


def _content(value: Any) -> Any:
    # A string is one text part. The alternatives are told apart here because pydantic's
    # union errors would name the union's members in the field path ("content.str").
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if value is None or isinstance(value, list):
        return value
    raise PydanticCustomError("content_type", "must be a string or a list of text parts, "
                              "got {got}", {"got": describe(value)})


class ChatMessage(Closed):
    """One turn. ``developer`` is OpenAI's newer name for ``system``; an assistant turn
    may carry the ``tool_calls`` it made, and a ``tool`` turn the result of the call its
    ``tool_call_id`` names. A ``name`` goes to the chat template with a tool result only."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Optional[list[TextPart]], BeforeValidator(_content)] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    # OpenAI's answers carry it, so a client that appends an answer to the conversation
    # sends it back; not shown to the template.
    refusal: Optional[str] = None

    def text(self) -> str:
        """The content as one string (parts joined by newlines, as vLLM and djl-serving's
        LMI join them; no content is the empty string)."""
        return "\n".join(part.text for part in self.content or ())


class _Common(Closed):
    """Parameters both endpoints share."""

    model: Optional[str] = None
    # The upper bound is the model's option.max_new_tokens_limit, checked after validation.
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=MAX_OPENAI_TEMPERATURE, **FINITE)
    top_p: Optional[float] = Field(None, gt=0, le=1, **FINITE)
    n: Optional[int] = Field(None, ge=1)
    stop: StopList = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extensions (benchmark clients send them through extra_body).
    top_k: Optional[int] = Field(None, ge=-1)
    repetition_penalty: Optional[float] = Field(None, ge=MIN_REPETITION_PENALTY,
                                                le=MAX_REPETITION_PENALTY, **FINITE)
    min_tokens: Optional[int] = Field(None, ge=0)
    ignore_eos: Optional[bool] = None
    # OpenAI's additive penalties, and its biases by token id (a string key, as JSON has).
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, **FINITE)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2, **FINITE)
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100, le=100, **FINITE)]]] = None


class ChatCompletionRequest(_Common):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Accepted: they change nothing about the answer.
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None
    tools: Optional[list[ToolSpec]] = None
    # "none", "auto", "required" or a named function: checked by ToolUse.of, whose
    # errors name the field better than a union's would.
    tool_choice: Any = None
    # Only at the value that asks for nothing.
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class CompletionRequest(_Common):
    """The body of ``POST /v1/completions`` (OpenAI's legacy completions)."""

    prompt: Annotated[list[Prompt], BeforeValidator(one_or_many), Field(min_length=1)]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Only at the value that asks for nothing.
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


#: Parameters this server cannot honour, with the values that ask for nothing (``None``,
#: an absent key, always does). Any other value is a 400: a client that asks for tools or
#: a JSON schema must not get plain text as if it had been honoured.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
}


# ---------------------------------------------------------------------------------------
# Entry points


_EXPECTED_BY_FIELD = {
    "prompt": "a string or a list of strings",
    "stop": "a string or a list of strings",
    "messages": "a list of {\"role\", \"content\"} objects",
}


def _known_keys(model: type[BaseModel]):
    def known(parent: str) -> tuple[type[BaseModel], str]:
        if parent.startswith("messages") and ".content" in parent:
            return TextPart, "content part key"
        if parent.startswith("messages") and parent.endswith(".function"):
            return CalledFunction, "function key"
        if parent.startswith("messages") and ".tool_calls" in parent:
            return ToolCall, "tool call key"
        if parent.startswith("messages"):
            return ChatMessage, "message key"
        if parent.startswith("tools") and parent.endswith(".function"):
            return FunctionSpec, "function key"
        if parent.startswith("tools"):
            return ToolSpec, "tool key"
        if parent == "stream_options":
            return StreamOptions, "stream option"
        return model, "parameter"
    return known


def _validate(model: type[_Common], body: Any, what: str) -> _Common:
    if not isinstance(body, dict):
        raise RequestError("body", f"the request body must be a JSON object with {what}, "
                                   f"got {describe(body)}")
    if "parameters" in body:
        # The one mistake a djl-serving user makes here: a djl body that now selects
        # OpenAI's protocol by its messages (or prompt) key.
        raise RequestError("parameters", "parameters is djl-serving's request format, not "
                           "OpenAI's: give max_tokens, temperature... at the top level (or set "
                           "option.chat_protocol=djl for djl's answers to messages)")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        error = request_error(err, body, _known_keys(model), _EXPECTED_BY_FIELD)
        # Our own checks word their message "must be ..."; request_error puts it after
        # "field: ", as it does for pydantic's own messages.
        prefix = f"{error.field}: must "
        if error.message.startswith(prefix):
            error = RequestError(error.field, f"{error.field} must {error.message[len(prefix):]}")
        raise error from None


def _refuse_unsupported(parsed: _Common) -> None:
    for name in type(parsed).model_fields:
        if name not in _UNSUPPORTED:
            continue
        value = getattr(parsed, name)
        # bool is an int in Python: False must not pass for the 0 of a penalty.
        if value is None or any(type(value) is type(ok) and value == ok
                                or isinstance(value, float) and type(ok) is int and value == ok
                                for ok in _UNSUPPORTED[name]):
            continue
        allowed = " or ".join(json.dumps(ok) for ok in _UNSUPPORTED[name])
        hint = f"leave it out or set it to {allowed}" if allowed else "leave it out"
        raise RequestError(name, f"{name} is not supported by this server: {hint}, "
                                 f"got {describe(value)}")


def _max_new_tokens(field: str, value: Optional[int], context: ParseContext) -> int:
    if value is None:
        return context.default_max_new_tokens
    if value > context.max_new_tokens_limit:
        raise RequestError(field, f"{field} must be at most {context.max_new_tokens_limit}, "
                                  f"got {value}")
    return value


def _response_grammar(value: Any, context: ParseContext) -> Optional[tuple[str, str]]:
    """The grammar ``response_format`` asks for: none for ``text``, any JSON object for
    ``json_object``, the schema for ``json_schema`` (``strict`` or not, the schema is
    followed)."""
    if value is None:
        return None
    kinds = "text, json_object or json_schema"
    if not isinstance(value, dict) or "type" not in value:
        raise RequestError("response_format", "response_format must be an object with a type "
                                              f"({kinds}), got {describe(value)}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return checked_grammar(("json_object", ""), "response_format", context)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("response_format.json_schema", "response_format.json_schema "
                               "must be an object with name and schema, got " + describe(spec))
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema",
                               "response_format.json_schema.schema must be a JSON schema "
                               f"object, got {describe(schema)}")
        return checked_grammar(("json_schema", json.dumps(schema)),
                               "response_format.json_schema.schema", context)
    raise RequestError("response_format.type", f"response_format.type must be one of {kinds}, "
                                               f"got {describe(kind)}")


def _logit_bias(parsed: _Common) -> tuple[tuple[int, float], ...]:
    pairs = []
    for key, bias in (parsed.logit_bias or {}).items():
        if not key.strip().isdigit():
            raise RequestError("logit_bias", f"logit_bias keys must be token ids (\"15339\"), "
                                             f"got {describe(key)}")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _seeds(seed: Optional[int], sequences: int) -> Optional[int | tuple[int, ...]]:
    """``seed`` for one sequence; one seed per sequence for several (``n`` choices, or
    several prompts), so that the choices differ and the whole answer repeats."""
    if seed is None or sequences == 1:
        return seed
    return tuple((seed + i) % 2**63 for i in range(sequences))


def _sampling(parsed: _Common, max_new_tokens: int, logprobs: bool,
              top_logprobs: int, sequences: int = 1,
              grammar: Optional[tuple[str, str]] = None) -> SamplingParameters:
    temperature = 1.0 if parsed.temperature is None else parsed.temperature
    sample = temperature >= MIN_TEMPERATURE
    if parsed.min_tokens is not None and parsed.min_tokens > max_new_tokens:
        raise RequestError("min_tokens", f"min_tokens must be at most the most tokens to "
                                         f"generate ({max_new_tokens}), got {parsed.min_tokens}")
    return SamplingParameters(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else 1.0,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        # vLLM's -1 and 0 both mean "no top-k"; ours is 0.
        top_k=max(parsed.top_k or 0, 0),
        repetition_penalty=parsed.repetition_penalty or 1.0,
        presence_penalty=parsed.presence_penalty or 0.0,
        frequency_penalty=parsed.frequency_penalty or 0.0,
        logit_bias=_logit_bias(parsed),
        grammar=grammar,
        manual_seed=_seeds(parsed.seed, sequences),
        stop=tuple(parsed.stop or ()),
        min_new_tokens=parsed.min_tokens or 0,
        ignore_eos=bool(parsed.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def _answer_options(parsed: _Common, prompt_count: int,
                    context: ParseContext) -> tuple[int, bool]:
    n = parsed.n or 1
    if n * prompt_count > context.max_batch_size and n > 1:
        what = f"n ({n})" if prompt_count == 1 else f"n ({n}) × {prompt_count} prompts"
        raise RequestError("n", f"{what} is {n * prompt_count} sequences; the limit "
                                f"(option.max_rolling_batch_size) is {context.max_batch_size}")
    stream = bool(parsed.stream)
    if parsed.stream_options is not None and not stream:
        raise RequestError("stream_options", "stream_options is only allowed with "
                                             "\"stream\": true")
    include_usage = bool(stream and parsed.stream_options
                         and parsed.stream_options.include_usage)
    return n, include_usage


def parse_chat(body: Any, context: ParseContext) -> GenerationRequest:
    """Validate a chat completions body; the messages go through the chat template.

    >>> from djl_stream.protocols.protocol import ParseContext, checked_grammar
    >>> context = ParseContext(50, 2048, 32, "model",
    ...                        render_chat=lambda ms: "".join(m["content"] for m in ms))
    >>> request = parse_chat({"model": "any", "messages": [{"role": "user", "content": "Hi"}],
    ...                       "logprobs": True, "top_logprobs": 2}, context)
    >>> request.prompts, request.parameters.do_sample, request.answer.top_logprobs
    (('Hi',), True, 2)
    """
    parsed = _validate(ChatCompletionRequest, body, "\"messages\"")
    _refuse_unsupported(parsed)
    if parsed.max_tokens is not None and parsed.max_completion_tokens is not None \
            and parsed.max_tokens != parsed.max_completion_tokens:
        raise RequestError("max_completion_tokens", "give max_completion_tokens or max_tokens "
                           f"(its older name), not both: got {parsed.max_completion_tokens} "
                           f"and {parsed.max_tokens}")
    length_field = ("max_completion_tokens" if parsed.max_completion_tokens is not None
                    else "max_tokens")
    max_new_tokens = _max_new_tokens(length_field, getattr(parsed, length_field), context)
    if parsed.top_logprobs is not None and not parsed.logprobs:
        raise RequestError("top_logprobs", "top_logprobs needs \"logprobs\": true")
    logprobs, top = bool(parsed.logprobs), parsed.top_logprobs or 0
    n, include_usage = _answer_options(parsed, 1, context)

    if context.render_chat is None:
        raise RequestError("messages", "messages need a chat template and this model has "
                                       "none; use /v1/completions instead")
    use = ToolUse.of(parsed.tools or (), parsed.tool_choice,
                     parsed.parallel_tool_calls)
    grammar = _response_grammar(parsed.response_format, context)
    forced = use.grammar() if use is not None else None
    if forced is not None:
        if grammar is not None:
            raise RequestError("response_format", "response_format cannot be combined with a "
                               f"tool_choice that forces a call ({describe(parsed.tool_choice)})"
                               ": the call's arguments follow the tool's schema")
        field = "tools" if use.mode == "required" else \
            f"tools[{use.names.index(use.name)}].function.parameters"
        grammar = checked_grammar(forced, field, context)
    messages = tuple(_turn(m) for m in parsed.messages)
    turns, tools = chat_for_template(messages, use, context.renders_tools,
                                     context.takes_system)
    try:
        prompt = (context.render_chat(turns) if tools is None
                  else context.render_chat(turns, tools))
    except RequestError:
        raise
    except Exception as err:  # a template raising on odd turn orders is the client's to fix
        raise RequestError("messages", f"the chat template rejected the messages: {err}") from None
    return GenerationRequest(
        prompts=(prompt,) * n,
        parameters=_sampling(parsed, max_new_tokens, logprobs, top, n, grammar),
        stream=bool(parsed.stream),
        messages=messages,
        answer=Answer(n=n, include_usage=include_usage, logprobs=logprobs, top_logprobs=top,
                      max_tokens_field=length_field, tools=use),
    )


def _turn(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it: a role and a string, and an assistant's
    calls or a tool result's call id where there are some."""
    turn: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                            "content": message.text()}
    if message.tool_calls:
        turn["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.role == "tool":
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            turn["name"] = message.name
    return turn


def _token_prompts(body: Any) -> Optional[tuple[tuple[int, ...], ...]]:
    """The prompts of a completions body given as token ids (one list of ids, or a list of
    them), as OpenAI's API takes them; ``None`` for text prompts. Raises
    :class:`RequestError` for ids mixed with text, or that are not whole numbers.

    >>> _token_prompts({"prompt": [1, 2]}), _token_prompts({"prompt": [[1], [2, 3]]})
    (((1, 2),), ((1,), (2, 3)))
    >>> _token_prompts({"prompt": "Hi"}) is None
    True
    """
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, list) or not prompt or all(isinstance(p, str) for p in prompt):
        return None

    def ids(items: list, field: str) -> tuple[int, ...]:
        if not items:
            raise RequestError(field, f"{field} must not be empty")
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise RequestError(f"{field}[{i}]", f"{field}[{i}] must be a token id (a whole "
                                                    f"number of at least 0), got {describe(item)}")
        return tuple(items)

    if all(isinstance(p, list) for p in prompt):
        return tuple(ids(p, f"prompt[{i}]") for i, p in enumerate(prompt))
    if any(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("prompt", "prompt must be text, a list of texts, token ids or a "
                                     "list of token id lists, not a mix of them")
    return (ids(prompt, "prompt"),)


def parse_completion(body: Any, context: ParseContext) -> GenerationRequest:
    """Validate a completions body; prompts are sent to the model as they are (no chat
    template), each repeated ``n`` times.

    >>> from djl_stream.protocols.protocol import ParseContext, checked_grammar
    >>> context = ParseContext(50, 2048, 32, "model")
    >>> parse_completion({"prompt": "Hi", "max_tokens": 4096}, context)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: max_tokens must be at most 2048, got 4096
    """
    token_prompts = _token_prompts(body)
    if token_prompts is not None:
        # The rest of the body validates as usual, around a stand-in text per prompt.
        body = {**body, "prompt": ["ids"] * len(token_prompts)}
    parsed = _validate(CompletionRequest, body, "\"prompt\"")
    _refuse_unsupported(parsed)
    max_new_tokens = _max_new_tokens("max_tokens", parsed.max_tokens, context)
    logprobs = parsed.logprobs is not None
    n, include_usage = _answer_options(parsed, len(parsed.prompt), context)
    return GenerationRequest(
        prompts=tuple("" if token_prompts is not None else prompt
                      for prompt in parsed.prompt for _ in range(n)),
        prompt_ids=(None if token_prompts is None
                    else tuple(ids for ids in token_prompts for _ in range(n))),
        parameters=_sampling(parsed, max_new_tokens, logprobs, parsed.logprobs or 0,
                             n * len(parsed.prompt)),
        stream=bool(parsed.stream),
        batched=isinstance(body["prompt"], list) and (token_prompts is None
                                                      or len(token_prompts) > 1),
        answer=Answer(n=n, include_usage=include_usage, logprobs=logprobs,
                      top_logprobs=parsed.logprobs or 0, prompt_count=len(parsed.prompt)),
    )
