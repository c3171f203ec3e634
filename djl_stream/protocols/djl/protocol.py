"""djl-serving's schema as a :class:`~djl_stream.protocols.protocol.Protocol`.

Requests are ``{"inputs" | "messages", "parameters", "stream"}`` (:mod:`.request`); a
streaming answer is one formatted item per decode step (:mod:`.formatters`, ``jsonlines``
by default), a non-streaming one ``{"generated_text": ...}``; errors are djl-serving's:

- 400 ``{"code", "type": "RequestError", "field", "message"}`` for a bad request,
- 424 ``{"code", "message": "invoke handler failure", "error"}`` for a failed generation,
- 507 without a body for out of memory (the message is the status line's reason),
- 503 ``{"code", "type": "ServiceUnavailableException", "message"}`` when the queue is full.

    >>> protocol = DjlProtocol()
    >>> protocol.error(Failure("busy", "9 requests are waiting")).body["type"]
    'ServiceUnavailableException'
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from djl_stream.generation.step import Step
from djl_stream.protocols.djl.formatters import StreamFormatter, resolve_formatter
from djl_stream.protocols.djl.request import parse_request
from djl_stream.protocols.protocol import (ErrorAnswer, Failure, ParseContext, Protocol,
                                           StreamEncoder)
from djl_stream.protocols.request import GenerationRequest

#: djl_python's ``Output.error`` message; given explicitly so that every djl-serving
#: release (0.30 says "prediction failure" by default) answers alike.
HANDLER_FAILURE = "invoke handler failure"


class FormatterEncoder(StreamEncoder):
    """A stream through an output formatter: each step as the formatter writes it, a
    failure as the formatter's error record (an SSE ``error`` event, else a JSON line)."""

    def __init__(self, formatter: StreamFormatter) -> None:
        self.formatter = formatter
        self.content_type = formatter.content_type

    def step(self, step: Step) -> bytes:
        return self.formatter(step)

    def error(self, message: str) -> bytes:
        return self.formatter.format_error(message)


class DjlProtocol(Protocol):
    """djl-serving's own request and answer formats; see the module docstring.

    ``formatter`` is the model's ``option.output_formatter`` (``jsonlines`` by default).
    """

    name = "djl"

    def __init__(self, formatter: Optional[StreamFormatter] = None) -> None:
        self.formatter = formatter or resolve_formatter("jsonlines")

    def parse(self, body: Any, context: ParseContext) -> GenerationRequest:
        request = parse_request(
            body,
            default_max_new_tokens=context.default_max_new_tokens,
            max_new_tokens_limit=context.max_new_tokens_limit,
            apply_chat_template=context.render_chat,
        )
        if request.messages is None and context.wrap_prompts_in_chat and context.render_chat:
            prompts = tuple(context.render_chat([{"role": "user", "content": p}])
                            for p in request.prompts)
            request = GenerationRequest(prompts, request.parameters, request.stream,
                                        request.batched, None)
        return request

    def stream_encoder(self, request: GenerationRequest,
                       prompt_tokens: Sequence[int]) -> StreamEncoder:
        return FormatterEncoder(self.formatter)

    def complete(self, request: GenerationRequest, steps: Sequence[Step],
                 prompt_tokens: Sequence[int]) -> Any:
        texts = ["".join(step[i] for step in steps) for i in range(len(request.prompts))]
        return {"generated_text": texts if request.batched else texts[0]}

    def error(self, failure: Failure) -> ErrorAnswer:
        if failure.kind == "invalid":
            return ErrorAnswer(400, {"code": 400, "type": "RequestError",
                                     "field": failure.field, "message": failure.message},
                               "Bad Request")
        if failure.kind == "busy":
            return ErrorAnswer(503, {"code": 503, "type": "ServiceUnavailableException",
                                     "message": failure.message}, "Service Unavailable")
        if failure.kind == "out_of_memory":
            return ErrorAnswer(507, None, failure.message)
        return ErrorAnswer(424, {"code": 424, "message": HANDLER_FAILURE,
                                 "error": failure.message}, HANDLER_FAILURE)
