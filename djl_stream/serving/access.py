"""Who may call the server: an API key, and which other web origins may call it from a page.

Both are off by default, for a server on loopback. With ``--api-key`` (or
``DJL_STREAM_API_KEY``) every request needs ``Authorization: Bearer <key>``, except the
routes that say only whether the server is up (``/ping``, ``/health``, ``/metrics``) and the
pages a browser opens (``GET /chat``, ``GET /``, ``GET /docs``, ``GET /openapi.json``),
whose content is no answer of the model; ``--open-routes`` changes that list (empty: every
route needs the key). A missing or wrong key gets a 401 in the route's own error shape
(OpenAI's under ``/v1/``, TGI's on its routes, djl-serving's elsewhere), with
``WWW-Authenticate: Bearer``. A browser's WebSocket cannot send headers: the chat socket
also takes the key as the subprotocol ``djl-stream.bearer.<key>``, which the chat page sends.

``--allowed-origins`` lets pages from those origins call the server (CORS), through
Starlette's ``CORSMiddleware``: preflights (``OPTIONS`` with ``Origin``) are answered
before the key is asked for, as browsers send them without credentials.

    >>> access = AccessControl(api_key="s3cret")
    >>> access.key_matches("Bearer s3cret"), access.key_matches("Bearer guess")
    (True, False)
    >>> access.is_open("GET", "/ping"), access.is_open("POST", "/"), access.is_open("GET", "/")
    (True, False, True)
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
from typing import Mapping, Optional, Sequence, Tuple

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from djl_stream.protocols.openai.responses import error_body
from djl_stream.protocols.tgi.writers import error_record

logger = logging.getLogger(__name__)

#: What needs no key by default: health, metrics, and the pages (GET only: ``POST /`` is
#: TGI's generation route).
DEFAULT_OPEN_ROUTES: Tuple[str, ...] = ("/ping", "/health", "/metrics", "GET /chat", "GET /",
                                        "GET /docs", "GET /openapi.json")
#: The chat socket's subprotocol that carries the key: ``djl-stream.bearer.<key>``.
BEARER_SUBPROTOCOL = "djl-stream.bearer."
#: Routes answered in TGI's error shape.
TGI_ROUTES = frozenset({"/generate", "/generate_stream", "/", "/info", "/health"})


@dataclasses.dataclass(frozen=True)
class AccessControl:
    """The API key, the routes open without it, and the origins allowed to call from a
    page. ``open_routes`` entries are a path (any method) or ``"METHOD /path"``."""

    api_key: Optional[str] = None
    open_routes: Tuple[str, ...] = DEFAULT_OPEN_ROUTES
    allowed_origins: Tuple[str, ...] = ()

    def is_open(self, method: str, path: str) -> bool:
        """Whether ``method path`` needs no key."""
        return path in self.open_routes or f"{method.upper()} {path}" in self.open_routes

    def key_matches(self, authorization: Optional[str]) -> bool:
        """Whether an ``Authorization`` header carries the key (compared in constant time)."""
        scheme, _, token = (authorization or "").partition(" ")
        return (self.api_key is not None and scheme.lower() == "bearer"
                and hmac.compare_digest(token.strip().encode(), self.api_key.encode()))

    def subprotocol_key(self, subprotocols: Sequence[str]) -> Optional[str]:
        """The subprotocol of a WebSocket handshake that carries the key, if one does."""
        for protocol in subprotocols:
            if protocol.startswith(BEARER_SUBPROTOCOL) and self.key_matches(
                    "Bearer " + protocol[len(BEARER_SUBPROTOCOL):]):
                return protocol
        return None


def access_control(api_key: Optional[str] = None, open_routes: Optional[Sequence[str]] = None,
                   allowed_origins: Sequence[str] = (),
                   environ: Optional[Mapping[str, str]] = None) -> AccessControl:
    """An :class:`AccessControl` from flags, the key falling back to ``DJL_STREAM_API_KEY``.

    >>> access_control(environ={"DJL_STREAM_API_KEY": "k"}).api_key
    'k'
    >>> access_control(open_routes=[""]).open_routes
    ()
    """
    key = api_key or (environ or {}).get("DJL_STREAM_API_KEY") or None
    routes = DEFAULT_OPEN_ROUTES if open_routes is None else tuple(
        route.strip() for route in open_routes if route.strip())
    return AccessControl(key, routes, tuple(origin.strip() for origin in allowed_origins
                                            if origin.strip()))


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server to this machine.

    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, access: AccessControl) -> bool:
    """Log a warning when the server listens beyond loopback with no key; return whether
    it did."""
    if access.api_key is None and not is_loopback(host):
        logger.warning("listening on %s without an API key: anyone who can reach this "
                       "address can use the model; set --api-key or DJL_STREAM_API_KEY", host)
        return True
    return False


def unauthorized_body(path: str, message: str) -> dict:
    """The 401's JSON body in the route's error shape.

    >>> unauthorized_body("/generate", "no key")
    {'error': 'no key', 'error_type': 'authentication'}
    """
    if path.startswith("/v1/"):
        return error_body(message, "invalid_request_error", None, "invalid_api_key")
    if path in TGI_ROUTES:
        return error_record(message, "authentication")
    return {"code": 401, "type": "Unauthorized", "message": message}


class RequireApiKey:
    """ASGI middleware: HTTP requests and WebSocket handshakes without the key are refused
    (401, or a WebSocket closed with 1008 before it is accepted)."""

    def __init__(self, app: ASGIApp, access: AccessControl) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        access = self.access
        if scope["type"] not in ("http", "websocket") or access.api_key is None:
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET") if scope["type"] == "http" else "GET"
        path = scope.get("path", "")
        headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                   for name, value in scope.get("headers", [])}
        if access.is_open(method, path) or access.key_matches(headers.get("authorization")):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
            if access.subprotocol_key(offered) is not None:
                await self.app(scope, receive, send)
                return
            await send({"type": "websocket.close", "code": 1008,
                        "reason": "a valid API key is required"})
            return
        message = ("a valid API key is required: send Authorization: Bearer <key>"
                   if "authorization" not in headers else "the API key is not valid")
        response = JSONResponse(unauthorized_body(path, message), status_code=401,
                                headers={"www-authenticate": "Bearer"})
        await response(scope, receive, send)
