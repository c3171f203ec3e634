"""Which requests the server is answering, whether it lets new ones in, and the graceful
shutdown that closes the door, lets the running ones finish and ends the rest.

Every generation request of ``djl-stream serve`` is admitted (:meth:`Admission.admit`
gives it its :class:`~djl_stream.serving.cancellation.Cancellation`) and released once its
answer has been sent. On SIGTERM the server drains (:meth:`Admission.drain`): from then
on new requests are refused (503) while those in flight go on, for at most the grace
period; what is still running then is cancelled with :class:`~djl_stream.generation.
errors.ShuttingDown`, which ends a stream with its error record and answers a request
that has no answer yet with a 503. All of it runs on the server's event loop.

    >>> import anyio
    >>> async def shutdown_with_one_request_running():
    ...     admission = Admission()
    ...     running = admission.admit()
    ...     ended = await admission.drain(grace=0.01)   # it never finishes by itself
    ...     return ended, admission.admit(), type(running.error).__name__
    >>> anyio.run(shutdown_with_one_request_running)
    (1, None, 'ShuttingDown')
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Set

import anyio
import anyio.to_thread

from djl_stream.generation.errors import ShuttingDown
from djl_stream.serving.cancellation import Cancellation

logger = logging.getLogger(__name__)

#: Seconds running requests get to finish after SIGTERM. SageMaker sends SIGKILL 30 s
#: after SIGTERM, and so does Kubernetes by default (terminationGracePeriodSeconds): 20 s
#: leaves time to end the rest with their error records and exit before that.
DEFAULT_SHUTDOWN_GRACE = 20.0
#: Where ``djl-stream serve`` reads the grace period when ``--shutdown-grace`` is not given.
SHUTDOWN_GRACE_ENV = "DJL_STREAM_SHUTDOWN_GRACE"
SHUTTING_DOWN = "the server is shutting down"


def grace_seconds(text: str) -> float:
    """A grace period as ``--shutdown-grace`` or :data:`SHUTDOWN_GRACE_ENV` give it:
    seconds, at least 0 (0 ends running requests at once; ``inf`` waits for them).

    >>> grace_seconds("7.5"), grace_seconds("0")
    (7.5, 0.0)
    >>> grace_seconds("-1")
    Traceback (most recent call last):
    ...
    ValueError: the shutdown grace period must be at least 0 seconds, got '-1'
    """
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"the shutdown grace period must be a number of seconds, "
                         f"got {text!r}") from None
    if not seconds >= 0:  # NaN included
        raise ValueError(f"the shutdown grace period must be at least 0 seconds, got {text!r}")
    return seconds


class Admission:
    """The requests in flight, and the door for new ones; see the module docstring.

    >>> admission = Admission()
    >>> cancellation = admission.admit()
    >>> admission.in_flight
    1
    >>> admission.release(cancellation); admission.in_flight, admission.open
    (0, True)
    """

    def __init__(self) -> None:
        self._in_flight: Set[Cancellation] = set()
        self._open = True
        self._cut_short = False
        self._changed: Optional[anyio.Event] = None

    @property
    def open(self) -> bool:
        """Whether new requests are let in (False from the start of a shutdown)."""
        return self._open

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def admit(self, cancellation: Optional[Cancellation] = None) -> Optional[Cancellation]:
        """A new request's cancellation (``cancellation``, where its caller made it), or
        None once the server is shutting down."""
        if not self._open:
            return None
        cancellation = cancellation or Cancellation()
        self._in_flight.add(cancellation)
        return cancellation

    def release(self, cancellation: Cancellation) -> None:
        """The request's answer has been sent (or its client is gone)."""
        self._in_flight.discard(cancellation)
        self._signal()

    def cut_short(self) -> None:
        """End the grace period now (a second SIGTERM)."""
        self._cut_short = True
        self._signal()

    def _signal(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def drain(self, grace: float) -> int:
        """Stop admitting, give the requests in flight ``grace`` seconds (or until
        :meth:`cut_short`) to finish, then end the rest; return how many were ended."""
        self._open = False
        if self._in_flight:
            logger.info("%s: %d request(s) in flight get %s s to finish", SHUTTING_DOWN,
                        len(self._in_flight), f"{grace:g}")
        with anyio.move_on_after(grace if math.isfinite(grace) else None):
            while self._in_flight and not self._cut_short:
                self._changed = anyio.Event()
                await self._changed.wait()
        if self._cut_short:
            return await self.end_all(f"{SHUTTING_DOWN}: its grace period was cut short")
        return await self.end_all(f"{SHUTTING_DOWN}: this generation outlasted its grace "
                                  f"period ({grace:g} s)")

    async def end_all(self, reason: str = SHUTTING_DOWN) -> int:
        """Stop admitting and cancel every request in flight with ``ShuttingDown(reason)``;
        return how many there were. They leave once their answers (error records or 503s)
        are sent."""
        self._open = False
        remaining = list(self._in_flight)
        if remaining:
            logger.info("%s: ending %d request(s) still running", SHUTTING_DOWN, len(remaining))
            # In a thread: a handler's callback closes its engine's stream, which may block.
            await anyio.to_thread.run_sync(_cancel_all, remaining, reason)
        return len(remaining)


def _cancel_all(cancellations: List[Cancellation], reason: str) -> None:
    for cancellation in cancellations:
        # One error each: an exception raised in several threads would share a traceback.
        cancellation.cancel(ShuttingDown(reason))
