"""The handler behind ``model/model.py``: djl-serving's ``handle(inputs)`` contract.

djl's Python worker calls ``handle()`` once with no content (the init call, carrying the
properties) and then once per request. :class:`StreamingService` loads on the init call
(or on the first request, if a front end skips it), parses and validates each request at
the edge, and answers with an ``Output``: a 400 naming the field and the limit for a bad
request, a stream of formatted items for a streaming one, ``{"generated_text": ...}``
otherwise.

Example (``model/model.py``)::

    from djl_stream.service import StreamingService

    _service = StreamingService(entry_module=__name__)

    def handle(inputs):
        return _service.handle(inputs)
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any, Iterator, List, Optional

from .compat import Output
from .formatters import StreamError, StreamFormatter, resolve_formatter
from .properties import ModelProperties
from .errors import QueueFullError
from .request import (
    GenerationRequest,
    RequestError,
    check_input_length,
    parse_json_body,
    parse_request,
)
from .streaming_utils import StreamingUtils

logger = logging.getLogger(__name__)

NEURON_ENGINE = "transformers-neuronx"
ACCELERATE_ENGINE = "Accelerate"


def select_engine(props: ModelProperties) -> str:
    """The engine for this machine: ``option.stream_engine`` when set, transformers-neuronx
    where Neuron devices and the real package are present, Accelerate (GPU or CPU)
    otherwise."""
    if props.stream_engine:
        return props.stream_engine
    if any(Path("/dev").glob("neuron[0-9]*")) and NEURON_ENGINE in StreamingUtils.engines():
        try:
            import transformers_neuronx  # noqa: F401
        except ImportError:
            logger.warning("Neuron devices found but transformers-neuronx is not importable")
        else:
            return NEURON_ENGINE
    return ACCELERATE_ENGINE


def request_error_output(error: RequestError) -> Any:
    """HTTP 400 with a JSON body naming the field and the limit."""
    out = Output(code=400, message="Bad Request")
    out.add_property("content-type", "application/json")
    out.add_as_json(error.to_dict())
    return out


def busy_output(error: Exception) -> Any:
    """HTTP 503: the waiting queue is full; the client may retry later."""
    out = Output(code=503, message="Service Unavailable")
    out.add_property("content-type", "application/json")
    out.add_as_json({"code": 503, "type": "ServiceUnavailableException", "message": str(error)})
    return out


def guard_stream(stream: Iterator[List[str]]) -> Iterator[Any]:
    """Pass ``stream`` through; an error after the first item becomes one last
    :class:`StreamError` item, so the client gets a well-formed error line instead of a
    broken stream. An error before the first item propagates (HTTP 424 upstream).
    Closing this iterator closes ``stream``, which stops generation."""
    started = False
    try:
        for item in stream:
            started = True
            yield item
    except Exception as error:  # noqa: BLE001 - every failure must reach the client
        if not started:
            raise
        logger.exception("generation failed mid-stream")
        yield StreamError(f"{type(error).__name__}: {error}")
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


class StreamingService:
    """Loads the model on the init call and answers requests; see the module docstring."""

    def __init__(self, entry_module: str | types.ModuleType | None = None):
        self._entry_module = entry_module
        self._lock = threading.Lock()
        self.props: Optional[ModelProperties] = None
        self.model = None
        self.tokenizer = None
        self.engine: Optional[str] = None
        self.stream_generator = None
        self.formatter: Optional[StreamFormatter] = None

    @property
    def initialized(self) -> bool:
        return self.model is not None

    def handle(self, inputs) -> Any:
        """djl-serving's entry point: initialize on the init call, else answer."""
        if not self.initialized:
            self.initialize(inputs.get_properties())
            if inputs.is_empty():
                return None
        if inputs.is_empty():
            return None
        return self.inference(inputs)

    def initialize(self, properties: dict) -> None:
        with self._lock:
            if self.initialized:
                return
            from .loading import load_model_and_tokenizer

            props = ModelProperties.from_init_properties(properties)
            self.formatter = resolve_formatter(props.output_formatter, self._module())
            self.engine = select_engine(props)
            self.stream_generator = StreamingUtils.get_stream_generator(self.engine)
            if self.engine == NEURON_ENGINE:
                from .engines.neuronx import load_neuron_model

                model, tokenizer = load_neuron_model(props)
            else:
                model, tokenizer = load_model_and_tokenizer(props)
            if self.engine == ACCELERATE_ENGINE:
                from .engines.accelerate import start_scheduler

                start_scheduler(model, tokenizer, max_batch_size=props.max_rolling_batch_size,
                                max_queue=props.job_queue_size)
            self._warm_up(model, tokenizer)
            self.model, self.tokenizer, self.props = model, tokenizer, props
            logger.info("model ready: engine=%s formatter=%s", self.engine, self.formatter)

    def _warm_up(self, model, tokenizer) -> None:
        """Run one prefill and decode step, so the first client does not pay for the
        one-time costs of the first forward passes (kernel selection, allocator growth)."""
        stream = self.stream_generator(model, tokenizer, ["Hello"], max_new_tokens=2)
        try:
            next(iter(stream), None)
            next(iter(stream), None)
        finally:
            getattr(stream, "close", lambda: None)()

    def _module(self) -> Optional[types.ModuleType]:
        if isinstance(self._entry_module, str):
            return sys.modules.get(self._entry_module)
        return self._entry_module

    # -- requests -------------------------------------------------------------------

    def inference(self, inputs) -> Any:
        try:
            request = self.parse(inputs)
        except RequestError as error:
            return request_error_output(error)
        try:
            stream = self.stream_generator(
                self.model, self.tokenizer, list(request.prompts), **request.parameters.as_kwargs()
            )
        except QueueFullError as error:
            return busy_output(error)
        except RequestError as error:
            # an engine's own limits (e.g. a Neuron model's compiled batch size)
            return request_error_output(error)
        wants_stream = self.props.enable_streaming if request.stream is None else request.stream
        out = Output()
        if wants_stream:
            out.add_property("content-type", self.formatter.content_type)
            out.add_stream_content(guard_stream(stream), output_formatter=self.formatter)
            return out
        texts = [""] * len(request.prompts)
        for pieces in stream:
            for i, piece in enumerate(pieces):
                texts[i] += piece
        out.add_property("content-type", "application/json")
        out.add_as_json({"generated_text": texts if request.batched else texts[0]})
        return out

    def parse(self, inputs) -> GenerationRequest:
        """The validated request in ``inputs``, with chat templates applied and lengths
        checked; raises :class:`RequestError`."""
        if inputs.is_batch():
            # djl-serving's dynamic batching (batch_size > 1) merges requests into one
            # Input; the real engine refuses it with streaming, and continuous batching
            # already shares decode steps between concurrent requests.
            raise RequestError(
                "batch_size",
                "dynamic batching (batch_size > 1 in serving.properties) is not supported: "
                "djl-stream batches concurrent requests continuously; remove batch_size",
            )
        body = parse_json_body(inputs.get_as_bytes("data") if inputs.contains_key("data")
                               else inputs.get_as_bytes())
        request = parse_request(
            body,
            default_max_new_tokens=self.props.default_max_new_tokens,
            max_new_tokens_limit=self.props.max_new_tokens_limit,
            apply_chat_template=self.render_chat if self.has_chat_template else None,
        )
        if request.messages is None and self.wraps_inputs_in_chat_template:
            prompts = tuple(self.render_chat([{"role": "user", "content": p}]) for p in request.prompts)
            request = GenerationRequest(prompts, request.parameters, request.stream,
                                        request.batched, None)
        field = "messages" if request.messages is not None else "inputs"
        if len(request.prompts) > self.props.max_rolling_batch_size:
            raise RequestError(
                field,
                f"{field} has {len(request.prompts)} prompts; the limit "
                f"(option.max_rolling_batch_size) is {self.props.max_rolling_batch_size}",
            )
        context = getattr(self.model.config, "max_position_embeddings", None)
        lengths = [len(ids) for ids in self.tokenizer(list(request.prompts))["input_ids"]]
        for i, n in enumerate(lengths):
            name = field if request.messages is not None or not request.batched else f"{field}[{i}]"
            check_input_length(name, n, self.props.max_input_length)
            wanted = n + request.parameters.max_new_tokens
            if context and wanted > context:
                raise RequestError(
                    "parameters.max_new_tokens",
                    f"{name} ({n} tokens) + parameters.max_new_tokens "
                    f"({request.parameters.max_new_tokens}) is {wanted} tokens; the model's "
                    f"context (max_position_embeddings) is {context}",
                )
        return request

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def wraps_inputs_in_chat_template(self) -> bool:
        choice = self.props.apply_chat_template
        return self.has_chat_template if choice is None else choice

    def render_chat(self, messages: List[dict]) -> str:
        """The prompt text for ``messages``, ending with the assistant's turn opening.

        A template that writes the BOS token itself would get a second one when the prompt
        is tokenized, so a leading BOS is dropped here."""
        if not self.has_chat_template:
            raise RequestError("messages", "the model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos and text.startswith(bos) and self._tokenizer_adds_bos:
            text = text[len(bos):]
        return text

    @functools.cached_property
    def _tokenizer_adds_bos(self) -> bool:
        """Whether tokenizing a prompt adds BOS; asked once (only after loading)."""
        ids = self.tokenizer("a")["input_ids"]
        return bool(ids) and ids[0] == getattr(self.tokenizer, "bos_token_id", None)
