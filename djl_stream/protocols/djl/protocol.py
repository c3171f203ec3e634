"""djl-serving's schema as a :class:`~djl_stream.protocols.protocol.Protocol`.

Requests are ``{"inputs" | "messages", "parameters", "stream"}`` (:mod:`.request`); a
streaming answer is one formatted item per decode step (:mod:`.formatters`, ``jsonlines``
by default), a non-streaming one ``{"generated_text": ...}``; errors are djl-serving's:

- 400 ``{"code", "type": "RequestError", "field", "message"}`` for a bad request,
- 424 ``{"code", "message": "invoke handler failure", "error"}`` for a failed generation,
- 507 without a body for out of memory (the message is the status line's reason),
- 503 ``{"code", "type": "ServiceUnavailableException", "message"}`` when the queue is full.

**Per-token details.** With ``"details": true`` in ``parameters`` (or ``logprobs`` /
``top_logprobs``, whose scores are only written there), or by default with
``option.output_formatter=jsonlines_details``, a stream carries per-token records instead
of text: one ``{"tokens": [...]}`` per decode step
(:func:`~djl_stream.protocols.djl.formatters.tokens_record`), framed as the formatter
frames its lines (a JSON line, or an ``sse`` event), and after the last step one::

    {"details": [{"finish_reason": "eos_token", "generated_tokens": 7, "prompt_tokens": 12}]}

one entry per prompt. Finish reasons are djl-serving LMI's (and TGI's) words:
``eos_token``, ``length``, ``stop_sequence``; ``null`` where an engine reports none. A
non-streaming answer with details is::

    {"generated_text": "...", "details": {"finish_reason": "length", "generated_tokens": 8,
                                          "prompt_tokens": 12, "tokens": [{...}, ...]}}

with ``generated_text`` and ``details`` lists, one entry per prompt, when ``inputs`` was a
list. ``generated_tokens`` counts every token the engine chose, the end-of-sequence one
included (it is a ``special`` token with no text). Without details, the answers are
byte for byte what they always were.

**return_full_text** puts each prompt, as the client sent it (not the chat template's
rendering), in front of its text: of ``generated_text``, and of the first piece of a
text stream.

    >>> protocol = DjlProtocol()
    >>> protocol.error(Failure("busy", "9 requests are waiting")).body["type"]
    'ServiceUnavailableException'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from djl_stream.generation.step import Step
from djl_stream.protocols.djl.formatters import (BUILTIN_FORMATTERS, FINISH_REASONS,
                                                 StreamFormatter, TokenText, resolve_formatter,
                                                 tokens_record)
from djl_stream.protocols.djl.request import DjlAnswer, parse_request
from djl_stream.protocols.protocol import (ErrorAnswer, Failure, ParseContext, Protocol,
                                           StreamEncoder)
from djl_stream.protocols.request import GenerationRequest
from djl_stream.protocols.validation import RequestError

#: djl_python's ``Output.error`` message; given explicitly so that every djl-serving
#: release (0.30 says "prediction failure" by default) answers alike.
HANDLER_FAILURE = "invoke handler failure"


class FormatterEncoder(StreamEncoder):
    """A stream through an output formatter: each step as the formatter writes it, a
    failure as the formatter's error record (an SSE ``error`` event, else a JSON line).

    ``prefixes`` (``return_full_text``) go in front of each prompt's first piece.

    >>> encoder = FormatterEncoder(resolve_formatter("jsonlines"), prefixes=("Q: ",))
    >>> encoder.step(Step(["A"])), encoder.step(Step(["B"]))
    (b'{"output_tokens": ["Q: A"]}\\n', b'{"output_tokens": ["B"]}\\n')
    """

    def __init__(self, formatter: StreamFormatter,
                 prefixes: Optional[Sequence[str]] = None) -> None:
        self.formatter = formatter
        self.content_type = formatter.content_type
        self._prefixes = prefixes

    def step(self, step: Step) -> bytes:
        if self._prefixes is not None:
            step = Step([prefix + piece for prefix, piece in zip(self._prefixes, step)],
                        step.generations)
            self._prefixes = None
        return self.formatter(step)

    def error(self, message: str) -> bytes:
        return self.formatter.format_error(message)


class TokenTally:
    """Per prompt, what a generation's steps add up to: the tokens generated, the finish
    reason, and (``keep_tokens``, for a non-streaming answer) the token records.

    >>> from djl_stream.generation.step import Generation
    >>> tally = TokenTally([3, 4])
    >>> tally.add(Step.of([Generation(0, 5, "Hi"), Generation(1, 6, "Yo", "length")]))
    {'tokens': [{'id': 5, 'text': 'Hi', 'logprob': None, 'special': False}, {'id': 6, 'text': 'Yo', 'logprob': None, 'special': False}]}
    >>> tally.add(Step.of([Generation(0, 2, "", "eos", special=True), None]))["tokens"][1] is None
    True
    >>> tally.summary()
    [{'finish_reason': 'eos_token', 'generated_tokens': 2, 'prompt_tokens': 3}, {'finish_reason': 'length', 'generated_tokens': 1, 'prompt_tokens': 4}]
    """

    def __init__(self, prompt_tokens: Sequence[int], *, top_logprobs: int = 0,
                 token_text: Optional[TokenText] = None, keep_tokens: bool = False) -> None:
        self.prompt_tokens = list(prompt_tokens)
        self.top_logprobs = top_logprobs
        self.token_text = token_text
        self.generated = [0] * len(self.prompt_tokens)
        self.finish_reasons: List[Optional[str]] = [None] * len(self.prompt_tokens)
        self.tokens: Optional[List[List[Dict[str, Any]]]] = (
            [[] for _ in self.prompt_tokens] if keep_tokens else None)

    def add(self, step: Step) -> Dict[str, Any]:
        """Count one step; return its ``{"tokens": [...]}`` record."""
        record = tokens_record(step, top_logprobs=self.top_logprobs, token_text=self.token_text)
        generations = step.generations
        for i, entry in enumerate(record["tokens"][:len(self.generated)]):
            if entry is None:
                continue
            self.generated[i] += 1
            if self.tokens is not None:
                self.tokens[i].append(entry)
            generation = generations[i] if i < len(generations) else None
            if generation is not None and generation.finish_reason is not None:
                self.finish_reasons[i] = FINISH_REASONS.get(generation.finish_reason,
                                                            generation.finish_reason)
        return record

    def summary(self) -> List[Dict[str, Any]]:
        """Per prompt ``{"finish_reason", "generated_tokens", "prompt_tokens"}``, and
        ``"tokens"`` when they were kept."""
        summary = []
        for i, prompt_tokens in enumerate(self.prompt_tokens):
            entry: Dict[str, Any] = {"finish_reason": self.finish_reasons[i],
                                     "generated_tokens": self.generated[i],
                                     "prompt_tokens": prompt_tokens}
            if self.tokens is not None:
                entry["tokens"] = self.tokens[i]
            summary.append(entry)
        return summary


class DetailsEncoder(StreamEncoder):
    """A stream of per-token details: a ``{"tokens": [...]}`` record per step and a
    ``{"details": [...]}`` record at the end, each framed by ``formatter.write_record``
    (a built-in formatter's framing: a JSON line, or an ``sse`` event).

    >>> from djl_stream.generation.step import Generation
    >>> encoder = DetailsEncoder(resolve_formatter("sse"), TokenTally([2]))
    >>> encoder.step(Step.of([Generation(0, 9, "!", "stop")]))
    b'data: {"tokens": [{"id": 9, "text": "!", "logprob": null, "special": false}]}\\n\\n'
    >>> encoder.end()
    b'data: {"details": [{"finish_reason": "stop_sequence", "generated_tokens": 1, "prompt_tokens": 2}]}\\n\\n'
    """

    def __init__(self, formatter: StreamFormatter, tally: TokenTally) -> None:
        if formatter.write_record is None:
            raise ValueError(f"the output formatter {formatter.name!r} writes no details")
        self.formatter = formatter
        self.content_type = formatter.content_type
        self.tally = tally

    def step(self, step: Step) -> bytes:
        return self.formatter.write_record(self.tally.add(step))

    def end(self) -> bytes:
        return self.formatter.write_record({"details": self.tally.summary()})

    def error(self, message: str) -> bytes:
        return self.formatter.format_error(message)


class DjlProtocol(Protocol):
    """djl-serving's own request and answer formats; see the module docstring.

    ``formatter`` is the model's ``option.output_formatter`` (``jsonlines`` by default).
    ``token_text`` writes the text of a ``top_logprobs`` alternative (from the tokenizer;
    without it those texts are ``null``). ``scores``: whether the engine reports
    log-probabilities, so that details come with them (Accelerate does; an engine that
    does not gets ``"logprob": null``). ``enable_streaming`` is the model's
    ``option.enable_streaming``, what a request without ``stream`` gets.
    """

    name = "djl"

    def __init__(self, formatter: Optional[StreamFormatter] = None, *,
                 token_text: Optional[TokenText] = None, scores: bool = True,
                 enable_streaming: bool = True) -> None:
        self.formatter = formatter or resolve_formatter("jsonlines")
        self.token_text = token_text
        self.scores = scores
        self.enable_streaming = enable_streaming

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
            request = dataclasses.replace(request, prompts=prompts)
        return self._resolve_details(request)

    def _resolve_details(self, request: GenerationRequest) -> GenerationRequest:
        """Decide whether the answer has details (the request's ``details``, else the
        formatter's default for a stream), refuse what a stream cannot carry, and ask the
        engine for the scores the details will show."""
        answer: DjlAnswer = request.answer
        streaming = self.enable_streaming if request.stream is None else request.stream
        details = answer.details
        if details is None:
            details = streaming and self.formatter.details
        if details and streaming and self.formatter.write_record is None:
            raise RequestError(
                "parameters.details",
                f"parameters.details (asked by details, logprobs or top_logprobs) needs a "
                f"built-in output formatter to stream: jsonlines, sse or jsonlines_details; "
                f"this model streams with option.output_formatter={self.formatter.name}. "
                f"Send \"stream\": false to get the details in the JSON answer")
        if details and streaming and answer.return_full_text:
            raise RequestError(
                "parameters.return_full_text",
                "parameters.return_full_text applies to text (output_tokens lines, "
                "generated_text), and this stream carries per-token details instead; send "
                "\"stream\": false, or ask without details")
        parameters = request.parameters
        if details and self.scores and not parameters.logprobs:
            parameters = dataclasses.replace(parameters, logprobs=True)
        return dataclasses.replace(request, parameters=parameters,
                                   answer=dataclasses.replace(answer, details=details))

    def stream_encoder(self, request: GenerationRequest,
                       prompt_tokens: Sequence[int]) -> StreamEncoder:
        answer = _answer_of(request)
        if answer.details:
            return DetailsEncoder(self.formatter, TokenTally(
                prompt_tokens, top_logprobs=answer.top_logprobs, token_text=self.token_text))
        formatter = self.formatter
        if formatter.details:  # jsonlines_details, and the request said "details": false
            formatter = BUILTIN_FORMATTERS["jsonlines"]
        return FormatterEncoder(formatter,
                                answer.inputs if answer.return_full_text else None)

    def complete(self, request: GenerationRequest, steps: Sequence[Step],
                 prompt_tokens: Sequence[int]) -> Any:
        answer = _answer_of(request)
        texts = ["".join(step[i] for step in steps) for i in range(len(request.prompts))]
        if answer.return_full_text:
            texts = [prompt + text for prompt, text in zip(answer.inputs, texts)]
        body: Dict[str, Any] = {"generated_text": texts if request.batched else texts[0]}
        if answer.details:
            tally = TokenTally(prompt_tokens, top_logprobs=answer.top_logprobs,
                               token_text=self.token_text, keep_tokens=True)
            for step in steps:
                tally.add(step)
            details = tally.summary()
            body["details"] = details if request.batched else details[0]
        return body

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


def _answer_of(request: GenerationRequest) -> DjlAnswer:
    # A request built by hand (a test, another caller) may carry no DjlAnswer: plain text.
    answer = request.answer
    return answer if isinstance(answer, DjlAnswer) else DjlAnswer(request.prompts, False)


def djl_protocol(service: Any) -> DjlProtocol:
    """The djl protocol of a loaded :class:`~djl_stream.serving.service.StreamingService`:
    its output formatter, its tokenizer for the texts of ``top_logprobs``, whether its
    engine reports scores (Accelerate does), and ``option.enable_streaming``."""
    tokenizer = service.tokenizer

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)

    return DjlProtocol(service.formatter, token_text=token_text,
                       scores=service.engine.capabilities.scores,
                       enable_streaming=service.props.enable_streaming)
