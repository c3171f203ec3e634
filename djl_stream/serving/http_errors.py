"""The local server's own errors, in the shape djl-serving's front end gives its own.

A framework error (no route, wrong method, model not loaded, a body too large or too slow)
is JSON ``{"code", "type", "message"}``; errors a handler answers keep the handler's shape
(:mod:`djl_stream.serving.replies`).

    >>> error_response(408, "the request body did not arrive in time").status_code
    408
"""

from __future__ import annotations

from typing import Mapping, Optional

from starlette.responses import JSONResponse

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


def error_response(code: int, message: str, error_type: Optional[str] = None,
                   headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    """A framework error the way djl-serving writes one.

    >>> error_response(404, "Model not found: gpt", "ModelNotFoundException").body
    b'{"code":404,"type":"ModelNotFoundException","message":"Model not found: gpt"}'
    """
    error_type = error_type or ERROR_TYPES.get(code, "ServiceException")
    return JSONResponse({"code": code, "type": error_type, "message": message},
                        status_code=code, headers=headers)
