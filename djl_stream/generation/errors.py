"""Errors that cross module boundaries and map to an HTTP status. Import-light on purpose:
``model.py`` imports the service, which must not pull in torch at import time."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """More requests are waiting than the queue holds (``job_queue_size``): HTTP 503."""


class GenerationFailed(RuntimeError):
    """The model raised during a decode step this request was part of."""


class ShuttingDown(RuntimeError):
    """The server is shutting down and ended this request before its generation did: HTTP
    503 before the first chunk, the stream's error record after it."""
