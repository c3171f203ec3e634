"""The door of the server and its graceful shutdown: requests in flight, the grace period,
and what is ended when it runs out. Events order everything; nothing is timed."""

from __future__ import annotations

import math

import anyio
import pytest

from djl_stream.generation.errors import ShuttingDown
from djl_stream.serving.admission import Admission, grace_seconds


def test_a_drain_waits_for_the_requests_in_flight_and_ends_none():
    async def main():
        admission = Admission()
        first, second = admission.admit(), admission.admit()
        released = []
        async with anyio.create_task_group() as tasks:
            async def finish_both():
                await anyio.sleep(0)  # the drain has started
                for cancellation in (first, second):
                    released.append(admission.in_flight)
                    admission.release(cancellation)
            tasks.start_soon(finish_both)
            ended = await admission.drain(grace=math.inf)
        return ended, released, admission.admit(), first.cancelled, second.cancelled

    ended, released, late, *cancelled = anyio.run(main)
    assert (ended, released, late, cancelled) == (0, [2, 1], None, [False, False])


def test_what_outlasts_the_grace_period_is_ended_with_shutting_down():
    async def main():
        admission = Admission()
        finished, running = admission.admit(), admission.admit()
        admission.release(finished)
        ended = await admission.drain(grace=0)
        return ended, finished, running

    ended, finished, running = anyio.run(main)
    assert ended == 1
    assert not finished.cancelled
    assert isinstance(running.error, ShuttingDown)
    assert str(running.error) == ("the server is shutting down: this generation outlasted its "
                                  "grace period (0 s)")


def test_a_second_signal_cuts_the_grace_period_short():
    async def main():
        admission = Admission()
        running = admission.admit()
        async with anyio.create_task_group() as tasks:
            async def second_sigterm():
                await anyio.sleep(0)
                admission.cut_short()
            tasks.start_soon(second_sigterm)
            ended = await admission.drain(grace=math.inf)
        return ended, running

    ended, running = anyio.run(main)
    assert ended == 1
    assert str(running.error) == "the server is shutting down: its grace period was cut short"


def test_each_request_gets_its_own_error():
    async def main():
        admission = Admission()
        requests = [admission.admit() for _ in range(3)]
        return await admission.end_all(), requests

    ended, requests = anyio.run(main)
    assert ended == 3
    assert len({id(request.error) for request in requests}) == 3


@pytest.mark.parametrize("text", ["-1", "nan", "soon", ""])
def test_a_grace_period_is_seconds_at_least_0(text):
    with pytest.raises(ValueError, match="shutdown grace period"):
        grace_seconds(text)
