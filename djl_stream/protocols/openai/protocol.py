"""OpenAI's chat completions and completions as :class:`~djl_stream.protocols.protocol.Protocol`\\ s.

Registered in :data:`djl_stream.serving.service.PROTOCOLS` as ``openai-chat`` and
``openai-completions``: ``djl-stream serve`` routes ``POST /v1/chat/completions`` and
``POST /v1/completions`` to them, and a body sent to ``/invocations`` (djl-serving's
route) with ``messages`` or ``prompt`` selects them by its shape.

- Not streaming: one ``chat.completion`` (``text_completion``) object with ``choices``,
  ``usage``, ``id``, ``created`` and ``model``.
- Streaming (``"stream": true``): server-sent events, one ``chat.completion.chunk``
  (``text_completion``) per choice that has something new after each decode step, the
  first chunk of each chat choice carrying the assistant role; with
  ``stream_options.include_usage`` every chunk has ``"usage": null`` and a last chunk has
  empty ``choices`` and the usage; then ``data: [DONE]``. A generation that fails after
  the first chunk ends the stream with ``data: {"error": {...}}`` and ``data: [DONE]``,
  which the OpenAI SDK raises as an ``APIError``.
- Errors: ``{"error": {"message", "type", "param", "code"}}`` with djl's statuses and
  messages (see :data:`~djl_stream.protocols.openai.responses.ERRORS`).

    >>> from djl_stream.protocols.protocol import Failure
    >>> protocol = ChatCompletionsProtocol("model")
    >>> answer = protocol.error(Failure("busy", "1000 requests are waiting"))
    >>> answer.code, answer.body["error"]["code"]
    (503, 'queue_full')
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence

from djl_stream.generation.step import Step
from djl_stream.protocols.openai.request import Answer, parse_chat, parse_completion
from djl_stream.protocols.openai.responses import (ERRORS, SSE_CONTENT_TYPE, SSE_DONE,
                                                   Choices, TokenText, Update, chat_logprobs,
                                                   completion_logprobs, error_body, new_id,
                                                   now, sse)
from djl_stream.protocols.openai.tools import ToolCallReader
from djl_stream.protocols.protocol import (ErrorAnswer, Failure, ParseContext, Protocol,
                                           StreamEncoder)
from djl_stream.protocols.request import GenerationRequest


class OpenAIProtocol(Protocol):
    """What chat completions and completions share: ids, choices, usage, errors, the SSE
    stream. Subclasses say how a body parses and how a choice is written.

    ``model_name`` is what answers say in ``model``; ``tokenizer`` turns token ids into
    the text and bytes of log-probability entries.
    """

    id_prefix: str
    object_name: str
    chunk_object_name: str

    def __init__(self, model_name: str, tokenizer: Any = None) -> None:
        self.model_name = model_name
        self.token_text = TokenText(tokenizer) if tokenizer is not None else None

    # -- what subclasses write --

    def chunk_choice(self, update: Update) -> Dict[str, Any]:
        raise NotImplementedError

    def response_choice(self, index: int, choices: Choices, answer: Answer) -> Dict[str, Any]:
        raise NotImplementedError

    # -- the Protocol interface --

    def stream_encoder(self, request: GenerationRequest,
                       prompt_tokens: Sequence[int]) -> StreamEncoder:
        return OpenAIStream(self, request, prompt_tokens)

    def complete(self, request: GenerationRequest, steps: Sequence[Step],
                 prompt_tokens: Sequence[int]) -> Any:
        choices = self.choices(request)
        for step in steps:
            choices.feed(step)
        choices.finish()
        answer: Answer = request.answer
        return {
            "id": new_id(self.id_prefix),
            "object": self.object_name,
            "created": now(),
            "model": self.model_name,
            "choices": [self.response_choice(i, choices, answer)
                        for i in range(len(request.prompts))],
            "usage": choices.usage(distinct_prompt_tokens(request, prompt_tokens)),
        }

    def error(self, failure: Failure) -> ErrorAnswer:
        code, reason, error_type, error_code = ERRORS.get(failure.kind, ERRORS["failed"])
        param = failure.field if failure.field not in (None, "body") else None
        return ErrorAnswer(code, error_body(failure.message, error_type, param, error_code),
                           reason)

    def max_new_tokens_field(self, request: GenerationRequest) -> str:
        return request.answer.max_tokens_field

    def choices(self, request: GenerationRequest) -> Choices:
        answer: Answer = request.answer
        return Choices(len(request.prompts), self.token_text if answer.logprobs else None,
                       request.parameters.max_new_tokens)


def distinct_prompt_tokens(request: GenerationRequest, prompt_tokens: Sequence[int]) -> List[int]:
    """Each prompt's length once: the ``n`` copies of a prompt are one prompt in ``usage``."""
    return list(prompt_tokens[::request.answer.n])


class OpenAIStream(StreamEncoder):
    """One request's server-sent events; see the module docstring."""

    content_type = SSE_CONTENT_TYPE

    def __init__(self, protocol: OpenAIProtocol, request: GenerationRequest,
                 prompt_tokens: Sequence[int]) -> None:
        self.protocol = protocol
        self.request = request
        self.answer: Answer = request.answer
        self.prompt_tokens = distinct_prompt_tokens(request, prompt_tokens)
        self.choices = protocol.choices(request)
        # Every chunk of one answer has the same id and created time, as OpenAI's do.
        self.id = new_id(protocol.id_prefix)
        self.created = now()

    def _chunk(self, choices: List[Dict[str, Any]]) -> Dict[str, Any]:
        chunk = {"id": self.id, "object": self.protocol.chunk_object_name,
                 "created": self.created, "model": self.protocol.model_name,
                 "choices": choices}
        if self.answer.include_usage:
            chunk["usage"] = None
        return chunk

    def _events(self, updates: List[Update]) -> bytes:
        # One choice per chunk, as OpenAI sends them: clients that read choices[0] of
        # every chunk (LangChain does) see each choice's text in order.
        return b"".join(sse(self._chunk([self.protocol.chunk_choice(update)]))
                        for update in updates)

    def step(self, step: Step) -> bytes:
        return self._events(self.choices.feed(step))

    def end(self) -> bytes:
        out = self._events(self.choices.finish())
        if self.answer.include_usage:
            closing = self._chunk([])
            closing["usage"] = self.choices.usage(self.prompt_tokens)
            out += sse(closing)
        return out + SSE_DONE

    def error(self, message: str) -> bytes:
        failure = self.protocol.error(Failure("failed", message))
        return sse(failure.body) + SSE_DONE


class ChatCompletionsProtocol(OpenAIProtocol):
    """``POST /v1/chat/completions``: messages through the model's chat template.

    >>> from djl_stream.generation.step import Generation, Step
    >>> from djl_stream.protocols.protocol import ParseContext
    >>> protocol = ChatCompletionsProtocol("smollm2")
    >>> context = ParseContext(50, 2048, 32, "smollm2", render_chat=lambda ms: ms[-1]["content"])
    >>> request = protocol.parse({"messages": [{"role": "user", "content": "Hi"}]}, context)
    >>> body = protocol.complete(request, [Step.of([Generation(0, 9, "Hello", "eos")])], [3])
    >>> body["choices"][0]["message"], body["usage"]["total_tokens"]
    ({'role': 'assistant', 'content': 'Hello'}, 4)
    """

    name = "openai-chat"
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def parse(self, body: Any, context: ParseContext) -> GenerationRequest:
        return parse_chat(body, context)

    def stream_encoder(self, request: GenerationRequest,
                       prompt_tokens: Sequence[int]) -> StreamEncoder:
        return ChatStream(self, request, prompt_tokens)

    def chunk_choice(self, update: Update) -> Dict[str, Any]:
        delta: Dict[str, Any] = {"role": "assistant"} if update.first else {}
        if update.text or (update.first and not update.tool_calls):
            delta["content"] = update.text
        if update.tool_calls:
            delta["tool_calls"] = update.tool_calls
        return {"index": update.index, "delta": delta,
                "logprobs": chat_logprobs(update.logprobs) if update.logprobs else None,
                "finish_reason": update.finish_reason}

    def response_choice(self, index: int, choices: Choices, answer: Answer) -> Dict[str, Any]:
        message: Dict[str, Any] = {"role": "assistant", "content": choices.texts()[index]}
        finish_reason = choices.finish_reasons()[index]
        if answer.tools is not None:
            reader = ToolCallReader(answer.tools)
            content = reader.feed(message["content"])[0] + reader.finish()[0]
            if reader.called:
                calls = [{key: value for key, value in call.items() if key != "index"}
                         for call in reader.calls]
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": calls}
                finish_reason = _with_calls(finish_reason)
        return {"index": index, "message": message,
                "logprobs": chat_logprobs(choices.logprobs(index)) if answer.logprobs else None,
                "finish_reason": finish_reason}


def _with_calls(finish_reason: Any) -> Any:
    """A choice that called tools and ended of itself finished for ``tool_calls``."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ChatStream(OpenAIStream):
    """A chat answer's events; with tools, each choice's text goes through a
    :class:`~djl_stream.protocols.openai.tools.ToolCallReader`, so calls stream as
    ``tool_calls`` entries and the rest as ``content``."""

    def __init__(self, protocol: OpenAIProtocol, request: GenerationRequest,
                 prompt_tokens: Sequence[int]) -> None:
        super().__init__(protocol, request, prompt_tokens)
        use = request.answer.tools
        self.readers = (None if use is None
                        else [ToolCallReader(use) for _ in request.prompts])

    def _events(self, updates: List[Update]) -> bytes:
        if self.readers is not None:
            # A piece the reader holds back (a call being written) leaves nothing to send.
            updates = [update for update in map(self._read, updates)
                       if update.text or update.tool_calls or update.first
                       or update.logprobs or update.finish_reason is not None]
        return super()._events(updates)

    def _read(self, update: Update) -> Update:
        reader = self.readers[update.index]
        content, calls = reader.feed(update.text)
        finish_reason = update.finish_reason
        if finish_reason is not None:
            more, last = reader.finish()
            content, calls = content + more, calls + last
            if reader.called:
                finish_reason = _with_calls(finish_reason)
        return dataclasses.replace(update, text=content, tool_calls=calls,
                                   finish_reason=finish_reason)


class CompletionsProtocol(OpenAIProtocol):
    """``POST /v1/completions``: prompts sent to the model as they are.

    Choices are numbered prompt by prompt, each prompt's ``n`` choices together
    (``index`` = prompt × n + choice), as OpenAI and vLLM number them.
    """

    name = "openai-completions"
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def parse(self, body: Any, context: ParseContext) -> GenerationRequest:
        return parse_completion(body, context)

    def prompt_field(self, request: GenerationRequest, index: int) -> str:
        return f"prompt[{index // request.answer.n}]" if request.batched else "prompt"

    def chunk_choice(self, update: Update) -> Dict[str, Any]:
        return {"index": update.index, "text": update.text,
                "logprobs": completion_logprobs(update.logprobs) if update.logprobs else None,
                "finish_reason": update.finish_reason}

    def response_choice(self, index: int, choices: Choices, answer: Answer) -> Dict[str, Any]:
        return {"index": index, "text": choices.texts()[index],
                "logprobs": completion_logprobs(choices.logprobs(index))
                if answer.logprobs else None,
                "finish_reason": choices.finish_reasons()[index]}


def openai_chat(service: Any) -> ChatCompletionsProtocol:
    """The ``openai-chat`` protocol of a loaded :class:`~djl_stream.serving.service.StreamingService`
    (the factory :data:`~djl_stream.serving.service.PROTOCOLS` names)."""
    return ChatCompletionsProtocol(service.model_name, service.tokenizer)


def openai_completions(service: Any) -> CompletionsProtocol:
    """The ``openai-completions`` protocol of a loaded service."""
    return CompletionsProtocol(service.model_name, service.tokenizer)
