"""What a client may make ``djl-stream serve`` hold: how large a request body may be, and
how long a request's head, its body and an idle connection may take.

uvicorn reads the requests; what it lacks is added here, each answer a JSON framework error
(:mod:`djl_stream.serving.http_errors`) followed by closing the connection:

- :class:`RequestLimits`, ASGI middleware: 413 for a body over ``max_request_size``, at
  once from its ``Content-Length`` (the body is never read) or, for a chunked body, as soon
  as what arrived goes past the limit; 408 when the body is not complete ``timeout_body``
  seconds after its head.
- :class:`RequestConcurrency`, ASGI middleware: beyond ``limit_concurrency`` requests in
  progress, a JSON 503 (``/ping`` is always answered). Requests are counted, not sockets:
  a client holding idle connections takes no one's place.
- :class:`LimitedH11Protocol`, uvicorn's h11 protocol with a head timeout (408 once a
  request has begun and its head is not complete ``timeout_header`` seconds later), the
  keep-alive timeout also on a new connection that sends nothing (uvicorn starts it only
  after a response), ``timeout_body`` also for the rest of a body the app answered without
  reading (uvicorn reads and drops it for as long as it comes), and JSON instead of
  uvicorn's plain text for a malformed request. Its connection refuses a head over
  ``max_head_size`` (431, or 414 for the target alone) and a request with both
  ``Content-Length`` and ``Transfer-Encoding`` (400: each would frame the body
  differently, which is how a second request is smuggled inside a body), and closes.
- :meth:`HttpLimits.uvicorn_options`: the rest is uvicorn's own, ``timeout_keep_alive``.

Inside djl-serving none of this runs: its front end reads the body (``max_request_size``),
and the prompt's length is bounded in characters before tokenizing by the handler itself
(:func:`djl_stream.protocols.validation.check_input_characters`).

    >>> limits = HttpLimits(timeout_body=2)
    >>> limits.max_request_size, limits.timeout_body
    (8388608, 2)
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import http
import logging
from typing import Any, Optional

import anyio
import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from djl_stream.serving.http_errors import error_response

logger = logging.getLogger(__name__)

_CLOSE = {"connection": "close"}


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """The limits of ``djl-stream serve`` (each one is a flag of the same name).

    Attributes:
        max_request_size: the largest request body in bytes (413 beyond). 8 MiB: more than
            SageMaker forwards to a real-time endpoint (6 MB); djl-serving's own default
            is 64 MiB.
        timeout_header: seconds from a request's first byte to the end of its head (408).
        timeout_body: seconds from the end of a request's head to the end of its body
            (408); for a body answered without being read, from the answer (closed).
        timeout_keep_alive: seconds a connection may stay idle (new, or between requests)
            before it is closed, without an answer.
        limit_concurrency: most requests in progress at once (a stream is in progress
            until its last byte); a request beyond it is answered 503 at once, except
            ``/ping``. ``None``: no limit.
        max_head_size: the largest request head (request line and headers) in bytes:
            431 beyond it, 414 where the request target alone is larger.
    """

    max_request_size: int = 8 * 1024 * 1024
    timeout_header: float = 10.0
    timeout_body: float = 30.0
    timeout_keep_alive: float = 5.0
    limit_concurrency: Optional[int] = 1000
    max_head_size: int = 16 * 1024

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments of ``uvicorn.run`` that enforce these limits.

        >>> sorted(HttpLimits().uvicorn_options())
        ['http', 'limit_concurrency', 'timeout_keep_alive']
        """
        return {"http": functools.partial(LimitedH11Protocol, limits=self),
                "timeout_keep_alive": self.timeout_keep_alive,
                # uvicorn counts open connections, idle ones too: RequestConcurrency counts
                # requests instead
                "limit_concurrency": None}


class _Refused(Exception):
    """The request is answered with ``code`` before its body is all read."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def declared_length(scope: Scope) -> Optional[int]:
    """The request's ``Content-Length`` (h11 has already refused one that is not a number),
    ``None`` for a chunked body or none.

    >>> declared_length({"headers": [(b"content-length", b"42")]})
    42
    """
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value)
    return None


class _LimitedBody:
    """The ``receive`` of one request, refusing a body that outgrows or outlasts its limits.

    Once the body is complete, messages pass through untouched: a stream's disconnect
    watcher waits on ``receive`` for as long as the answer takes.
    """

    def __init__(self, receive: Receive, limits: HttpLimits, declared: Optional[int]) -> None:
        self._receive = receive
        self.limits = limits
        self.declared = declared
        self.deadline = anyio.current_time() + limits.timeout_body
        self.received = 0
        self.complete = False

    async def receive(self) -> Message:
        if self.complete:
            return await self._receive()
        try:
            with anyio.fail_after(max(self.deadline - anyio.current_time(), 0)):
                message = await self._receive()
        except TimeoutError:
            of = f" of {self.declared}" if self.declared is not None else ""
            raise _Refused(408, f"the request body was not complete within "
                                f"{self.limits.timeout_body:g} s (--timeout-body): "
                                f"{self.received}{of} bytes arrived") from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limits.max_request_size:
                raise _Refused(413, f"the request body is larger than the limit "
                                    f"(--max-request-size) of {self.limits.max_request_size} "
                                    f"bytes")
            self.complete = not message.get("more_body", False)
        else:  # http.disconnect: Starlette raises ClientDisconnect for it
            self.complete = True
        return message


class RequestLimits:
    """ASGI middleware: a request body over ``limits.max_request_size`` is answered 413,
    one not complete within ``limits.timeout_body`` seconds 408; both close the connection.

    A ``Content-Length`` over the limit is refused before the app runs, so that not a byte
    of the body is read (a client that sent ``Expect: 100-continue`` never sends it).
    """

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        limit = self.limits.max_request_size
        if declared is not None and declared > limit:
            await error_response(413, f"the request body is {declared} bytes (content-length); "
                                      f"the limit (--max-request-size) is {limit} bytes",
                                 headers=_CLOSE, path=scope["path"])(scope, receive, send)
            return
        body = _LimitedBody(receive, self.limits, declared)
        answered = False

        async def watched_send(message: Message) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, body.receive, watched_send)
        except _Refused as refusal:
            if answered:  # an app that answers before reading the body, then reads it
                raise
            await error_response(refusal.code, refusal.message, headers=_CLOSE,
                                 path=scope["path"])(scope, receive, send)


class RequestConcurrency:
    """ASGI middleware: at most ``limits.limit_concurrency`` requests in progress; one
    beyond it is answered 503 (JSON, naming the limit) without running.

    ``/ping`` is never refused: a load balancer that saw a busy server fail its health
    check would take it out of service (or restart it), dropping the requests in progress.
    Only requests count, so idle keep-alive connections take no one's place.
    """

    def __init__(self, app: ASGIApp, limits: HttpLimits) -> None:
        self.app = app
        self.limit = limits.limit_concurrency
        self.in_progress = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.limit is None or scope["path"] == "/ping":
            await self.app(scope, receive, send)
            return
        if self.in_progress >= self.limit:
            await error_response(503, f"the server has {self.in_progress} requests in "
                                      f"progress, its limit (--limit-concurrency); retry later",
                                 headers={"retry-after": "1"},
                                 path=scope["path"])(scope, receive, send)
            return
        self.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1


class CheckedConnection(h11.Connection):
    """h11's server connection, refusing what h11 lets through: a head larger than
    ``max_head_size`` that arrived whole (h11 bounds only a head still incomplete), and a
    request framed twice (``Content-Length`` with ``Transfer-Encoding``, RFC 9112 6.3).

    A refused request raises :class:`h11.RemoteProtocolError`, which uvicorn answers
    through :meth:`LimitedH11Protocol.send_400_response`; :attr:`refusal` holds the status
    and message it answers with.

    >>> connection = CheckedConnection(h11.SERVER, max_head_size=64)
    >>> connection.receive_data(b"GET /" + b"a" * 100 + b" HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    >>> try:
    ...     connection.next_event()
    ... except h11.RemoteProtocolError:
    ...     connection.refusal
    (414, 'the request target is 101 bytes; the limit (--max-head-size) is 64 bytes')
    """

    def __init__(self, role: Any, max_head_size: int) -> None:
        super().__init__(role, max_incomplete_event_size=max_head_size)
        self.max_head_size = max_head_size
        self.refusal: Optional[tuple[int, str]] = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as error:
            if error.error_status_hint == 431:  # h11's "Receive buffer too long"
                self.refusal = (431, f"the request head is over the limit (--max-head-size) "
                                     f"of {self.max_head_size} bytes")
            raise
        if isinstance(event, h11.Request):
            self.refusal = self._refusal(event)
            if self.refusal is not None:
                raise h11.RemoteProtocolError(self.refusal[1], self.refusal[0])
        return event

    def _refusal(self, request: h11.Request) -> Optional[tuple[int, str]]:
        names = {name for name, _ in request.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            return 400, ("the request has both Content-Length and Transfer-Encoding; "
                         "send one of them")
        limit = self.max_head_size
        if len(request.target) > limit:
            return 414, (f"the request target is {len(request.target)} bytes; the limit "
                         f"(--max-head-size) is {limit} bytes")
        # the request line and each header line as sent, with their line ends
        size = (len(request.method) + len(request.target) + len(b"  HTTP/1.1\r\n\r\n")
                + sum(len(name) + len(value) + len(b": \r\n")
                      for name, value in request.headers))
        if size > limit:
            return 431, (f"the request head is {size} bytes; the limit (--max-head-size) "
                         f"is {limit} bytes")
        return None


#: How long a connection answered before any request was parsed (400, 408) keeps reading
#: and dropping what the client still sends before it is closed.
_LINGER_SECONDS = 2.0


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the timeouts it lacks (see the module docstring).

    uvicorn parses a request head only once it is complete and runs the app only then, so
    a client that sends a head slowly (or half of one, or nothing) is invisible to ASGI
    middleware: this protocol times it. It is used whether or not httptools is installed,
    so that the limits do not depend on what else the environment holds.
    """

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.conn = CheckedConnection(h11.SERVER, max_head_size=limits.max_head_size)
        self._head_timer: Optional[asyncio.TimerHandle] = None
        self._drain_timer: Optional[asyncio.TimerHandle] = None
        #: set once an answer sent before any request was parsed is out (see
        #: :meth:`_answer_and_close`): what still arrives is dropped until it fires
        self._linger_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._retime()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        for timer in (self._head_timer, self._drain_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._drain_timer = self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # answered and half-closed: dropped (see _answer_and_close)
        super().data_received(data)
        self._retime()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._retime()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer to a request h11 cannot parse is text/plain, and always 400.
        code, message = self.conn.refusal or (400, msg)
        self._answer_and_close(code, message)

    def _retime(self) -> None:
        """Time what the connection now waits for: the rest of a request head (408 after
        ``timeout_header``), the rest of a body the app answered without reading (dropped
        as it comes, for ``timeout_body`` at most), or nothing (closed after
        ``timeout_keep_alive``; uvicorn starts that timer after a response only, so a new
        connection that never sent a byte stayed open for good)."""
        if self.transport.is_closing():
            return
        client, server = self.conn.their_state, self.conn.our_state
        if client is h11.SEND_BODY and server is h11.DONE:
            # Answered before the body was read (a 404, a 503 while the model loads): h11
            # reads the rest and drops it, so that the connection can take the next request.
            if self._drain_timer is None:
                self._drain_timer = self.loop.call_later(self.limits.timeout_body,
                                                         self._drain_timed_out)
        elif self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        if client is h11.IDLE and self.conn.trailing_data[0]:
            if self._head_timer is None:  # timed from the head's first bytes
                self._head_timer = self.loop.call_later(self.limits.timeout_header,
                                                        self._head_timed_out)
            return
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if client is h11.IDLE and self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _drain_timed_out(self) -> None:
        self._drain_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.SEND_BODY:
            logger.info("%s: the rest of a request body the server answered without was not "
                        "sent within %g s (--timeout-body): closed", self._client_name(),
                        self.limits.timeout_body)
            self.transport.close()

    def _client_name(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.info("%s did not complete a request head within %g s (--timeout-header): "
                    "answered 408 and closed", self._client_name(), self.limits.timeout_header)
        self._answer_and_close(408, f"the request head was not complete within "
                                    f"{self.limits.timeout_header:g} s (--timeout-header)")

    def _answer_and_close(self, code: int, message: str) -> None:
        """Answer with a JSON error before any request was parsed, then close."""
        response = error_response(code, message, headers=_CLOSE)
        try:
            # h11 lets a server answer before a request head, as a 400 or 408 must.
            headers = self.server_state.default_headers + response.raw_headers  # date, server
            out = self.conn.send(h11.Response(status_code=code, headers=headers,
                                              reason=http.HTTPStatus(code).phrase.encode()))
            out += self.conn.send(h11.Data(data=response.body))
            out += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            out = b""  # the connection is past answering: just close it
        if out:
            self.transport.write(out)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # A lingering close: closed at once, with the client's bytes still arriving (the
        # rest of a slow head, say), the socket would answer them with a reset, and a
        # reset can reach the client before it has read the answer, which it then never
        # sees. So the answer is followed by the end of what the server sends, what the
        # client still sends is read and dropped, and the connection is closed when the
        # client closes it or after _LINGER_SECONDS.
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(_LINGER_SECONDS, self.transport.close)
