"""A request's cancellation: the handle itself, a stream that ends with it, and handle()
honouring it, queued or running, on the tiny model (what ``djl-stream serve`` does when
a client leaves, or when its shutdown's grace period ends)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from test_service import body_json, init, load_entry_point, request, variant_dir

from djl_stream.generation.errors import ShuttingDown
from djl_stream.generation.scheduler import SchedulerObserver, add_observer, remove_observer
from djl_stream.serving.cancellation import (Cancellation, CancellableStream,
                                             attach_cancellation, cancellation_of)
from djl_stream.serving.inputs import Input

DEADLINE = 60.0


def scheduler_of(module):
    """The continuous-batching scheduler of the engine that module's service loaded."""
    return module._service.engine.scheduler


def wait_until(condition, what: str) -> None:
    """A deadline, not a speed target."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


# -- the handle -----------------------------------------------------------------------------

def test_callbacks_run_once_and_the_first_cancel_decides_how():
    calls = []
    cancellation = Cancellation()
    cancellation.on_cancel(lambda: calls.append("first"))
    cancellation.on_cancel(lambda: calls.append("second"))
    cancellation.cancel()
    cancellation.cancel(ShuttingDown("too late to say so"))
    assert calls == ["first", "second"]
    assert cancellation.client_left and cancellation.error is None


def test_a_callback_registered_after_the_cancel_runs_at_once_and_one_can_unregister():
    calls = []
    cancellation = Cancellation()
    forget = cancellation.on_cancel(lambda: calls.append("forgotten"))
    forget()
    cancellation.cancel(ShuttingDown("the server is shutting down"))
    cancellation.on_cancel(lambda: calls.append("late"))
    assert calls == ["late"]
    assert not cancellation.client_left


def test_a_failing_callback_does_not_keep_the_others_from_running():
    calls = []
    cancellation = Cancellation()
    cancellation.on_cancel(lambda: 1 / 0)
    cancellation.on_cancel(lambda: calls.append("still"))
    cancellation.cancel()
    assert calls == ["still"]


def test_only_the_server_attaches_one():
    assert cancellation_of(Input()) is None  # djl-serving's requests: nothing cancels them
    inp = Input().add_property("djl_stream_cancellation", "a header cannot forge it")
    assert cancellation_of(inp) is None
    cancellation = Cancellation()
    assert cancellation_of(attach_cancellation(inp, cancellation)) is cancellation


# -- a stream that ends with it --------------------------------------------------------------

def test_a_plain_generator_mid_step_stops_at_its_next_step():
    in_step, release = threading.Event(), threading.Event()

    def steps():
        for i in range(100):
            if i == 1:
                in_step.set()
                release.wait(DEADLINE)
            yield [str(i)]

    cancellation = Cancellation()
    stream = CancellableStream(steps(), cancellation)
    got = [next(stream)]
    reader = threading.Thread(target=lambda: got.extend(stream))
    reader.start()
    in_step.wait(DEADLINE)
    cancellation.cancel()  # generator.close() cannot run now: it is executing
    release.set()
    reader.join(DEADLINE)
    assert got == [["0"], ["1"]]  # the step in flight, then nothing


# -- handle() honouring it -------------------------------------------------------------------

def cancellable_request(module, body, cancellation):
    inp = Input(properties={"content-type": "application/json"}).add("data", json.dumps(body))
    return module.handle(attach_cancellation(inp, cancellation))


@pytest.fixture(scope="module")
def one_row(tmp_path_factory, tiny_model_dir):
    """The tiny model with room for one request at a time in its batch."""
    directory = variant_dir(tmp_path_factory.mktemp("one-row"), tiny_model_dir, "",
                            "option.max_rolling_batch_size=1\noption.max_new_tokens_limit=1000\n")
    return init(load_entry_point(directory), directory)


class Admissions(SchedulerObserver):
    """Every request admitted to a batch (its prefill runs next), by prompt length."""

    def __init__(self) -> None:
        self.prompt_tokens: list[int] = []

    def request_admitted(self, stats) -> None:
        self.prompt_tokens.append(stats.prompt_tokens)


def test_a_request_cancelled_while_queued_is_never_prefilled(one_row, smollm2_tokenizer):
    scheduler = scheduler_of(one_row)
    admissions = Admissions()
    add_observer(admissions)
    try:
        holder = request(one_row, {"inputs": "Hello", "parameters": {
            "max_new_tokens": 1000, "ignore_eos": True}})
        assert holder.code == 200  # it runs: the one row is taken
        cancellation, answers = Cancellation(), {}
        waiting = "A much longer prompt that waits for its turn"
        asker = threading.Thread(target=lambda: answers.update(out=cancellable_request(
            one_row, {"inputs": waiting, "stream": False}, cancellation)))
        asker.start()
        wait_until(lambda: scheduler.waiting_size == 1, "the second request never queued")
        cancellation.cancel()
        asker.join(DEADLINE)
        assert answers["out"].code == 499  # nobody reads it: the server sends nothing
        assert scheduler.waiting_size == 0 and scheduler.running_size == 1
        holder.stream_content.close()
        wait_until(lambda: scheduler.running_size == 0, "the holder never left")
    finally:
        remove_observer(admissions)
    assert admissions.prompt_tokens == [len(smollm2_tokenizer("Hello")["input_ids"])]


def cancel_a_running_whole_answer(handler, error=None):
    """A non-streaming request of 1000 tokens, cancelled (with ``error``) once it runs;
    what ``handle()`` answers."""
    scheduler = scheduler_of(handler)
    cancellation, answers = Cancellation(), {}
    asker = threading.Thread(target=lambda: answers.update(out=cancellable_request(
        handler, {"inputs": "Hello", "stream": False,
                  "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}, cancellation)))
    asker.start()
    wait_until(lambda: scheduler.running_size == 1, "the request never ran")
    cancellation.cancel(error)
    asker.join(DEADLINE)
    return answers["out"]


def test_a_running_non_streaming_request_stops_when_its_client_leaves(one_row):
    assert cancel_a_running_whole_answer(one_row).code == 499
    wait_until(lambda: scheduler_of(one_row).running_size == 0,
               "the request never left the batch")


def test_the_shutting_down_server_ends_a_stream_with_its_error_record(one_row):
    cancellation = Cancellation()
    out = cancellable_request(one_row, {"inputs": "Hello", "stream": True, "parameters": {
        "max_new_tokens": 1000, "ignore_eos": True}}, cancellation)
    items = iter(out.stream_content)
    first = json.loads(next(items))
    cancellation.cancel(ShuttingDown("the server is shutting down"))
    rest = [json.loads(item) for item in items]
    assert "output_tokens" in first and all("output_tokens" in r for r in rest[:-1])
    assert rest[-1] == {"error": "ShuttingDown: the server is shutting down"}
    assert len(rest) < 1000


def test_the_shutting_down_server_answers_an_unfinished_whole_answer_503(one_row):
    out = cancel_a_running_whole_answer(one_row, ShuttingDown("the server is shutting down"))
    assert out.code == 503
    assert body_json(out) == {"code": 503, "type": "ServiceUnavailableException",
                              "message": "the server is shutting down"}
