"""A protocol: how one wire format asks for a generation and gets it back.

Each protocol (djl-serving's schema, OpenAI's, TGI's) is one request parser and one
response writer around the same generation:

- :meth:`Protocol.parse` validates a decoded body into a
  :class:`~djl_stream.protocols.request.GenerationRequest` (or raises a
  :class:`~djl_stream.protocols.validation.RequestError` naming the field and the limit);
- :meth:`Protocol.stream_encoder` writes a streaming answer, one chunk per decode step, a
  last chunk when generation ends, and an error record if it fails midway;
- :meth:`Protocol.complete` writes a non-streaming answer from all the steps at once;
- :meth:`Protocol.error` shapes an error answered before any chunk (a bad request, a
  generation that failed at once, a full queue) in the protocol's own error format.

The service (:mod:`djl_stream.serving.service`) picks the protocol, runs the engine, and
hands each step (a :class:`~djl_stream.generation.sequence.Step`: the new text per prompt,
with the tokens behind it) to the protocol.

    >>> from djl_stream.protocols.djl.protocol import DjlProtocol
    >>> protocol = DjlProtocol()
    >>> protocol.error(Failure.invalid(RequestError("inputs", "inputs is required"))).code
    400
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from djl_stream.generation.errors import ShuttingDown
from djl_stream.generation.step import Step
from djl_stream.protocols.request import GenerationRequest
from djl_stream.protocols.validation import RequestError

logger = logging.getLogger(__name__)

#: The ``Input`` property that names the protocol of a request. ``djl-stream serve`` sets it
#: from the route (``/v1/chat/completions``, ``/generate``...); without it the body's shape
#: decides (:func:`djl_stream.serving.service.StreamingService.protocol_for`).
PROTOCOL_PROPERTY = "djl_stream_protocol"


@dataclasses.dataclass(frozen=True)
class ParseContext:
    """What a protocol needs to know about the served model to validate a request."""

    default_max_new_tokens: int
    max_new_tokens_limit: int
    max_batch_size: int
    model_name: str
    #: renders chat messages (and, as a second argument, the tools they may call) into a
    #: prompt; None when the tokenizer has no chat template
    render_chat: Optional[Callable[..., str]] = None
    #: whether the chat template shows tools to the model itself (else a system message
    #: does: :func:`djl_stream.protocols.openai.tools.chat_for_template`)
    renders_tools: bool = False
    #: whether the chat template takes a system turn (Gemma's refuse one)
    takes_system: bool = True
    #: wrap plain prompts as one user turn of the chat template (option.apply_chat_template)
    wrap_prompts_in_chat: bool = False
    #: raises ValueError, with why, for a grammar the model cannot follow (a
    #: :data:`~djl_stream.generation.grammar.GrammarSpec`); None when the engine constrains
    #: nothing, and a request with a grammar is refused
    check_grammar: Optional[Callable[[Tuple[str, str]], None]] = None


def checked_grammar(spec: Optional[Tuple[str, str]], field: str, context: ParseContext,
                    engine: str = "this") -> Optional[Tuple[str, str]]:
    """``spec`` once the model can follow it; a :class:`RequestError` naming ``field``
    otherwise (a bad schema or regex, or an engine that constrains nothing).

    >>> context = ParseContext(16, 64, 4, "m")
    >>> checked_grammar(("regex", "a+"), "response_format", context)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: response_format is not supported by this engine: it has no constrained decoding
    """
    if spec is None:
        return None
    if context.check_grammar is None:
        raise RequestError(field, f"{field} is not supported by {engine} engine: it has no "
                                  "constrained decoding")
    try:
        context.check_grammar(spec)
    except ValueError as error:
        raise RequestError(field, f"{field} cannot be followed: {error}") from None
    return spec


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a request is answered with an error instead of a generation.

    ``kind`` is ``invalid`` (the request; 400 or the protocol's equivalent), ``failed``
    (generation failed before its first chunk; 424), ``out_of_memory`` (507) or ``busy``
    (the waiting queue is full, or the server is shutting down; 503). ``field`` names the
    request field for ``invalid``.
    """

    kind: str
    message: str
    field: Optional[str] = None

    @classmethod
    def invalid(cls, error: RequestError) -> "Failure":
        return cls("invalid", error.message, error.field)


@dataclasses.dataclass(frozen=True)
class ErrorAnswer:
    """An error as a protocol writes it: status, JSON body (None: no body), reason phrase."""

    code: int
    body: Any
    message: str


class StreamEncoder(abc.ABC):
    """Writes one request's streaming answer; one encoder per request (it may keep state,
    such as the text so far or the token counts for a closing usage record)."""

    content_type: str = "application/jsonlines"

    @abc.abstractmethod
    def step(self, step: Step) -> bytes:
        """The chunk for one decode step (``b""`` sends nothing for it)."""

    def end(self) -> bytes:
        """The chunk after the last step, when generation ended normally."""
        return b""

    @abc.abstractmethod
    def error(self, message: str) -> bytes:
        """The record that ends a stream whose generation failed after its first chunk."""


class Protocol(abc.ABC):
    """One wire format; see the module docstring."""

    name: str

    @abc.abstractmethod
    def parse(self, body: Any, context: ParseContext) -> GenerationRequest:
        """Validate a decoded JSON body; raise RequestError naming the field and the limit."""

    @abc.abstractmethod
    def stream_encoder(self, request: GenerationRequest,
                       prompt_tokens: Sequence[int]) -> StreamEncoder:
        """The encoder of ``request``'s streaming answer (``prompt_tokens``: each prompt's
        length in tokens)."""

    @abc.abstractmethod
    def complete(self, request: GenerationRequest, steps: Sequence[Step],
                 prompt_tokens: Sequence[int]) -> Any:
        """The JSON body of the non-streaming answer, from every step of the generation."""

    @abc.abstractmethod
    def error(self, failure: Failure) -> ErrorAnswer:
        """``failure`` in this protocol's error format."""

    def prompt_field(self, request: GenerationRequest, index: int) -> str:
        """The request field prompt ``index`` came from, for length errors."""
        if request.messages is not None:
            return "messages"
        return f"inputs[{index}]" if request.batched else "inputs"

    def max_new_tokens_field(self, request: GenerationRequest) -> str:
        """The request field that set ``max_new_tokens``, for context-length errors."""
        return "parameters.max_new_tokens"


class EncodedStream(Iterator[bytes]):
    """The wire chunks of one stream: each step of ``stream`` through ``encoder``.

    A failure before the first chunk (the model failed to prefill, say) is raised, so the
    caller can still answer with an error status. A failure after it, of the stream or of
    the encoder (a custom formatter), becomes the encoder's error record and ends the
    stream: once the first chunk is out the status is 200 whatever happens, and a client
    parses an error record where raw exception text would break its parser. When the
    stream ends normally, the encoder's last chunk follows. Closing this iterator closes
    ``stream`` (which stops generation).
    """

    def __init__(self, stream: Iterator[List[str]], encoder: StreamEncoder) -> None:
        self._stream = stream
        self._encoder = encoder
        self._started = False
        self._done = False

    def __iter__(self) -> "EncodedStream":
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        try:
            item = next(self._stream)
        except StopIteration:
            self._done = True
            last = self._encoder.end()
            if last:
                return last
            raise
        except Exception as error:  # noqa: BLE001 - every failure must reach the client
            return self._fail(error)
        try:
            chunk = self._encoder.step(item if isinstance(item, Step) else Step(item))
        except Exception as error:  # noqa: BLE001 - a custom formatter that raises
            return self._fail(error)
        self._started = True
        return chunk

    def _fail(self, error: Exception) -> bytes:
        self.close()
        if not self._started:
            raise error
        if isinstance(error, ShuttingDown):
            logger.info("stream ended: %s", error)  # expected, not a bug to trace back
        else:
            logger.exception("generation failed mid-stream", exc_info=error)
        return self._encoder.error(f"{type(error).__name__}: {error}")

    def close(self) -> None:
        """Stop the stream (idempotent); generation behind it stops at its next step."""
        self._done = True
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()
