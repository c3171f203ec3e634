"""A streamed answer's items, pulled in one worker thread for the stream's life and handed
to the event loop in batches.

A streamed answer is a blocking iterator (djl-serving's contract: ``handle()`` returns an
``Output`` whose ``stream_content`` a thread of the worker drains), so the server needs a
thread to wait on it. Fetching each item with a thread round trip of its own
(``await anyio.to_thread.run_sync(next, ...)``) costs the event loop a hand-off to a
worker thread, a future and a wake-up for every token of every stream. With many streams
and a fast step (a small model, a GPU) that is where the server's time goes, and the
clients' tokens/s is the event loop's rather than the model's
(``python -m benchmarks.stream_overhead --vocab 512`` measures what the server spends
per streamed token; run it on both sides of a change to this module).

:class:`StreamPump` keeps one thread on the iterator instead: it pulls item after item and
appends each to a queue the event loop reads, waking the loop only when it is not already
due to look. The wake-ups of all streams go through one :class:`LoopWakeups` per event
loop: a decode step hands a token to every stream at about the same instant, and the loop
is woken once for all of them (one ``call_soon_threadsafe``, one write to its self-pipe)
rather than once per stream.
:meth:`StreamPump.take` returns every item ready, so that a loop that fell behind sends
them together, as one HTTP chunk, rather than paying a send per item. The thread runs at
most :data:`AHEAD` items ahead of what the loop took (a slow client does not make the
server buffer its whole answer), and :meth:`StreamPump.stop` ends it after the item it is
waiting for, if any: the iterator's ``close()`` is then the caller's, in no other thread at
the same time.

Example (the event loop side)::

    pump = StreamPump(lambda: next(iterator, None))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(pump.run)
        try:
            items, end = await pump.take()      # end: None, FINISHED or a PumpFailure
        finally:
            pump.stop()
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import weakref
from typing import Any, Callable, Deque, List, Optional, Tuple, Union

import anyio
import anyio.to_thread

#: How many items the thread may pull before the event loop has taken them.
AHEAD = 64


class _Finished:
    def __repr__(self) -> str:
        return "FINISHED"


#: What :meth:`StreamPump.take` returns as ``end`` once the iterator is exhausted.
FINISHED = _Finished()


@dataclasses.dataclass(frozen=True)
class PumpFailure:
    """What :meth:`StreamPump.take` returns as ``end`` when pulling raised ``error``."""

    error: Exception


End = Union[None, _Finished, PumpFailure]


class LoopWakeups:
    """Sets asyncio events of one event loop from other threads, waking the loop once for
    every event asked for until it runs (:meth:`for_loop` gives a loop's one instance).

    >>> async def main():
    ...     wakeups = LoopWakeups.for_loop(asyncio.get_running_loop())
    ...     events = [asyncio.Event() for _ in range(3)]
    ...     for event in events:   # as threads would; here from the loop itself
    ...         wakeups.set_soon(event)
    ...     await asyncio.sleep(0)
    ...     return [event.is_set() for event in events], wakeups.wakeups
    >>> asyncio.run(main())
    ([True, True, True], 1)
    """

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWakeups]" = \
        weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: List[asyncio.Event] = []
        self.wakeups = 0  # how many times the loop was woken (for tests and curiosity)

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "LoopWakeups":
        """The instance of ``loop``; call it on the loop's thread."""
        wakeups = cls._of_loop.get(loop)
        if wakeups is None:
            wakeups = cls._of_loop[loop] = cls(loop)
        return wakeups

    def set_soon(self, event: asyncio.Event) -> None:
        """Have the loop set ``event`` (from any thread)."""
        with self._lock:
            self._pending.append(event)
            if len(self._pending) > 1:
                return  # a wake-up is on its way and will set this one too
            self.wakeups += 1
        self._loop.call_soon_threadsafe(self._set_pending)

    def _set_pending(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        for event in events:
            event.set()


class StreamPump:
    """Calls ``pull()`` in one worker thread until it returns ``None`` (the end) or raises,
    and hands what it returned to the event loop (see the module docstring).

    >>> import anyio
    >>> items = iter([b"a", b"b", b"c"])
    >>> async def main():
    ...     pump = StreamPump(lambda: next(items, None))
    ...     received = []
    ...     async with anyio.create_task_group() as tasks:
    ...         tasks.start_soon(pump.run)
    ...         end = None
    ...         while end is None:
    ...             batch, end = await pump.take()
    ...             received += batch
    ...     return received, end
    >>> anyio.run(main)
    ([b'a', b'b', b'c'], FINISHED)
    """

    def __init__(self, pull: Callable[[], Optional[Any]], ahead: int = AHEAD) -> None:
        self._pull = pull
        self._ready: Deque[Any] = collections.deque()
        self._room = threading.Semaphore(ahead)
        self._stopping = False
        self._wakeup_due = False
        self._wakeup = asyncio.Event()
        self._wakeups: Optional[LoopWakeups] = None

    async def run(self, limiter: Optional[anyio.CapacityLimiter] = None) -> None:
        """Pull in a thread of ``limiter`` until the end, a failure or :meth:`stop`."""
        self._wakeups = LoopWakeups.for_loop(asyncio.get_running_loop())
        await anyio.to_thread.run_sync(self._pull_until_done, limiter=limiter)

    def stop(self) -> None:
        """Pull no further item: the thread ends once the ``pull()`` in flight returns."""
        self._stopping = True
        self._room.release()  # a thread waiting for room wakes up to see it

    async def take(self) -> Tuple[List[Any], End]:
        """Every item pulled and not yet taken (waiting for one if there is none), and how
        the stream ended after them: ``None`` while it goes on."""
        while True:
            # Reset before looking, so that an item appended after the look wakes us.
            self._wakeup.clear()
            self._wakeup_due = False
            if self._ready:
                break
            await self._wakeup.wait()
        items: List[Any] = []
        end: End = None
        while self._ready:
            item = self._ready.popleft()
            if isinstance(item, (_Finished, PumpFailure)):
                end = item
                break
            items.append(item)
        if items:
            self._room.release(len(items))
        return items, end

    def _pull_until_done(self) -> None:
        while True:
            self._room.acquire()
            if self._stopping:
                return
            try:
                item = self._pull()
            except Exception as error:  # noqa: BLE001 - handed to the loop, which answers it
                self._hand(PumpFailure(error))
                return
            if item is None:
                self._hand(FINISHED)
                return
            self._hand(item)

    def _hand(self, item: Any) -> None:
        self._ready.append(item)
        if not self._wakeup_due:
            self._wakeup_due = True
            self._wakeups.set_soon(self._wakeup)
