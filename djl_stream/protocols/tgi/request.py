"""TGI's request body, validated at the edge into a :class:`GenerationRequest`.

::

    {"inputs": "text", "parameters": {"max_new_tokens": 20, "details": true, ...}, "stream": false}

Every parameter of TGI's ``GenerateParameters`` is known, and may be ``null``
(``huggingface_hub`` and the ``text-generation`` client send many keys that way).
Those djl-stream honours: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
``top_p``, ``typical_p``, ``repetition_penalty``, ``frequency_penalty``, ``seed``, ``stop``,
``details``, ``return_full_text``, ``top_n_tokens`` and ``grammar`` (``json`` or ``regex``,
followed while decoding). The others (``best_of``, ``truncate``, ``watermark``,
``adapter_id``, ``decoder_input_details``) are
accepted at their defaults and refused otherwise, naming
the parameter. An unknown key is refused too (TGI ignores it; a typo would change nothing
silently).

As in TGI, setting a sampling warper (``temperature`` other than 1, ``top_k``, ``top_p`` or
``typical_p`` below 1) samples even without ``do_sample``, and a sampled request without a
``seed`` gets a drawn one, reported in ``details.seed`` so that it can be replayed.

    >>> context = ParseContext(default_max_new_tokens=50, max_new_tokens_limit=2048,
    ...                        max_batch_size=8, model_name="m")
    >>> request = parse_request({"inputs": "Hi", "parameters": {"temperature": 0.7, "seed": 3}},
    ...                         context, route_stream=False)
    >>> request.parameters.do_sample, request.parameters.manual_seed, request.answer.seed
    (True, 3, 3)
    >>> parse_request({"inputs": "Hi", "parameters": {"best_of": 2}}, context, route_stream=False)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: parameters.best_of is not supported by djl-stream (it generates one sequence per request); leave it null or 1, got 2
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from djl_stream.protocols.protocol import ParseContext, checked_grammar
from djl_stream.protocols.request import GenerationRequest, SamplingParameters
from djl_stream.protocols.schema import (FINITE, MAX_REPETITION_PENALTY, MAX_TEMPERATURE,
                                         MIN_REPETITION_PENALTY, MIN_TEMPERATURE, Prompt,
                                         StopList)
from djl_stream.protocols.validation import RequestError, describe, request_error

#: The most alternatives per token ``top_n_tokens`` may ask for: the engine's own limit,
#: :data:`djl_stream.generation.sampling.MAX_TOP_LOGPROBS` (not imported: this module stays
#: free of torch; a test checks that the two agree). TGI's default limit is 5.
MAX_TOP_N_TOKENS = 20
#: TGI's seed is an unsigned 64-bit integer; torch's generators take the same range.
MAX_SEED = 2**64 - 1


class TgiParameters(BaseModel):
    """TGI's ``GenerateParameters``; ``None`` everywhere means "TGI's default"."""

    model_config = ConfigDict(strict=True, extra="forbid")

    # Honoured. The upper bound of max_new_tokens is a model property, checked afterwards.
    max_new_tokens: Optional[int] = Field(None, ge=1)
    do_sample: Optional[bool] = None
    temperature: Optional[float] = Field(None, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE,
                                         **FINITE)
    top_k: Optional[int] = Field(None, gt=0)
    # TGI refuses exactly 1; 1 switches the warper off, so it is accepted here.
    top_p: Optional[float] = Field(None, gt=0, le=1, **FINITE)
    typical_p: Optional[float] = Field(None, gt=0, le=1, **FINITE)
    repetition_penalty: Optional[float] = Field(None, ge=MIN_REPETITION_PENALTY,
                                                le=MAX_REPETITION_PENALTY, **FINITE)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    # Stop strings here, temperature and repetition penalty above: djl's limits (TGI's allow 4
    # stop sequences and no upper bounds), since the engine is the same.
    stop: StopList = None
    return_full_text: Optional[bool] = None
    details: Optional[bool] = None
    top_n_tokens: Optional[int] = Field(None, ge=0, le=MAX_TOP_N_TOKENS)
    # Accepted only at values that change nothing (see UNSUPPORTED).
    decoder_input_details: Optional[bool] = None
    best_of: Optional[int] = None
    truncate: Optional[int] = None
    watermark: Optional[bool] = None
    grammar: Optional[Any] = None
    adapter_id: Optional[str] = None
    # TGI's (and OpenAI's) additive penalty on tokens already generated, -2 to 2.
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2, **FINITE)


class TgiBody(BaseModel):
    """TGI's ``CompatGenerateRequest`` (``GenerateRequest`` plus ``stream``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    inputs: Prompt  # the rule djl's and OpenAI's routes apply
    parameters: Optional[TgiParameters] = None
    stream: Optional[bool] = None


#: Parameters djl-stream cannot honour: the values that change nothing (``null`` always
#: among them), how to say them, and why other values are refused.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str, str]] = {
    "best_of": ((None, 1), "null or 1", "it generates one sequence per request"),
    "decoder_input_details": ((None, False), "null or false",
                              "the engine does not score the prompt's tokens, so "
                              "details.prefill is always empty"),
    "truncate": ((None,), "null", "prompts are never truncated; one longer than "
                                  "option.max_input_length is refused"),
    "watermark": ((None, False), "null or false", "it has no watermarking"),
    "adapter_id": ((None,), "null", "it serves one model, without LoRA adapters"),
}


def _grammar(value: Any, context: ParseContext) -> Optional[tuple[str, str]]:
    """TGI's ``grammar``: ``{"type": "json", "value": schema}`` (``json_object`` is its
    alias) or ``{"type": "regex", "value": pattern}``."""
    if value is None:
        return None
    field = "parameters.grammar"
    if not isinstance(value, dict) or set(value) != {"type", "value"}:
        raise RequestError(field, f"{field} must be {{\"type\": \"json\" or \"regex\", "
                                  f"\"value\": ...}}, got {describe(value)}")
    kind, text = value["type"], value["value"]
    if kind in ("json", "json_object"):
        if isinstance(text, str):
            try:
                text = json.loads(text)
            except ValueError:
                raise RequestError(f"{field}.value", f"{field}.value must be a JSON schema, "
                                                     "got a string that is not JSON") from None
        if not isinstance(text, dict):
            raise RequestError(f"{field}.value", f"{field}.value must be a JSON schema object, "
                                                 f"got {describe(text)}")
        return checked_grammar(("json_schema", json.dumps(text)), f"{field}.value", context)
    if kind == "regex":
        if not isinstance(text, str) or not text:
            raise RequestError(f"{field}.value", f"{field}.value must be a regular expression, "
                                                 f"got {describe(text)}")
        return checked_grammar(("regex", text), f"{field}.value", context)
    raise RequestError(f"{field}.type", f"{field}.type must be json or regex, "
                                        f"got {describe(kind)}")


@dataclasses.dataclass(frozen=True)
class TgiAnswer:
    """What the TGI writers need beyond the generation (``GenerationRequest.answer``).

    ``inputs`` is the prompt as the client sent it (``return_full_text`` prepends it, even
    when the chat template wrapped it for the model); ``seed`` is the one reported in
    ``details.seed``: the sampling seed, ``None`` for greedy decoding; ``as_list`` wraps
    a non-streaming answer in a list, as TGI's ``POST /`` does.
    """

    inputs: str
    details: bool = False
    return_full_text: bool = False
    seed: Optional[int] = None
    top_n_tokens: int = 0
    as_list: bool = False


def _known_keys(parent: str) -> tuple[type[BaseModel], str]:
    if parent == "parameters":
        return TgiParameters, "parameter"
    return TgiBody, "key"


_EXPECTED_BY_FIELD = {"parameters.stop": "a list of strings"}
_ROUTES = {True: "POST /generate_stream (or POST / with \"stream\": true)",
           False: "POST /generate (or POST / without \"stream\")"}


def _refuse_unsupported(params: TgiParameters) -> None:
    for name, (allowed, words, why) in UNSUPPORTED.items():
        value = getattr(params, name)
        if not any(value is None if a is None else value == a for a in allowed):
            field = f"parameters.{name}"
            raise RequestError(field, f"{field} is not supported by djl-stream ({why}); "
                                      f"leave it {words}, got {describe(value)}")


def _samples(params: TgiParameters) -> bool:
    # TGI's NextTokenChooser: any warper away from its neutral value means sampling.
    return (bool(params.do_sample)
            or params.temperature not in (None, 1.0)
            or params.top_k is not None
            or (params.top_p is not None and params.top_p < 1.0)
            or (params.typical_p is not None and params.typical_p < 1.0))


def parse_request(body: Any, context: ParseContext, *, route_stream: Optional[bool],
                  scores: bool = True, draw_seed: Optional[Callable[[], int]] = None,
                  engine: str = "this") -> GenerationRequest:
    """Validate a decoded TGI body into a :class:`GenerationRequest`.

    ``route_stream`` is what the route answers (``/generate``: False, ``/generate_stream``:
    True); ``None`` for ``POST /``, where the body's ``stream`` decides (default false) and
    a non-streaming answer is a list. ``scores`` says whether the engine (named ``engine``
    in messages) reports per-token log-probabilities: without it ``logprob`` is ``null`` and
    ``top_n_tokens`` is refused. ``draw_seed`` draws the seed of a sampled request that
    gave none (``None``: leave it unseeded, for an engine that takes no seed).
    """
    if not isinstance(body, dict):
        raise RequestError("body", "the request body must be a JSON object with \"inputs\", "
                                   f"got {describe(body)}")
    try:
        parsed = TgiBody.model_validate(body)
    except ValidationError as err:
        raise request_error(err, body, _known_keys, _EXPECTED_BY_FIELD) from None
    if route_stream is not None and parsed.stream not in (None, route_stream):
        raise RequestError("stream", f"stream: {str(parsed.stream).lower()} is answered by "
                                     f"{_ROUTES[parsed.stream]}; this route always answers "
                                     f"stream: {str(route_stream).lower()}")
    stream = route_stream if route_stream is not None else bool(parsed.stream)
    params = parsed.parameters or TgiParameters()
    _refuse_unsupported(params)
    if params.max_new_tokens is not None and params.max_new_tokens > context.max_new_tokens_limit:
        raise RequestError("parameters.max_new_tokens",
                           f"parameters.max_new_tokens must be at most "
                           f"{context.max_new_tokens_limit}, got {params.max_new_tokens}")
    top_n_tokens = params.top_n_tokens or 0
    if top_n_tokens and not scores:
        raise RequestError("parameters.top_n_tokens",
                           f"parameters.top_n_tokens is not supported by the {engine} engine "
                           f"(it reports no per-token scores); leave it null or 0, "
                           f"got {top_n_tokens}")

    details = bool(params.details)
    shows_tokens = stream or details  # a stream always carries each token's logprob
    sampling = _samples(params)
    seed = params.seed if sampling else None
    if sampling and seed is None and draw_seed is not None:
        seed = draw_seed()
    parameters = SamplingParameters(
        max_new_tokens=params.max_new_tokens or context.default_max_new_tokens,
        temperature=params.temperature if params.temperature is not None else 1.0,
        top_k=params.top_k or 0,
        top_p=params.top_p if params.top_p is not None else 1.0,
        typical_p=params.typical_p if params.typical_p is not None else 1.0,
        repetition_penalty=(params.repetition_penalty
                            if params.repetition_penalty is not None else 1.0),
        frequency_penalty=params.frequency_penalty or 0.0,
        grammar=_grammar(params.grammar, context),
        do_sample=sampling,
        manual_seed=seed,
        stop=tuple(params.stop or ()),
        logprobs=scores and shows_tokens,
        top_logprobs=top_n_tokens if shows_tokens else 0,
    )
    prompt = parsed.inputs
    if context.wrap_prompts_in_chat and context.render_chat is not None:
        prompt = context.render_chat([{"role": "user", "content": prompt}])
    answer = TgiAnswer(inputs=parsed.inputs, details=details,
                       return_full_text=bool(params.return_full_text), seed=seed,
                       top_n_tokens=top_n_tokens if shows_tokens else 0,
                       as_list=route_stream is None and not stream)
    return GenerationRequest(prompts=(prompt,), parameters=parameters, stream=stream,
                             batched=False, answer=answer)
