"""Telling a handler that its request is over before the answer is: the client left, or
the server is shutting down.

``djl-stream serve`` gives each request a :class:`Cancellation` and attaches it to the
``Input`` (:func:`attach_cancellation`); the handler finds it with :func:`cancellation_of`
and registers what stops its generation (:meth:`Cancellation.on_cancel`). The server
cancels it when the client disconnects (nobody is left to answer), or, at the end of a
graceful shutdown, with the error the answer must end with. ``handle(inputs)``'s contract
is unchanged: inside djl-serving nothing attaches a cancellation (its front end tells the
worker nothing when a client leaves), :func:`cancellation_of` is None there, and a
handler then generates to the end as before.

    >>> from djl_stream.serving.inputs import Input
    >>> inp = attach_cancellation(Input(), Cancellation())
    >>> stopped = []
    >>> _ = cancellation_of(inp).on_cancel(lambda: stopped.append("generation"))
    >>> cancellation_of(inp).cancel()            # the client disconnected
    >>> stopped, cancellation_of(inp).client_left
    (['generation'], True)
    >>> cancellation_of(Input()) is None         # inside djl-serving
    True
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator, List, Optional, TypeVar

logger = logging.getLogger(__name__)

#: The attribute of an ``Input`` that holds its :class:`Cancellation` (never a property:
#: properties are the request's headers, and a client must not be able to set this one).
CANCELLATION_ATTRIBUTE = "djl_stream_cancellation"

T = TypeVar("T")


class Cancellation:
    """The end of one request, decided by someone other than its handler; thread-safe.

    :meth:`cancel` without an error: the client left, nobody reads the answer. With an
    error: the server ends the request (it is shutting down), and the answer still goes to
    a client who should read why in it. Either way, every callback registered with
    :meth:`on_cancel` runs once, in the thread that cancels (or at once, in the thread that
    registers, when the request is already cancelled).

    >>> cancellation = Cancellation()
    >>> cancellation.cancel(RuntimeError("the server is shutting down"))
    >>> cancellation.cancelled, cancellation.client_left, str(cancellation.error)
    (True, False, 'the server is shutting down')
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: List[Callable[[], None]] = []
        self._cancelled = False
        self.error: Optional[BaseException] = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def client_left(self) -> bool:
        """Cancelled because nobody is left to answer (no error to tell anyone)."""
        return self._cancelled and self.error is None

    def cancel(self, error: Optional[BaseException] = None) -> None:
        """End the request (the first call decides how; later ones change nothing)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            self.error = error
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run(callback)

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Have ``callback`` called when the request is cancelled; returns a function that
        unregisters it (for a handler whose generation ended on its own)."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(callback)
                return lambda: self._forget(callback)
        _run(callback)
        return lambda: None

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._callbacks = [c for c in self._callbacks if c is not callback]

    def __repr__(self) -> str:
        state = ("client left" if self.client_left else f"ended: {self.error}"
                 if self._cancelled else "running")
        return f"Cancellation({state})"


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:  # noqa: BLE001 - one callback must not keep the others from running
        logger.exception("a cancellation callback failed")


def attach_cancellation(inp: T, cancellation: Cancellation) -> T:
    """Give ``inp`` (djl_python's ``Input`` or ours) its request's ``cancellation``."""
    setattr(inp, CANCELLATION_ATTRIBUTE, cancellation)
    return inp


def cancellation_of(inp: Any) -> Optional[Cancellation]:
    """The cancellation the server attached to ``inp``; None when nothing will ever cancel
    the request (djl-serving's worker)."""
    cancellation = getattr(inp, CANCELLATION_ATTRIBUTE, None)
    return cancellation if isinstance(cancellation, Cancellation) else None


class CancellableStream(Iterator[T]):
    """An engine's stream that ends when ``cancellation`` does.

    On cancellation the engine's stream is closed at once, from the cancelling thread:
    the built-in engines' ``close()`` only flags the request, and their scheduler drops it
    (from the queue before its prefill, or from the batch before the next decode step), so
    a ``next()`` waiting for that step returns. A stream whose ``close()`` cannot be called
    while another thread runs it (a plain generator) is closed at its next step instead.
    Then the stream ends: quietly when the client left, by raising the cancellation's
    error when the server ended the request (so the protocol writes its error record).

    >>> cancellation = Cancellation()
    >>> stream = CancellableStream(iter([["a"], ["b"], ["c"]]), cancellation)
    >>> next(stream)
    ['a']
    >>> cancellation.cancel(RuntimeError("the server is shutting down"))
    >>> next(stream)
    Traceback (most recent call last):
    ...
    RuntimeError: the server is shutting down
    """

    def __init__(self, stream: Iterator[T], cancellation: Cancellation) -> None:
        self._stream = stream
        self._cancellation = cancellation
        self._closed = False
        self._forget = cancellation.on_cancel(self._stop)

    def __iter__(self) -> "CancellableStream[T]":
        return self

    def __next__(self) -> T:
        if self._cancellation.cancelled:
            self.close()
            self._end()
        try:
            return next(self._stream)
        except StopIteration:
            self._forget()
            if self._cancellation.cancelled:
                self._end()
            raise

    def _end(self) -> None:
        error = self._cancellation.error
        if error is not None:
            raise error
        raise StopIteration

    def _stop(self) -> None:
        try:
            self._close_stream()
            self._closed = True
        except ValueError:
            # "generator already executing": __next__ closes it after the step in flight.
            logger.debug("the stream is mid-step; it stops at its next step")

    def _close_stream(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """Stop the engine's stream (idempotent); the cancellation no longer concerns it."""
        self._forget()
        if not self._closed:
            self._closed = True
            self._close_stream()
