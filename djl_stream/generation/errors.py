"""Errors that cross module boundaries and map to an HTTP status. Import-light on purpose:
``model.py`` imports the service, which must not pull in torch at import time."""

from __future__ import annotations

from typing import Any


class QueueFullError(RuntimeError):
    """More requests are waiting than the queue holds (``job_queue_size``): HTTP 503."""


class GenerationFailed(RuntimeError):
    """The model raised during a decode step this request was part of."""


class ShuttingDown(RuntimeError):
    """The server is shutting down and ended this request before its generation did: HTTP
    503 before the first chunk, the stream's error record after it."""


class RequestError(ValueError):
    """The request is malformed; answered with HTTP 400 and :meth:`to_dict` as the body.

    ``field`` is a dotted path into the body (``parameters.top_p``, ``inputs[1]``,
    ``messages[0].role``), or ``body`` for the body as a whole.

    >>> RequestError("parameters.top_p", "parameters.top_p must be at most 1, got 2").to_dict()
    {'code': 400, 'type': 'RequestError', 'field': 'parameters.top_p', 'message': 'parameters.top_p must be at most 1, got 2'}
    """

    code = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "type": "RequestError", "field": self.field,
                "message": self.message}
