"""StreamPump: a stream's items pulled in one worker thread and handed to the event loop
(real threads, a real asyncio loop through anyio). The server's streaming tests
(test_server.py) run it behind real sockets."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from djl_stream.serving.stream_pump import FINISHED, LoopWakeups, PumpFailure, StreamPump

# No clock anywhere: every wait below is for a condition another thread makes true.


class Producer:
    """``pull()`` for a pump: hands out ``items`` one by one, each only once its gate is
    opened (all open unless ``gated``), then ``None``; counts the pulls begun."""

    def __init__(self, items, gated=False, fail_at=None):
        self.items = list(items)
        self.gates = [threading.Event() for _ in self.items]
        if not gated:
            for gate in self.gates:
                gate.set()
        self.fail_at = fail_at
        self.pulls = 0
        self._counted = threading.Condition()

    def pull(self):
        with self._counted:
            index = self.pulls
            self.pulls += 1
            self._counted.notify_all()
        if index == self.fail_at:
            raise RuntimeError(f"item {index} is broken")
        if index >= len(self.items):
            return None
        self.gates[index].wait()
        return self.items[index]

    def open(self, *indexes):
        for index in indexes:
            self.gates[index].set()

    async def pulled(self, count, or_when=lambda: False):
        """Wait (in a thread, leaving the loop free) until ``count`` pulls have begun, or
        ``or_when()`` holds (checked whenever :meth:`notify` is called)."""
        def wait():
            with self._counted:
                self._counted.wait_for(lambda: self.pulls >= count or or_when())
        await anyio.to_thread.run_sync(wait)

    def notify(self):
        with self._counted:
            self._counted.notify_all()


class RoomWatched(threading.Semaphore):
    """A pump's room (its ``ahead`` bound) that says when the thread has to wait for it."""

    def __init__(self, value, producer):
        super().__init__(value)
        self.waiting = False
        self.producer = producer

    def acquire(self, blocking=True, timeout=None):
        if super().acquire(blocking=False):
            return True
        self.waiting = True
        self.producer.notify()
        return super().acquire(blocking, timeout)


async def run_pump(pump, body):
    """Run ``pump`` and ``body(pump)`` (the event loop side) together; stop the pump after."""
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(pump.run)
        try:
            return await body(pump)
        finally:
            pump.stop()


def test_an_item_is_taken_as_soon_as_it_exists_not_when_more_follow():
    producer = Producer([b"a", b"b", b"c"], gated=True)

    async def body(pump):
        seen = []
        producer.open(0)
        seen.append(await pump.take())  # the others are still behind their gates
        producer.open(1, 2)
        while seen[-1][1] is None:
            seen.append(await pump.take())
        return seen

    seen = anyio.run(run_pump, StreamPump(producer.pull), body)
    assert seen[0] == ([b"a"], None)
    assert [item for items, _ in seen for item in items] == [b"a", b"b", b"c"]
    assert seen[-1][1] is FINISHED


def test_items_that_piled_up_are_taken_together_in_order():
    producer = Producer([b"1", b"2", b"3", b"4"])

    async def body(pump):
        await producer.pulled(5)  # the thread pulled everything before the loop looked
        return await pump.take()

    assert anyio.run(run_pump, StreamPump(producer.pull), body) == \
        ([b"1", b"2", b"3", b"4"], FINISHED)


def test_a_failing_pull_ends_the_stream_after_the_items_before_it():
    producer = Producer([b"a", b"b", b"c"], fail_at=2)

    async def body(pump):
        taken = []
        end = None
        while end is None:
            items, end = await pump.take()
            taken += items
        return taken, end

    taken, end = anyio.run(run_pump, StreamPump(producer.pull), body)
    assert taken == [b"a", b"b"]
    assert isinstance(end, PumpFailure) and str(end.error) == "item 2 is broken"
    assert producer.pulls == 3  # nothing pulled after the failure


def test_the_thread_runs_at_most_ahead_items_before_the_loop_takes_them():
    producer = Producer([bytes([i]) for i in range(10)])
    pump = StreamPump(producer.pull, ahead=3)
    room = pump._room = RoomWatched(3, producer)  # to see the thread stop for room

    async def body(pump):
        # until the thread waits for room, or (were it not bounded) has pulled everything
        await producer.pulled(len(producer.items) + 1, or_when=lambda: room.waiting)
        pulled_before_taking = producer.pulls
        items, _ = await pump.take()
        await producer.pulled(6)  # taking three made room for three more
        return pulled_before_taking, items

    pulled, items = anyio.run(run_pump, pump, body)
    assert pulled == 3
    assert items == [b"\x00", b"\x01", b"\x02"]


@pytest.mark.parametrize("waiting_in", ["pull", "room"])
def test_stop_ends_the_thread_without_another_pull(waiting_in):
    # "pull": the thread is inside pull() (a token not yet produced) when stopped, and
    # returns once it comes; "room": it waits for the loop to take what it pulled.
    producer = Producer([b"a", b"b", b"c"], gated=waiting_in == "pull")
    finished = threading.Event()

    async def main():
        pump = StreamPump(producer.pull, ahead=1)

        async def run():
            await pump.run()
            finished.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run)
            await producer.pulled(1)
            pump.stop()
            if waiting_in == "pull":
                assert not finished.is_set()  # the pull in flight is waited for
                producer.open(0)
        # the task group waited for the thread
        assert finished.is_set()

    anyio.run(main)
    assert producer.pulls == 1


def test_events_set_from_threads_while_the_loop_is_busy_cost_it_one_wakeup():
    async def main():
        wakeups = LoopWakeups.for_loop(asyncio.get_running_loop())
        events = [asyncio.Event() for _ in range(10)]
        # ten streams' threads hand over a token while the loop runs something else
        threads = [threading.Thread(target=wakeups.set_soon, args=(event,)) for event in events]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()  # on the loop's thread: it runs no callback meanwhile
        await asyncio.gather(*(event.wait() for event in events))
        later = asyncio.Event()
        threading.Thread(target=wakeups.set_soon, args=(later,)).start()
        await later.wait()
        return wakeups.wakeups

    assert asyncio.run(main()) == 2  # one for the ten, one for the one after
