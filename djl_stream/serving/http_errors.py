"""The local server's own errors, in the shape djl-serving's front end gives its own.

A framework error (no route, wrong method, model not loaded, a body too large or too slow)
is JSON ``{"code", "type", "message"}``; under ``/v1/``, where OpenAI's clients call, it is
OpenAI's ``{"error": {"message", "type", "param", "code"}}``, which their SDKs read. Errors
a handler answers keep the handler's shape (:mod:`djl_stream.serving.replies`).

    >>> error_response(408, "the request body did not arrive in time").status_code
    408
"""

from __future__ import annotations

from typing import Mapping, Optional

from starlette.responses import JSONResponse

from djl_stream.protocols.openai.responses import error_body

#: djl-serving's exception name for each status the server answers itself.
ERROR_TYPES = {
    400: "BadRequestException",
    404: "ResourceNotFoundException",
    405: "MethodNotAllowedException",
    408: "RequestTimeoutException",
    413: "RequestEntityTooLargeException",
    414: "RequestUriTooLongException",
    431: "RequestHeaderFieldsTooLargeException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}


#: Where a framework error takes OpenAI's shape: the routes OpenAI's clients call.
OPENAI_PREFIX = "/v1/"


def error_response(code: int, message: str, error_type: Optional[str] = None,
                   headers: Optional[Mapping[str, str]] = None, path: str = "") -> JSONResponse:
    """A framework error the way djl-serving writes one, or OpenAI where ``path`` is one of
    its routes (its type ``invalid_request_error`` for a 4xx, ``server_error`` for a 5xx).

    >>> error_response(404, "Model not found: gpt", "ModelNotFoundException").body
    b'{"code":404,"type":"ModelNotFoundException","message":"Model not found: gpt"}'
    >>> error_response(405, "Method Not Allowed", path="/v1/chat/completions").body
    b'{"error":{"message":"Method Not Allowed","type":"invalid_request_error","param":null,"code":null}}'
    """
    if path.startswith(OPENAI_PREFIX):
        kind = "invalid_request_error" if code < 500 else "server_error"
        body = error_body(message, kind)
    else:
        body = {"code": code, "type": error_type or ERROR_TYPES.get(code, "ServiceException"),
                "message": message}
    return JSONResponse(body, status_code=code, headers=headers)
