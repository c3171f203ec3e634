"""The local server: djl-serving's HTTP contract in front of one :class:`ModelWorker`.

Routes, as djl-serving (and SageMaker) expose them:

- ``GET /ping``: 200 ``{"status": "Healthy"}`` once the model is loaded, 503 with the
  reason while it loads or after the load failed;
- ``POST /invocations`` and ``POST /predictions/{model_name}``: one request to ``handle()``;
- ``POST /endpoints/{name}/invocations`` and ``.../invocations-response-stream``: the same,
  answered as SageMaker's runtime API answers boto3 (:mod:`~djl_stream.serving.sagemaker_runtime`);
- ``GET /models``: the management list, ``{"models": [{"modelName", "modelUrl", "status"}]}``;
- ``GET /metrics``: Prometheus metrics (:mod:`djl_stream.serving.metrics`), djl-stream's own;
- ``GET /v1/models`` and ``GET /v1/models/{id}``: OpenAI's model list and model, beside the
  OpenAI routes of :data:`PROTOCOL_ROUTES`; any other ``/v1/`` path is a 404 in OpenAI's shape;
- ``GET /health`` and ``GET /info`` (TGI's), ``GET /version``, ``POST /tokenize`` and
  ``POST /detokenize`` (:mod:`~djl_stream.protocols.model_queries`, through ``handle()``);
- ``GET /openapi.json`` and ``GET /docs`` (:mod:`~djl_stream.serving.api_docs`);
- ``WS /ws/chat`` (:mod:`~djl_stream.serving.chat_socket`) and its page, ``GET /chat`` and
  ``GET /`` (:mod:`~djl_stream.serving.chat_page`): djl-stream's own, not djl-serving's.

The server starts answering at once and loads the model in a background thread. Each
request's ``handle()`` runs in a worker thread, concurrently (djl-serving's synchronous
worker runs one at a time), so that concurrent streams share the model's decode steps.
Everything a client sees is what djl-serving's front end sends for the same ``Output``
(``make conformance`` compares the two): the response head is held until the first item
exists, then every item is its own HTTP chunk, flushed as soon as it is formatted; an
iterator that raises adds the exception's text, raw, as the last chunk (djl-stream's own
handler never does: it ends a failed stream with an error record in the stream's format).
Unlike djl-serving, a client that goes away stops generation: before its answer is ready
(queued, or a non-streaming request) its :class:`~djl_stream.serving.cancellation.
Cancellation` is cancelled, mid-stream the iterator is closed as well. On SIGTERM the
server shuts down gracefully (:class:`GracefulServer`). Framework errors are JSON
``{"code", "type", "message"}``.

Example::

    $ djl-stream serve model/ --port 8080
    $ curl -N localhost:8080/invocations -H 'content-type: application/json' \\
          -d '{"inputs": "Hello", "stream": true}'
    {"output_tokens": ["Hello"]}
    {"output_tokens": ["!"]}
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, AsyncIterator, Callable, Mapping, Optional

import anyio
import anyio.to_thread
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from djl_stream.protocols.model_queries import DETOKENIZE, INFO, TOKENIZE
from djl_stream.protocols.openai.responses import error_body
from djl_stream.protocols.protocol import PROTOCOL_PROPERTY
from djl_stream.serving.access import AccessControl, RequireApiKey, warn_if_exposed
from djl_stream.serving.admission import DEFAULT_SHUTDOWN_GRACE, SHUTTING_DOWN, Admission
from djl_stream.serving.cancellation import Cancellation, attach_cancellation
from djl_stream.serving.api_docs import api_docs_page, openapi_document
from djl_stream.serving.chat_page import CHAT_PAGE_PATHS, chat_page
from djl_stream.serving.chat_socket import ChatSocket
from djl_stream.serving.http_errors import error_response
from djl_stream.serving.http_limits import HttpLimits, RequestConcurrency, RequestLimits
from djl_stream.serving.metrics import PrometheusMetrics, record_request, server_metrics
from djl_stream.serving.sagemaker_runtime import AsSageMaker
from djl_stream.serving.stream_pump import FINISHED, PumpFailure, StreamPump
from djl_stream.serving.worker import (
    READY,
    ModelWorker,
    next_stream_chunk,
    output_body,
    stream_failure_chunk,
)

logger = logging.getLogger(__name__)

#: Threads for ``handle()`` and the stream iterators' ``next()``: every open stream may
#: hold one while it waits for its next token, so this bounds concurrent streams.
DEFAULT_MAX_THREADS = 128
#: Routes of other clients' protocols, and the protocol each names to the handler.
PROTOCOL_ROUTES = {
    "/v1/chat/completions": "openai-chat",
    "/v1/completions": "openai-completions",
    "/generate": "tgi-generate",
    "/generate_stream": "tgi-generate-stream",
    # TGI's compatibility route, where huggingface_hub's InferenceClient(base_url=...) posts
    "/": "tgi",
}
#: Where the access-log middleware and a stream share what happened to a request.
_LOG_KEY = "djl_stream.log"
#: The status logged and counted for a request whose client left before its answer was
#: ready (nothing is sent): nginx's "client closed request".
CLIENT_CLOSED_REQUEST = 499
#: Seconds uvicorn still waits for open connections once the graceful shutdown is over
#: (every request ended), for a handler that ignores its cancellation.
SHUTDOWN_BACKSTOP = 5
#: Response headers the server computes itself; a handler's value would corrupt framing.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})


def output_headers(output: Any) -> list[tuple[bytes, bytes]]:
    """``Output.properties`` as raw response headers.

    Framing headers are the server's business and dropped; a value that HTTP cannot carry
    (outside Latin-1) is dropped with a warning rather than failing the response.
    """
    headers: list[tuple[bytes, bytes]] = []
    for name, value in (getattr(output, "properties", None) or {}).items():
        name = str(name).lower()
        if name in _FRAMING_HEADERS:
            continue
        try:
            headers.append((name.encode("latin-1"), str(value).encode("latin-1")))
        except UnicodeEncodeError:
            logger.warning("dropping response header %s: value is not Latin-1", name)
    return headers


def _stream_headers(output: Any) -> list[tuple[bytes, bytes]]:
    headers = output_headers(output)
    if not any(name == b"content-type" for name, _ in headers):
        # A StreamFormatter knows what it writes (jsonlines or text/event-stream).
        content_type = getattr(output.stream_output_formatter, "content_type", None)
        if content_type:
            headers.append((b"content-type", content_type.encode("latin-1")))
    return headers


@dataclasses.dataclass
class _StreamState:
    items: int = 0
    exhausted: bool = False  # the iterator raised StopIteration: nothing to close
    finishing: bool = False  # the last message is being sent: a disconnect now is normal
    disconnected: bool = False


class StreamingOutputResponse:
    """ASGI response for an ``Output`` whose ``stream_content`` is set.

    ``next()`` is called in one thread of ``limiter`` for the stream's life
    (:class:`~djl_stream.serving.stream_pump.StreamPump`) and each formatted item is sent as
    an HTTP chunk as soon as it exists; items that piled up while the event loop was busy
    with other streams go out together, as one chunk. A task listens for
    ``http.disconnect`` meanwhile; when the client leaves, pulling stops and the
    iterator's ``close()`` is called — after any ``next()`` in flight has returned, never
    at the same time. ``close()`` is likewise called when the iterator failed; only an
    iterator that ran to its end is left alone. A ``cancellation``
    is cancelled as soon as the client leaves, so that a handler that registered on it
    stops generating without waiting for the ``next()`` in flight.
    """

    def __init__(self, output: Any, limiter: Optional[anyio.CapacityLimiter] = None,
                 cancellation: Optional[Cancellation] = None) -> None:
        self.output = output
        self.limiter = limiter
        self.cancellation = cancellation
        self.state = _StreamState()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch_disconnect, receive, tasks.cancel_scope)
                try:
                    await self._send_stream(send)
                finally:
                    tasks.cancel_scope.cancel()  # the watcher is no longer needed
        finally:
            if not state.exhausted:
                # Shielded: the disconnect cancelled this task, but the generation behind
                # the iterator must still be told to stop.
                with anyio.CancelScope(shield=True):
                    await self._close()
            log = scope.get(_LOG_KEY)
            if log is not None:
                log.update(items=state.items, disconnected=state.disconnected)

    async def _watch_disconnect(self, receive: Receive, stream_scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # uvicorn also reports a disconnect once the response is complete.
                if not self.state.finishing:
                    self.state.disconnected = True
                    logger.info("client disconnected; stopping the stream after %d items",
                                self.state.items)
                    if self.cancellation is not None:
                        await anyio.to_thread.run_sync(self.cancellation.cancel)
                    stream_scope.cancel()
                return

    async def _send_stream(self, send: Send) -> None:
        # One thread pulls the iterator for the stream's life (StreamPump); stopped here
        # however the sending ends, and waited for by the task group, so that close()
        # (in __call__) never runs beside a next().
        pump = StreamPump(lambda: next_stream_chunk(self.output))
        async with anyio.create_task_group() as pumping:
            pumping.start_soon(pump.run, self.limiter)
            try:
                await self._send_pumped(pump, send)
            finally:
                pump.stop()

    async def _send_pumped(self, pump: StreamPump, send: Send) -> None:
        state = self.state
        head = {"type": "http.response.start", "status": int(self.output.code),
                "headers": _stream_headers(self.output)}
        chunks, end = await pump.take()
        if not chunks and isinstance(end, PumpFailure):
            # djl-serving holds the head until the first chunk; a failure instead of it
            # arrives as one last chunk holding the exception's text, which its front end
            # sends as a plain 200 answer with that text as the body.
            logger.error("the stream failed before its first item", exc_info=end.error)
            state.finishing = True
            await send(head)
            await send({"type": "http.response.body", "body": stream_failure_chunk(end.error)})
            return
        await send(head)
        while True:
            state.items += len(chunks)
            # Items that piled up while the loop was busy go out as one chunk.
            body = b"".join(chunks)
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            if end is FINISHED:
                state.exhausted = True
                break
            if isinstance(end, PumpFailure):
                # The status line is gone; djl-serving appends the exception's text, raw.
                logger.error("the stream failed after %d items", state.items,
                             exc_info=end.error)
                state.finishing = True
                await send({"type": "http.response.body",
                            "body": stream_failure_chunk(end.error), "more_body": True})
                break
            chunks, end = await pump.take()
        state.finishing = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _close(self) -> None:
        close = getattr(self.output.stream_content, "close", None)
        if close is None:
            return
        try:
            await anyio.to_thread.run_sync(close, limiter=self.limiter)
        except Exception:
            logger.exception("closing the stream iterator failed")


async def _cancel_when_client_leaves(receive: Receive, cancellation: Cancellation) -> None:
    """Wait for ``http.disconnect`` (the request's body is already read) and cancel."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            logger.info("client disconnected before its answer was ready; cancelling it")
            # In a thread: the handler's callbacks close its engine's stream.
            await anyio.to_thread.run_sync(cancellation.cancel)
            return


class ClientGoneResponse:
    """The answer to a client that left before it was ready: nothing is sent. The access
    log and the metrics count it with status :data:`CLIENT_CLOSED_REQUEST`."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log = scope.get(_LOG_KEY)
        if log is not None:
            log.update(status=CLIENT_CLOSED_REQUEST, disconnected=True)


class ReleasedWhenSent:
    """An ASGI response that calls ``release`` once ``response`` has been sent (or has
    failed, or its client left): how a request leaves the :class:`Admission`."""

    def __init__(self, response: ASGIApp, release: Callable[[], None]) -> None:
        self.response = response
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()


def shutting_down_response(path: str = "") -> JSONResponse:
    """503 for a request that arrives during a graceful shutdown, on a connection that
    then closes, so that a client's pool opens its next one to another replica.

    >>> shutting_down_response().body
    b'{"code":503,"type":"ServiceUnavailableException","message":"the server is shutting down"}'
    """
    response = error_response(503, SHUTTING_DOWN, path=path)
    response.headers["connection"] = "close"
    return response


def route_template(scope: Scope) -> str:
    """The path template of the app's route that takes this request (``/predictions/
    {model_name}``, not the model's name: a metric label must not grow with every URL),
    one that takes its path with another method, else ``"unmatched"``."""
    partial = None
    for route in getattr(scope.get("app"), "routes", ()):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.path
        if match == Match.PARTIAL and partial is None:
            partial = route.path
    return partial or "unmatched"


class AccessLog:
    """ASGI middleware: one log line per request with status, timing and size.

    For streams it adds the time to the first chunk, the number of items, and whether the
    client left early; for a generation, the scheduler's figures (queue, ttft, itl, e2e,
    prompt and generated tokens: :class:`~djl_stream.serving.metrics.RequestRecord`). With
    ``metrics``, each request is counted there by route and status.

    A client that leaves while sending its body is what clients do, not a server error: its
    line has status 499 (nginx's "client closed request") and ``client-disconnected``, and
    nothing else is logged for it.
    """

    def __init__(self, app: ASGIApp, metrics: Optional[PrometheusMetrics] = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        seen: dict[str, Any] = {"status": None, "first": None, "bytes": 0}
        scope[_LOG_KEY] = log = {}

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and message.get("body"):
                if seen["first"] is None:
                    seen["first"] = time.perf_counter() - start
                seen["bytes"] += len(message["body"])
            await send(message)

        with record_request() as record:
            try:
                await self.app(scope, receive, logged_send)
            except ClientDisconnect:
                if seen["status"] is not None:
                    raise
                log.update(status=CLIENT_CLOSED_REQUEST, disconnected=True)
            finally:
                status = seen["status"] or log.get("status") or 500
                parts = [scope["method"], scope["path"], str(status),
                         f"{time.perf_counter() - start:.3f}s", f"{seen['bytes']}B"]
                if "items" in log:
                    first = seen["first"]
                    parts += [f"items={log['items']}",
                              f"first_chunk={first:.3f}s" if first is not None else "first_chunk=-"]
                if log.get("disconnected"):
                    parts.append("client-disconnected")
                parts += record.log_fields()
                logger.info(" ".join(parts))
                if self.metrics is not None:
                    self.metrics.http_request(route_template(scope), status)


class TrailingSlash:
    """ASGI middleware: a path with a trailing slash names the route without it
    (``POST /predictions/model/``), as djl-serving's front end reads paths.

    Starlette would answer it with a redirect built from the request's ``Host`` header,
    which a client controls: an open redirect to anywhere.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
        await self.app(scope, receive, send)


class ModelServer:
    """The routes of one served model; :func:`create_app` wraps them in a Starlette app.

    >>> server = ModelServer(ModelWorker("model/"))
    >>> sorted({route.path for route in server.routes()})[:4]
    ['/', '/chat', '/detokenize', '/docs']
    """

    def __init__(self, worker: ModelWorker, max_threads: int = DEFAULT_MAX_THREADS,
                 metrics: Optional[PrometheusMetrics] = None,
                 admission: Optional[Admission] = None) -> None:
        self.worker = worker
        self.max_threads = max_threads
        self.metrics = metrics or server_metrics()
        self.admission = admission or Admission()
        self.started = int(time.time())
        self.limiter: Optional[anyio.CapacityLimiter] = None

    def routes(self) -> list[Route]:
        return [
            Route("/ping", self.ping, methods=["GET"]),
            Route("/invocations", self.invocations, methods=["POST"]),
            Route("/predictions/{model_name}", self.predictions, methods=["POST"]),
            # SageMaker's runtime API (boto3's endpoint_url pointed here): any endpoint name.
            Route("/endpoints/{endpoint_name}/invocations", self.sagemaker_invocations,
                  methods=["POST"]),
            Route("/endpoints/{endpoint_name}/invocations-response-stream",
                  self.sagemaker_invocations_stream, methods=["POST"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/metrics", self.prometheus_metrics, methods=["GET"]),
            Route("/v1/models", self.openai_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.openai_model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/info", self._protocol_route(INFO), methods=["GET"]),
            Route("/tokenize", self._protocol_route(TOKENIZE), methods=["POST"]),
            Route("/detokenize", self._protocol_route(DETOKENIZE), methods=["POST"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/docs", api_docs_page, methods=["GET"]),
            WebSocketRoute("/ws/chat", ChatSocket(self).serve),
            *(Route(path, chat_page, methods=["GET"]) for path in CHAT_PAGE_PATHS),
            # Other clients' protocols, answered by the same handle(): the route names the
            # protocol to the handler (PROTOCOL_PROPERTY), as the body's shape would.
            *(Route(path, self._protocol_route(name), methods=["POST"])
              for path, name in PROTOCOL_ROUTES.items()),
            # Last: any other path under /v1 is an OpenAI client asking for what this server
            # does not serve (embeddings, images...), told so in OpenAI's error shape.
            Route("/v1/{path:path}", self.openai_unknown_route,
                  methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        ]

    def _protocol_route(self, protocol: str):
        async def endpoint(request: Request) -> Response | StreamingOutputResponse:
            return await self._predict(request, protocol)
        return endpoint

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.limiter = anyio.CapacityLimiter(self.max_threads)
        # Starlette's own thread work (sync endpoints, file responses) shares the default.
        default = anyio.to_thread.current_default_thread_limiter()
        default.total_tokens = max(default.total_tokens, self.max_threads)
        # Daemon: an interrupted start-up must not wait for a model half loaded.
        threading.Thread(target=self.worker.load, name="model-load", daemon=True).start()
        yield

    async def ping(self, request: Request) -> Response:
        worker = self.worker
        if worker.status == READY and self.admission.open:
            return JSONResponse({"status": "Healthy"})
        message = worker.not_ready_message() if self.admission.open else SHUTTING_DOWN
        return JSONResponse({"status": "Unhealthy", "model": worker.model_name,
                             "modelStatus": worker.status, "message": message},
                            status_code=503)

    async def models(self, request: Request) -> Response:
        worker = self.worker
        # The directory's name only: its absolute path tells a client about the host.
        return JSONResponse({"models": [{"modelName": worker.model_name,
                                         "modelUrl": worker.model_dir.name,
                                         "status": worker.status}]})

    async def openai_models(self, request: Request) -> Response:
        """OpenAI's model list, for clients that look the model up before asking. The id is
        the ``model`` answers carry: ``option.model_id``, else the directory's name."""
        return JSONResponse({"object": "list", "data": [
            {"id": self._openai_model_id(), "object": "model", "created": self.started,
             "owned_by": "djl-stream"}]})

    def _openai_model_id(self) -> str:
        worker = self.worker
        return worker.properties.get("model_id") or worker.model_dir.name

    async def openai_model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{id}`` (``client.models.retrieve``)."""
        model_id = request.path_params["model_id"]
        if model_id != self._openai_model_id():
            return JSONResponse(error_body(
                f"The model '{model_id}' does not exist; this server serves "
                f"'{self._openai_model_id()}'", "invalid_request_error", "model",
                "model_not_found"), status_code=404)
        return JSONResponse({"id": model_id, "object": "model", "created": self.started,
                             "owned_by": "djl-stream"})

    async def openai_unknown_route(self, request: Request) -> Response:
        for route in self.routes()[:-1]:
            match, _ = route.matches(request.scope)
            if match == Match.PARTIAL:  # a route of ours, with another method
                return error_response(405, "Method Not Allowed", path=request.url.path)
        return JSONResponse(error_body(
            f"Invalid URL ({request.method} {request.url.path}): djl-stream serves "
            "/v1/chat/completions, /v1/completions and /v1/models", "invalid_request_error"),
            status_code=404)

    async def health(self, request: Request) -> Response:
        """TGI's ``GET /health``: 200 and no body when the model can answer, else 503 with
        TGI's error record."""
        worker = self.worker
        if worker.status == READY and self.admission.open:
            return Response(status_code=200)
        message = worker.not_ready_message() if self.admission.open else SHUTTING_DOWN
        return JSONResponse({"error": message, "error_type": "healthcheck"}, status_code=503)

    async def version(self, request: Request) -> Response:
        from djl_stream import __version__

        return JSONResponse({"version": __version__})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document(self.routes()))

    async def prometheus_metrics(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    async def invocations(self, request: Request) -> Response | StreamingOutputResponse:
        return await self._predict(request)

    async def sagemaker_invocations(self, request: Request) -> ASGIApp:
        """SageMaker's ``InvokeEndpoint``: ``/invocations``, errors as ``ModelError``."""
        return AsSageMaker(await self._predict(request), stream=False)

    async def sagemaker_invocations_stream(self, request: Request) -> ASGIApp:
        """SageMaker's ``InvokeEndpointWithResponseStream``: each chunk a ``PayloadPart``."""
        return AsSageMaker(await self._predict(request), stream=True)

    async def predictions(self, request: Request) -> Response | StreamingOutputResponse:
        name = request.path_params["model_name"]
        if name != self.worker.model_name:
            return error_response(404, f"Model not found: {name}", "ModelNotFoundException")
        return await self._predict(request)

    async def _predict(self, request: Request, protocol: Optional[str] = None) -> ASGIApp:
        worker = self.worker
        if worker.status != READY:
            return error_response(503, worker.not_ready_message(), path=request.url.path)
        cancellation = self.admission.admit()
        if cancellation is None:
            return shutting_down_response(request.url.path)
        try:
            response = await self._answer(request, protocol, cancellation)
        except BaseException:
            self.admission.release(cancellation)
            raise
        return ReleasedWhenSent(response, lambda: self.admission.release(cancellation))

    async def _answer(self, request: Request, protocol: Optional[str],
                      cancellation: Cancellation) -> ASGIApp:
        worker = self.worker
        body = await request.body()
        inp = worker.make_input(body, request.headers, request.query_params)
        if protocol is not None:
            inp.properties[PROTOCOL_PROPERTY] = protocol
        attach_cancellation(inp, cancellation)
        async with anyio.create_task_group() as tasks:
            # Queued for room in the batch, or generating a whole answer: a client that
            # leaves meanwhile must stop that work, not only a stream's.
            tasks.start_soon(_cancel_when_client_leaves, request.receive, cancellation)
            try:
                output = await anyio.to_thread.run_sync(worker.invoke, inp,
                                                        limiter=self.limiter)
            finally:
                tasks.cancel_scope.cancel()
        if cancellation.client_left:
            await self._discard(output)
            return ClientGoneResponse()
        if getattr(output, "stream_content", None) is not None:
            return StreamingOutputResponse(output, self.limiter, cancellation)
        response = Response(output_body(output), status_code=int(output.code))
        # Replace Starlette's defaults wholesale, keeping only the computed content-length.
        response.raw_headers = [h for h in response.raw_headers if h[0] == b"content-length"]
        response.raw_headers += output_headers(output)
        return response

    async def _discard(self, output: Any) -> None:
        """Close the stream of an answer nobody will read (a handler that ignored the
        cancellation may still have returned one)."""
        close = getattr(getattr(output, "stream_content", None), "close", None)
        if close is not None:
            try:
                await anyio.to_thread.run_sync(close, limiter=self.limiter)
            except Exception:
                logger.exception("closing the stream of a client that left failed")


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    message = error.detail
    if error.status_code == 404:
        message = "Requested resource is not found, please refer to API document."
    return error_response(error.status_code, message, path=request.url.path)


async def _internal_error(request: Request, error: Exception) -> Response:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    # The exception's text can hold paths and settings: the log has it, the client a type.
    # Starlette re-raises the error after this answer and uvicorn then closes the
    # connection: say so, or a client reuses it and its next request is reset.
    return error_response(500, f"internal server error ({type(error).__name__}); "
                               "the server log has the details", headers={"connection": "close"},
                          path=request.url.path)


def create_app(model_dir: str | Path, environ: Optional[Mapping[str, str]] = None, *,
               max_threads: int = DEFAULT_MAX_THREADS,
               limits: HttpLimits = HttpLimits(), worker: Any = None,
               access: AccessControl = AccessControl()) -> Starlette:
    """The ASGI app serving ``model_dir``; loading starts when the app starts.

    ``environ`` supplies ``OPTION_*`` variables (default ``os.environ``); ``max_threads``
    bounds concurrent ``handle()`` calls and open streams; ``limits`` bounds request bodies
    and requests in progress (the rest of :class:`HttpLimits` is the protocol's,
    :func:`serve`). ``worker`` replaces the in-process :class:`ModelWorker` with anything
    that answers the same calls (``load``, ``status``, ``make_input``, ``invoke``...): the
    Ray Serve front's, whose ``handle()`` runs in other processes. ``access`` is the API key
    and the origins allowed by CORS (:mod:`~djl_stream.serving.access`). ``app.state.worker`` is
    the worker, ``app.state.admission`` the :class:`Admission` that a graceful shutdown
    drains.

    >>> app = create_app("model/")
    >>> app.state.worker.status
    'LOADING'
    """
    server = ModelServer(worker or ModelWorker(model_dir, environ), max_threads)
    app = Starlette(
        routes=server.routes(),
        lifespan=server.lifespan,
        middleware=[Middleware(AccessLog, metrics=server.metrics),
                    # Before the key: a browser sends its preflight without credentials.
                    *([Middleware(CORSMiddleware, allow_origins=list(access.allowed_origins),
                                  allow_methods=["GET", "POST", "OPTIONS"],
                                  allow_headers=["*"], expose_headers=["x-request-id"])]
                      if access.allowed_origins else []),
                    Middleware(RequestConcurrency, limits=limits),
                    Middleware(RequestLimits, limits=limits),
                    Middleware(TrailingSlash),
                    Middleware(RequireApiKey, access=access)],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.router.redirect_slashes = False  # see TrailingSlash
    app.state.worker = server.worker
    app.state.admission = server.admission
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM answered by a graceful shutdown first.

    uvicorn alone stops at once on SIGTERM: it closes its socket, waits for open
    connections (at most ``timeout_graceful_shutdown``), cancels what is left, and
    re-raises the signal. SageMaker and Kubernetes send SIGTERM before scaling in, while a
    load balancer may still route a request here for a moment; so this server first keeps
    listening but admits no new generation (503, and ``/ping`` 503), gives the running
    requests ``grace`` seconds to finish, ends the rest with their error records
    (:meth:`Admission.drain`), and only then lets uvicorn shut down as it does, its timeout
    now a backstop. It exits with status 0: a shutdown that was asked for is a success.
    A second SIGTERM ends the grace period at once; Ctrl+C (SIGINT) ends the running
    requests the same way at once and stops as uvicorn does.

    >>> config = uvicorn.Config(create_app("model/"), port=8080)
    >>> GracefulServer(config, Admission(), grace=20).run()  # doctest: +SKIP
    """

    def __init__(self, config: uvicorn.Config, admission: Admission,
                 grace: float = DEFAULT_SHUTDOWN_GRACE) -> None:
        super().__init__(config)
        self.admission = admission
        self.grace = grace
        self._event_loop: Optional[asyncio.AbstractEventLoop] = None
        self._ending: Optional[asyncio.Future] = None

    async def serve(self, sockets: Optional[list] = None) -> None:
        self._event_loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        loop = self._event_loop
        if loop is None or loop.is_closed():
            super().handle_exit(sig, frame)
            return
        # A signal handler interrupts the loop wherever it is: do the work on the loop.
        loop.call_soon_threadsafe(self._on_signal, sig, frame)

    def _on_signal(self, sig: int, frame: Optional[FrameType]) -> None:
        if sig == signal.SIGTERM:
            # Never handed to uvicorn, which would re-raise it at the end (exit status 143).
            if self._ending is None:
                self._ending = asyncio.ensure_future(self._drain_then_exit())
            else:
                self.admission.cut_short()
            return
        if self._ending is None:
            self._ending = asyncio.ensure_future(self.admission.end_all())
        else:
            self.admission.cut_short()
        super().handle_exit(sig, frame)

    async def _drain_then_exit(self) -> None:
        try:
            await self.admission.drain(self.grace)
        finally:
            self.should_exit = True  # uvicorn's own shutdown from here on


def serve(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8080,
          log_level: str = "info", shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE,
          limits: HttpLimits = HttpLimits(), access: AccessControl = AccessControl()) -> bool:
    """Serve ``model_dir`` with uvicorn until SIGTERM or Ctrl+C, within ``limits`` and
    ``access`` (a warning when it listens beyond loopback without a key); return
    whether the server started (False: it could not, e.g. the port is taken). On SIGTERM,
    running requests get ``shutdown_grace`` seconds to finish (:class:`GracefulServer`).

    >>> serve("model/", port=8080, shutdown_grace=20, limits=HttpLimits(timeout_body=60))  # doctest: +SKIP
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warn_if_exposed(host, access)
    app = create_app(model_dir, limits=limits, access=access)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            **limits.uvicorn_options(),
                            # Our AccessLog line has timings; uvicorn's would be a second,
                            # poorer one.
                            access_log=False,
                            timeout_graceful_shutdown=SHUTDOWN_BACKSTOP)
    server = GracefulServer(config, app.state.admission, shutdown_grace)
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # Ctrl+C: uvicorn re-raises it once its shutdown is done
    return server.started
