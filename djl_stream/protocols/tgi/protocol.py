"""text-generation-inference's routes as :class:`~djl_stream.protocols.protocol.Protocol`\\ s.

``djl-stream serve`` routes ``POST /generate`` to ``tgi-generate`` (one JSON answer),
``POST /generate_stream`` to ``tgi-generate-stream`` (server-sent events) and ``POST /``
to ``tgi`` (TGI's compatibility route, where the body's ``stream`` decides; it is where
``huggingface_hub.InferenceClient(base_url=...).text_generation`` posts). Requests are
:mod:`.request`'s, answers :mod:`.writers`'; errors are TGI's ``{"error", "error_type"}``
with TGI's statuses:

=====================  ======  ==============
failure                status  ``error_type``
=====================  ======  ==============
a bad request          422     ``validation``
the queue is full      429     ``overloaded``
generation failed      424     ``generation``
out of memory          424     ``generation``
=====================  ======  ==============

422, not 400, because TGI answers validation errors so and its clients expect it:
``huggingface_hub`` raises its ``ValidationError`` carrying our message, and the
``text-generation`` client picks its exception by status.

    >>> protocol = TgiProtocol(route_stream=False)
    >>> answer = protocol.error(Failure("invalid", "parameters.top_p must be at most 1, got 3"))
    >>> answer.code, answer.body
    (422, {'error': 'Input validation error: parameters.top_p must be at most 1, got 3', 'error_type': 'validation'})
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional, Sequence

from djl_stream.generation.step import Step
from djl_stream.protocols.protocol import (ErrorAnswer, Failure, ParseContext, Protocol,
                                           StreamEncoder)
from djl_stream.protocols.request import GenerationRequest
from djl_stream.protocols.tgi.request import parse_request
from djl_stream.protocols.tgi.writers import (TgiStreamEncoder, Vocabulary, error_record,
                                              generate_response)

#: An engine's refusal names the generation parameter; a TGI client knows it by TGI's name.
_TGI_NAMES = {"parameters.manual_seed": "parameters.seed",
              "parameters.top_logprobs": "parameters.top_n_tokens"}
_ERRORS = {
    "invalid": (422, "validation", "Unprocessable Entity"),
    "busy": (429, "overloaded", "Too Many Requests"),
    "failed": (424, "generation", "Failed Dependency"),
    "out_of_memory": (424, "generation", "Failed Dependency"),
}


def _draw_seed() -> int:
    return random.SystemRandom().getrandbits(64)


class TgiProtocol(Protocol):
    """One of TGI's routes; see the module docstring.

    ``route_stream``: what the route answers (``False``: ``/generate``, ``True``:
    ``/generate_stream``, ``None``: ``POST /``, the body's ``stream`` decides).
    ``vocabulary`` writes ``top_tokens``; ``scores`` says whether the engine reports
    per-token log-probabilities, ``draw_seed`` draws the seed of an unseeded sampled
    request (``None`` for an engine that takes none); ``engine`` names it in messages.
    """

    def __init__(self, route_stream: Optional[bool], *, vocabulary: Optional[Vocabulary] = None,
                 scores: bool = True, draw_seed: Optional[Callable[[], int]] = _draw_seed,
                 engine: str = "this") -> None:
        self.route_stream = route_stream
        self.name = {False: "tgi-generate", True: "tgi-generate-stream", None: "tgi"}[route_stream]
        self.vocabulary = vocabulary
        self.scores = scores
        self.draw_seed = draw_seed
        self.engine = engine

    def parse(self, body: Any, context: ParseContext) -> GenerationRequest:
        return parse_request(body, context, route_stream=self.route_stream, scores=self.scores,
                             draw_seed=self.draw_seed, engine=self.engine)

    def stream_encoder(self, request: GenerationRequest,
                       prompt_tokens: Sequence[int]) -> StreamEncoder:
        return TgiStreamEncoder(request.answer, prompt_tokens[0], vocabulary=self.vocabulary,
                                max_new_tokens=request.parameters.max_new_tokens)

    def complete(self, request: GenerationRequest, steps: Sequence[Step],
                 prompt_tokens: Sequence[int]) -> Any:
        return generate_response(request.answer, steps, vocabulary=self.vocabulary,
                                 max_new_tokens=request.parameters.max_new_tokens)

    def error(self, failure: Failure) -> ErrorAnswer:
        code, error_type, reason = _ERRORS.get(failure.kind, _ERRORS["failed"])
        message = failure.message
        if failure.kind == "invalid":
            for ours, theirs in _TGI_NAMES.items():
                message = message.replace(ours, theirs)
            message = f"Input validation error: {message}"  # TGI's prefix
        return ErrorAnswer(code, error_record(message, error_type), reason)


def _for_service(service: Any, route_stream: Optional[bool]) -> TgiProtocol:
    # transformers-neuronx reports no scores and takes no seeds, and a custom engine may
    # not know the parameters at all: the engine says what it does.
    capabilities = service.engine.capabilities
    return TgiProtocol(route_stream, vocabulary=Vocabulary.of(service.tokenizer),
                       scores=capabilities.scores,
                       draw_seed=_draw_seed if capabilities.seeds else None,
                       engine=service.engine.name)


def generate_protocol(service: Any) -> TgiProtocol:
    """``POST /generate`` (``PROTOCOLS["tgi-generate"]``): one JSON answer."""
    return _for_service(service, False)


def generate_stream_protocol(service: Any) -> TgiProtocol:
    """``POST /generate_stream`` (``PROTOCOLS["tgi-generate-stream"]``): server-sent events."""
    return _for_service(service, True)


def compat_protocol(service: Any) -> TgiProtocol:
    """``POST /`` (``PROTOCOLS["tgi"]``): the body's ``stream`` decides; a JSON answer is a
    one-element list, as TGI's compatibility route answers."""
    return _for_service(service, None)
