"""The handler behind ``model/model.py``: djl-serving's ``handle(inputs)`` contract.

djl's Python worker calls ``handle()`` once with no content (the init call, carrying the
properties) and then once per request. :class:`StreamingService` loads on the init call
(or on the first request, if a front end skips it), parses and validates each request at
the edge, and answers (:mod:`djl_stream.serving.replies`): a 400 naming the field and the limit for
a bad request; for a streaming one, the formatted chunks, once the first exists (so that a
generation failing at once is still a 424, not a 200 carrying an error); else
``{"generated_text": ...}``.

Both of djl-serving's worker modes are served: the synchronous worker calls ``handle()``
and gets an ``Output``; djl-serving 0.33's asynchronous worker (LMI images without
``option.entryPoint``) awaits it, and gets the async protocol's ``Output``\ s.

Example (``model/model.py``)::

    from djl_stream.serving.service import StreamingService

    _service = StreamingService(entry_module=__name__)

    def handle(inputs):
        return _service.handle(inputs)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import importlib
import importlib.util
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from djl_stream.generation.engine import Engine, FunctionEngine
from djl_stream.generation.errors import QueueFullError, ShuttingDown
from djl_stream.generation.step import Step
from djl_stream.runtime.kv_memory import default_max_request_kv_tokens
from djl_stream.generation.streaming_utils import StreamingUtils
from djl_stream.protocols.djl.formatters import StreamFormatter, resolve_formatter
from djl_stream.protocols.djl.protocol import djl_protocol
from djl_stream.protocols.model_queries import (DETOKENIZE, INFO, MODEL_QUERIES, TOKENIZE,
                                              detokenize, query_kind, tokenize)
from djl_stream.protocols.openai.tools import template_renders_tools
from djl_stream.protocols.protocol import (PROTOCOL_PROPERTY, EncodedStream, Failure,
                                           ParseContext, Protocol, StreamEncoder)
from djl_stream.protocols.request import GenerationRequest
from djl_stream.protocols.validation import (RequestError, check_input_characters,
                                             check_input_length, check_request_input_length,
                                             check_request_kv_positions,
                                             parse_json_body)
from djl_stream.serving.cancellation import Cancellation, CancellableStream, cancellation_of
from djl_stream.serving.properties import ModelProperties
from djl_stream.serving.replies import (ErrorReply, JsonReply, Reply, StreamReply,
                                        is_out_of_memory, to_async_output, to_async_outputs,
                                        to_output)

logger = logging.getLogger(__name__)

NEURON_ENGINE = "transformers-neuronx"
ACCELERATE_ENGINE = "Accelerate"
#: Threads the async worker mode pulls chunks with: each open stream may hold one while it
#: waits for its next token (the same bound as ``djl-stream serve``'s).
ASYNC_MAX_THREADS = 128
#: Protocols beyond djl-serving's own, by name: ``"module:factory"``, the factory called
#: with the loaded service (a protocol may read the model's properties or tokenizer).
PROTOCOLS: Dict[str, str] = {
    "openai-chat": "djl_stream.protocols.openai.protocol:openai_chat",
    "openai-completions": "djl_stream.protocols.openai.protocol:openai_completions",
    "tgi": "djl_stream.protocols.tgi.protocol:compat_protocol",
    "tgi-generate": "djl_stream.protocols.tgi.protocol:generate_protocol",
    "tgi-generate-stream": "djl_stream.protocols.tgi.protocol:generate_stream_protocol",
}
#: Which protocol answers a body when the request names none: the first whose key the body
#: sets (``messages``: OpenAI chat completions, as LMI answers them; ``prompt``: OpenAI
#: completions), among the protocols the model serves. A key set to ``null`` picks
#: nothing: ``{"inputs": "Hi", "messages": null}`` is djl's.
PROTOCOLS_BY_BODY: Tuple[Tuple[str, str], ...] = (("messages", "openai-chat"),
                                                  ("prompt", "openai-completions"))
#: The answer to a request whose client left before it was ready: nobody reads it, and the
#: server (which saw the client go) sends nothing. 499 is nginx's "client closed request".
CLIENT_LEFT = ErrorReply(499, None, "Client Closed Request", "the client disconnected")


#: The most code points Unicode composition (a normalizer's NFC or NFKC) joins into one
#: character: U+1F82 is four in NFD. A tokenizer that normalizes may see that much less.
COMPOSITION_RATIO = 4


def most_characters_per_token(tokenizer) -> int:
    """The most characters of a prompt one token of ``tokenizer`` can stand for: its
    longest vocabulary entry, times :data:`COMPOSITION_RATIO` when the tokenizer normalizes
    text first (or may: a tokenizer without a ``tokenizers`` backend).

    No fixed factor is safe: SmolLM2 has a token for a newline and 80 spaces, so 4096 of
    its tokens can hold 331776 characters. The vocabulary says how long a token can be;
    byte-level entries count one per byte, never fewer than the characters they stand for.
    Only a tokenizer whose normalizer deletes characters, or whose ``<unk>`` swallows a run
    of unknown ones, can fit more, and only for prompts made of those.

    >>> most_characters_per_token(tokenizer)  # SmolLM2's: byte-level BPE, no normalizer
    81
    """
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return longest * COMPOSITION_RATIO
    return longest


def is_dynamic_batch(inputs) -> bool:
    """Whether djl-serving's front end merged several requests into ``inputs``.

    ``Input.is_batch()`` only looks for a ``batch_size`` property, and the front end turns
    every HTTP header into a property, so a client's ``batch_size: 2`` header would pass
    for a batch. What a header cannot forge is the content: the front end's
    ``PyPredictor`` prefixes each merged request's keys with ``batch_000.``,
    ``batch_001.``...

    >>> from djl_stream.serving.inputs import Input
    >>> forged = Input(properties={"batch_size": "2"}).add("data", b"{}")
    >>> is_dynamic_batch(forged)
    False
    """
    if not inputs.is_batch():
        return False
    return any(str(key).startswith("batch_") for key in inputs.get_content().get_keys())


def create_engine(name: str, props: ModelProperties) -> Engine:
    """Load the model ``props`` describe and the engine ``name`` (see :func:`select_engine`)
    that serves it: Accelerate's with the limits the properties set; a Neuron model for
    transformers-neuronx; any other registered stream generator as a
    :class:`~djl_stream.generation.engine.FunctionEngine`."""
    if name == NEURON_ENGINE:
        from djl_stream.generation.engines.neuronx import load_neuron_model

        model, tokenizer = load_neuron_model(props)
        return FunctionEngine(name, StreamingUtils.get_stream_generator(name), model=model,
                              tokenizer=tokenizer)
    from djl_stream.runtime.loading import load_model_and_tokenizer

    generator = StreamingUtils.get_stream_generator(name)  # (an unknown name fails first)
    model, tokenizer = load_model_and_tokenizer(props)
    if name != ACCELERATE_ENGINE:
        return FunctionEngine(name, generator, model=model, tokenizer=tokenizer)
    from djl_stream.generation.engines.accelerate import AccelerateEngine, AccelerateSettings

    return AccelerateEngine(model, tokenizer, AccelerateSettings(
        max_batch_size=props.max_rolling_batch_size, max_queue=props.job_queue_size,
        max_batch_prefill_tokens=props.max_batch_prefill_tokens,
        prefill_stall_steps=props.prefill_stall_steps,
        max_input_length=props.max_input_length,
        max_new_tokens=props.max_new_tokens_limit,
        compile=props.compile is not False, reuse_prefixes=props.enable_prefix_caching,
        model_name=props.model_id or Path(props.model_dir).name))


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


class StreamingService:
    """Loads the model on the init call and answers requests; see the module docstring."""

    def __init__(self, entry_module: str | types.ModuleType | None = None):
        self._entry_module = entry_module
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.props: Optional[ModelProperties] = None
        self.model = None
        self.tokenizer = None
        self.engine: Optional[Engine] = None
        self.formatter: Optional[StreamFormatter] = None

    @property
    def initialized(self) -> bool:
        return self.model is not None

    def handle(self, inputs) -> Any:
        """djl-serving's entry point: initialize on the init call, else answer.

        Called on a running event loop (djl-serving 0.33's async worker does ``await
        handle(inputs)``), it returns the coroutine :meth:`handle_async` instead, so that the
        same ``model.py`` serves both worker modes and the loop is never blocked.
        """
        if _on_event_loop():
            return self.handle_async(inputs)
        if not self.initialized:
            self.initialize(inputs.get_properties())
        if inputs.is_empty():
            return None
        return to_output(self.reply(inputs))

    async def handle_async(self, inputs) -> Any:
        """``handle()`` for djl-serving's async worker: ``None`` for the init call; for a
        request, one ``Output`` or an async generator of them (one per chunk), in the
        protocol that worker's front end reads. Blocking work runs in a thread pool."""
        loop = asyncio.get_running_loop()
        executor = self._async_executor()
        if not self.initialized:
            await loop.run_in_executor(executor, self.initialize, inputs.get_properties())
        if inputs.is_empty():
            return None
        reply = await loop.run_in_executor(executor, self.reply, inputs)
        if isinstance(reply, StreamReply):
            return to_async_outputs(reply, executor)
        return to_async_output(reply)

    def _async_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    ASYNC_MAX_THREADS, thread_name_prefix="djl-stream-async")
            return self._executor

    def initialize(self, properties: dict) -> None:
        with self._lock:
            if self.initialized:
                return
            from djl_stream.runtime.loading import load_model_and_tokenizer

            props = ModelProperties.from_init_properties(properties)
            self.formatter = resolve_formatter(props.output_formatter, self._module())
            engine = create_engine(select_engine(props), props)
            model, tokenizer = engine.model, engine.tokenizer
            if _in_djl_serving():
                # No route can be added there: the scheduler's figures go to djl-serving's
                # model_metric log as [METRICS] lines on the worker's stdout.
                from djl_stream.serving.metrics import start_djl_metric_lines

                start_djl_metric_lines(Path(props.model_dir).name)
            if props.max_request_kv_tokens is None:
                props = dataclasses.replace(props, max_request_kv_tokens=(
                    default_max_request_kv_tokens(model, props.max_input_length,
                                                  props.max_new_tokens_limit)))
                logger.info("a request may hold up to %s KV-cache positions "
                            "(option.max_request_kv_tokens, derived from the weights' size)",
                            props.max_request_kv_tokens)
            self.engine = engine
            self.model, self.tokenizer, self.props = model, tokenizer, props
            try:
                self._warm_up()
            except Exception:
                self.model = None  # the load failed: not initialized, as before it
                engine.shutdown()
                raise
            logger.info("model ready: engine=%s formatter=%s", engine.name, self.formatter)

    def _warm_up(self) -> None:
        """Take a request the way a client's is taken, so that the first client does not
        pay for one-time costs: its parse (the protocols, with the OpenAI and TGI modules
        imported and their pydantic models built, the parse context, the chat template
        compiled by jinja, the longest token's length, which reads the whole vocabulary),
        then one prefill and decode step (kernel selection, allocator growth), and on a GPU
        bursts of requests (:meth:`_warm_up_bursts`). Parsed cold, the first request would
        wait for all of that before its first token. Limits that refuse the request (a tiny
        ``option.max_input_length``, say) leave the first request's parse cold; the steps
        run all the same."""
        try:
            self.parse({"inputs": "Hello"})
        except RequestError as error:
            logger.debug("the warm-up request was refused (%s): the first request parses "
                         "cold", error)
        stream = self.engine.generate(["Hello"], max_new_tokens=2)
        try:
            next(iter(stream), None)
            next(iter(stream), None)
        finally:
            getattr(stream, "close", lambda: None)()
        self.engine.warm_up()

    def _module(self) -> Optional[types.ModuleType]:
        if isinstance(self._entry_module, str):
            return sys.modules.get(self._entry_module)
        return self._entry_module

    # -- requests -------------------------------------------------------------------

    def reply(self, inputs) -> Reply:
        """The answer to one request (never raises for a request's own failure).

        When the server attached a :class:`~djl_stream.serving.cancellation.Cancellation`
        (``djl-stream serve`` does; djl-serving never does), cancelling it stops the
        generation, queued or running: a client that left gets :data:`CLIENT_LEFT`, a
        request the shutting-down server ended gets a 503 before its first chunk, the
        stream's error record after it."""
        query = str(inputs.get_property(PROTOCOL_PROPERTY) or "").strip().lower()
        if query in MODEL_QUERIES:
            return self.answer_query(query, inputs)
        cancellation = cancellation_of(inputs)
        protocol = self.protocols["djl"]
        try:
            # A request that names its protocol (its route) gets even a body that is not
            # JSON refused in that protocol's error shape.
            protocol = self.named_protocol(inputs) or protocol
            body = self.read_body(inputs)
            protocol = self.protocol_for(inputs, body)
            request, prompt_tokens = self.parse(body, protocol)
        except RequestError as error:
            return self._error(protocol, Failure.invalid(error))
        if cancellation is not None and cancellation.client_left:
            return CLIENT_LEFT
        inputs = ([list(ids) for ids in request.prompt_ids] if request.prompt_ids is not None
                  else list(request.prompts))
        try:
            stream = self.engine.generate(inputs, **request.parameters.as_kwargs())
        except QueueFullError as error:
            return self._error(protocol, Failure("busy", str(error)))
        except RequestError as error:
            # an engine's own limits (e.g. a Neuron model's compiled batch size)
            return self._error(protocol, Failure.invalid(error))
        if cancellation is not None:
            stream = CancellableStream(stream, cancellation)
        wants_stream = self.props.enable_streaming if request.stream is None else request.stream
        if wants_stream:
            return self._start_stream(stream, protocol.stream_encoder(request, prompt_tokens),
                                      protocol, cancellation)
        return self._collect(stream, request, prompt_tokens, protocol, cancellation)

    def _start_stream(self, stream, encoder: StreamEncoder, protocol: Protocol,
                      cancellation: Optional[Cancellation] = None) -> Reply:
        """Produce the first chunk now: a generation that fails before it (a prompt the
        model cannot prefill) is answered with an error status instead of a 200 stream
        that carries the error as text."""
        chunks = EncodedStream(stream, encoder)
        try:
            first: Optional[bytes] = next(chunks)
        except StopIteration:
            first = None
        except Exception as error:  # noqa: BLE001 - the client gets it as a status
            _log_failure("generation failed before its first chunk", error)
            return self._error(protocol, _failure_of(error))
        if cancellation is not None and cancellation.client_left:
            chunks.close()
            return CLIENT_LEFT
        return StreamReply(first, chunks, encoder.content_type, encoder.error)

    def _collect(self, stream, request: GenerationRequest, prompt_tokens: List[int],
                 protocol: Protocol, cancellation: Optional[Cancellation] = None) -> Reply:
        try:
            steps = [step if isinstance(step, Step) else Step(step) for step in stream]
        except Exception as error:  # noqa: BLE001 - the client gets it as a status
            _log_failure("generation failed", error)
            return self._error(protocol, _failure_of(error))
        finally:
            getattr(stream, "close", lambda: None)()
        if cancellation is not None and cancellation.client_left:
            # The steps stop wherever the client left: there is no answer to write.
            return CLIENT_LEFT
        return JsonReply(protocol.complete(request, steps, prompt_tokens))

    def answer_query(self, query: str, inputs) -> Reply:
        """A question about the model (:mod:`~djl_stream.protocols.model_queries`): a
        tokenization, a detokenization, or TGI's ``/info``. Errors come in the shape of the
        client that asks (TGI's for a TGI-shaped ``/tokenize``, else OpenAI's, as vLLM)."""
        if query == INFO:
            return JsonReply(self.info())
        protocol = self.protocols["openai-completions"]
        try:
            body = self.read_body(inputs)
            if query == TOKENIZE:
                if query_kind(body) == "tgi":
                    protocol = self.protocols["tgi"]
                render = self.render_chat if self.has_chat_template else None
                context = getattr(self.model.config, "max_position_embeddings", None)
                return JsonReply(tokenize(body, self.tokenizer, render, context))
            assert query == DETOKENIZE
            return JsonReply(detokenize(body, self.tokenizer))
        except RequestError as error:
            return self._error(protocol, Failure.invalid(error))

    def info(self) -> Dict[str, Any]:
        """TGI's ``GET /info``: the served model and the server's limits.

        ``max_input_tokens`` is ``option.max_input_length``; ``max_total_tokens`` what one
        sequence may reach (its prompt plus ``option.max_new_tokens_limit``, within the
        model's context); ``max_client_batch_size`` the prompts one request may carry.
        """
        from djl_stream import __version__

        props = self.props
        context = getattr(self.model.config, "max_position_embeddings", None)
        total = props.max_input_length + props.max_new_tokens_limit
        parameters = getattr(self.model, "parameters", None)  # (a Neuron model has none)
        parameter = next(parameters(), None) if callable(parameters) else None
        return {
            "model_id": self.model_name, "model_sha": None,
            "model_dtype": str(parameter.dtype).removeprefix("torch.") if parameter is not None else None,
            "model_device_type": parameter.device.type if parameter is not None else None,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": props.max_rolling_batch_size + props.job_queue_size,
            "max_best_of": 1, "max_stop_sequences": None,
            "max_input_tokens": props.max_input_length,
            "max_total_tokens": min(total, context) if context else total,
            "max_client_batch_size": props.max_rolling_batch_size,
            "validation_workers": 1, "router": "djl-stream", "version": __version__,
            "sha": None, "docker_label": None,
        }

    @staticmethod
    def _error(protocol: Protocol, failure: Failure) -> ErrorReply:
        answer = protocol.error(failure)
        return ErrorReply(answer.code, answer.body, answer.message, failure.message)

    # -- protocols --

    def protocol_for(self, inputs, body: Any) -> Protocol:
        """The protocol of a request: the one its ``djl_stream_protocol`` property names
        (``djl-stream serve`` sets it from the route), else the first of
        :data:`PROTOCOLS_BY_BODY` whose key the body sets and that this model serves, else
        djl-serving's."""
        named = self.named_protocol(inputs)
        if named is not None:
            return named
        if isinstance(body, dict):
            for key, candidate in PROTOCOLS_BY_BODY:
                if candidate == "openai-chat" and self.props.chat_protocol == "djl":
                    continue
                if body.get(key) is not None and candidate in self.protocols:
                    return self.protocols[candidate]
        return self.protocols["djl"]

    def named_protocol(self, inputs) -> Optional[Protocol]:
        """The protocol the request's ``djl_stream_protocol`` property names, if any."""
        name = inputs.get_property(PROTOCOL_PROPERTY)
        if not name:
            return None
        name = str(name).strip().lower()
        if name not in self.protocols:
            raise RequestError(PROTOCOL_PROPERTY, f"{PROTOCOL_PROPERTY} must be one of "
                               f"{', '.join(sorted(self.protocols))}, got {name!r}")
        return self.protocols[name]

    @functools.cached_property
    def protocols(self) -> Dict[str, Protocol]:
        """Every protocol this model answers, by name (built once, after loading)."""
        protocols: Dict[str, Protocol] = {"djl": djl_protocol(self)}
        for name, factory in PROTOCOLS.items():
            module, _, attribute = factory.partition(":")
            protocols[name] = getattr(importlib.import_module(module), attribute)(self)
        return protocols

    @functools.cached_property
    def parse_context(self) -> ParseContext:
        props = self.props
        return ParseContext(
            default_max_new_tokens=props.default_max_new_tokens,
            max_new_tokens_limit=props.max_new_tokens_limit,
            max_batch_size=props.max_rolling_batch_size,
            model_name=self.model_name,
            render_chat=self.render_chat if self.has_chat_template else None,
            renders_tools=self._template_renders_tools,
            takes_system=self._template_takes_system,
            wrap_prompts_in_chat=self.wraps_inputs_in_chat_template,
            check_grammar=self._grammars.check if self._grammars is not None else None,
        )

    @functools.cached_property
    def _grammars(self) -> Optional[Any]:
        """The model's :class:`~djl_stream.generation.grammar.Grammars`, where the engine
        follows grammars (to check a request's before it is queued)."""
        if not self.engine.capabilities.grammars:
            return None
        from djl_stream.generation.engines.accelerate import logits_width, eos_token_ids
        from djl_stream.generation.grammar import Grammars, GrammarsUnavailable

        if importlib.util.find_spec("llguidance") is None:
            return GrammarsUnavailable()

        return Grammars(self.tokenizer, eos_token_ids(self.model, self.tokenizer),
                        logits_width(self.model))

    @property
    def model_name(self) -> str:
        """What the model is called in answers that name it (OpenAI's ``model``):
        ``option.model_id``, else the model directory's name."""
        return self.props.model_id or Path(self.props.model_dir).name

    def read_body(self, inputs) -> Any:
        """The request's decoded JSON body; raises :class:`RequestError`."""
        if is_dynamic_batch(inputs):
            # djl-serving's dynamic batching (batch_size > 1) merges requests into one
            # Input; the real engine refuses it with streaming, and continuous batching
            # already shares decode steps between concurrent requests.
            raise RequestError(
                "batch_size",
                "dynamic batching (batch_size > 1 in serving.properties) is not supported: "
                "djl-stream batches concurrent requests continuously; remove batch_size",
            )
        return parse_json_body(inputs.get_as_bytes("data") if inputs.contains_key("data")
                               else inputs.get_as_bytes())

    def parse(self, body: Any, protocol: Optional[Protocol] = None
              ) -> Tuple[GenerationRequest, List[int]]:
        """``body`` validated by ``protocol`` (djl-serving's by default), and each prompt's
        length in tokens, with chat templates applied and lengths checked (in characters
        first, so that a prompt far too long is refused without tokenizing it); raises
        :class:`RequestError`."""
        protocol = protocol or self.protocols["djl"]
        request = protocol.parse(body, self.parse_context)
        vocabulary = getattr(self.model.config, "vocab_size", None) or len(self.tokenizer)
        for token, _ in request.parameters.logit_bias:
            if token >= vocabulary:
                raise RequestError("logit_bias", f"logit_bias names token {token}; the model's "
                                                 f"ids go from 0 to {vocabulary - 1}")
        if len(request.prompts) > self.props.max_rolling_batch_size:
            field = protocol.prompt_field(request, 0).split("[")[0]
            raise RequestError(
                field,
                f"{field} has {len(request.prompts)} prompts; the limit "
                f"(option.max_rolling_batch_size) is {self.props.max_rolling_batch_size}",
            )
        context = getattr(self.model.config, "max_position_embeddings", None)
        if request.prompt_ids is not None:
            lengths = self._check_token_prompts(request, protocol, vocabulary)
        else:
            for i, prompt in enumerate(request.prompts):
                check_input_characters(protocol.prompt_field(request, i), len(prompt),
                                       self.props.max_input_length, self.characters_per_token)
            lengths = [len(ids) for ids in self.tokenizer(list(request.prompts))["input_ids"]]
        for i, n in enumerate(lengths):
            check_input_length(protocol.prompt_field(request, i), n, self.props.max_input_length)
        # Before any model work: together, a request's prompts may not bring more than
        # the limit (one request's prefill and KV cache stay bounded).
        check_request_input_length(protocol.prompt_field(request, 0).split("[")[0], lengths,
                                   self.props.max_request_input_length)
        # ... nor may its KV cache outgrow its bound by the last step (one request's memory
        # stays bounded however many prompts and new tokens it asks for).
        check_request_kv_positions(protocol.max_new_tokens_field(request), lengths,
                                   request.parameters.max_new_tokens,
                                   self.props.max_request_kv_tokens)
        for i, n in enumerate(lengths):
            name = protocol.prompt_field(request, i)
            wanted = n + request.parameters.max_new_tokens
            if context and wanted > context:
                field = protocol.max_new_tokens_field(request)
                raise RequestError(
                    field,
                    f"{name} ({n} tokens) + {field} "
                    f"({request.parameters.max_new_tokens}) is {wanted} tokens; the model's "
                    f"context (max_position_embeddings) is {context}",
                )
        return request, lengths

    def _check_token_prompts(self, request: GenerationRequest, protocol: Protocol,
                             vocabulary: int) -> List[int]:
        """The lengths of prompts given as token ids, once each id is one of the model's."""
        if not self.engine.capabilities.token_prompts:
            raise RequestError(protocol.prompt_field(request, 0).split("[")[0],
                               f"the {self.engine.name} engine takes prompts as text only")
        for i, ids in enumerate(request.prompt_ids or ()):
            for token in ids:
                if token >= vocabulary:
                    field = protocol.prompt_field(request, i)
                    raise RequestError(field, f"{field} holds token {token}; the model's ids "
                                              f"go from 0 to {vocabulary - 1}")
        return [len(ids) for ids in request.prompt_ids or ()]

    @functools.cached_property
    def characters_per_token(self) -> int:
        """:func:`most_characters_per_token` of the model's tokenizer (asked once, after
        loading: it reads the whole vocabulary)."""
        return most_characters_per_token(self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def wraps_inputs_in_chat_template(self) -> bool:
        choice = self.props.apply_chat_template
        return self.has_chat_template if choice is None else choice

    def render_chat(self, messages: List[dict], tools: Optional[List[dict]] = None) -> str:
        """The prompt text for ``messages``, ending with the assistant's turn opening;
        ``tools`` (OpenAI's function specs) go to the template as transformers' ``tools=``.

        A template that writes the BOS token itself would get a second one when the prompt
        is tokenized, so a leading BOS is dropped here."""
        if not self.has_chat_template:
            raise RequestError("messages", "the model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos and text.startswith(bos) and self._tokenizer_adds_bos:
            text = text[len(bos):]
        return text

    @functools.cached_property
    def _template_renders_tools(self) -> bool:
        """Whether the chat template used with tools (a ``tool_use`` one, where the
        tokenizer has several) shows them to the model."""
        if not self.has_chat_template:
            return False
        try:
            return template_renders_tools(self.tokenizer.get_chat_template(tools=[]))
        except ValueError:  # several templates and none for tools or by default
            return False

    @functools.cached_property
    def _template_takes_system(self) -> bool:
        """Whether the chat template renders a system turn (Gemma's raise on one)."""
        if not self.has_chat_template:
            return False
        try:
            self.render_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        except Exception:  # noqa: BLE001 - a template's own refusal, whatever it raises
            return False
        return True

    @functools.cached_property
    def _tokenizer_adds_bos(self) -> bool:
        """Whether tokenizing a prompt adds BOS; asked once (only after loading)."""
        ids = self.tokenizer("a")["input_ids"]
        return bool(ids) and ids[0] == getattr(self.tokenizer, "bos_token_id", None)


def _on_event_loop() -> bool:
    """Whether this thread is running an asyncio event loop (the caller is a coroutine)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _failure_of(error: BaseException) -> Failure:
    """A generation that raised, as djl-serving's worker classes a handler exception:
    out of memory (507), or a failure (424); and one the shutting-down server ended,
    which another replica can take (503)."""
    text = str(error) or type(error).__name__
    if isinstance(error, ShuttingDown):
        return Failure("busy", text)
    return Failure("out_of_memory" if is_out_of_memory(error) else "failed", text)


def _log_failure(what: str, error: BaseException) -> None:
    if isinstance(error, ShuttingDown):
        # expected at the end of a shutdown's grace period, not a bug to trace back
        logger.info("%s: %s", what, error)
    else:
        logger.error(what, exc_info=error)


def _in_djl_serving() -> bool:
    """Whether djl-serving's own worker runs this handler (its djl_python is importable)."""
    from djl_stream.serving import compat

    return bool(compat.USING_DJL_PYTHON)
