"""What the scheduler tells its observers: each request's timeline and tokens, and the load.

The figures are checked against what the streams themselves carried (every ``Step`` holds
the ``Generation`` of each prompt that advanced), never against a clock.
"""

from __future__ import annotations

import threading

import pytest

from djl_stream.generation.engines.accelerate import build_sequences, encode_prompts
from djl_stream.generation.errors import GenerationFailed
from djl_stream.generation.scheduler import (CANCELLED, FAILED, FINISHED, BatchState,
                                             RequestStats, Scheduler, SchedulerObserver,
                                             add_observer, remove_observer)
from djl_stream.runtime.runner import RunnerSettings, load_runner


def runner_of(model, rows: int = 32):
    return load_runner(model, RunnerSettings(max_rows=rows, max_positions=512))


class Recorder(SchedulerObserver):
    """Every event, in order, and each request's stats."""

    def __init__(self):
        self.events: list[tuple] = []
        self.states: list[BatchState] = []
        self.stats: dict[int, RequestStats] = {}
        self.changed = threading.Condition()

    def _record(self, *event):
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def request_submitted(self, stats):
        self.stats[stats.request_id] = stats
        self._record("submitted", stats.request_id)

    def request_admitted(self, stats):
        self._record("admitted", stats.request_id)

    def request_advanced(self, stats, tokens, interval):
        self._record("advanced", stats.request_id, tokens, interval)

    def request_ended(self, stats):
        self._record("ended", stats.request_id, stats.outcome)

    def batch_changed(self, state):
        with self.changed:
            self.states.append(state)
            self.changed.notify_all()

    def of(self, request_id):
        return [e for e in self.events if e[1] == request_id]

    def wait(self, condition, timeout=60.0):
        """Block until ``condition()`` holds (a deadline, not a speed assumption)."""
        with self.changed:
            assert self.changed.wait_for(condition, timeout), (self.events, self.states[-3:])


@pytest.fixture()
def recorder():
    return Recorder()


@pytest.fixture()
def scheduler(tiny_model, recorder):
    scheduler = Scheduler(runner_of(tiny_model), observers=[recorder])
    yield scheduler
    scheduler.shutdown()


def sequences(model, tokenizer, prompts, **parameters):
    return build_sequences(model, tokenizer, encode_prompts(tokenizer, prompts), **parameters)


def test_a_request_is_submitted_admitted_advanced_and_ended_in_that_order(
        scheduler, recorder, tiny_model, smollm2_tokenizer):
    prompts = ["Hi", "The quick brown fox"]
    stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, prompts, max_new_tokens=6))
    steps = list(stream)
    request_id = stream.sequences[0].request_id[0]
    events = recorder.of(request_id)

    assert [e[0] for e in events] == ["submitted", "admitted"] + ["advanced"] * len(steps) + ["ended"]
    assert events[-1][2] == FINISHED
    # one advance per step the stream carried, with as many tokens as it had generations
    carried = [sum(g is not None for g in step.generations) for step in steps]
    assert [e[2] for e in events if e[0] == "advanced"] == carried
    intervals = [e[3] for e in events if e[0] == "advanced"]
    assert intervals[0] is None and all(i is not None and i >= 0 for i in intervals[1:])

    stats = recorder.stats[request_id]
    assert stats.outcome == FINISHED
    assert stats.generated_tokens == sum(carried)
    assert stats.steps == len(steps)
    assert stats.prompts == 2
    assert stats.prompt_tokens == sum(len(ids) for ids in encode_prompts(smollm2_tokenizer, prompts))
    assert 0 <= stats.queue_time <= stats.time_to_first_token <= stats.e2e_latency
    assert stats.mean_inter_token_latency == pytest.approx(sum(intervals[1:]) / (len(steps) - 1))


def test_a_prompt_that_begins_as_a_finished_one_did_counts_the_tokens_it_reused(
        scheduler, recorder, tiny_model, smollm2_tokenizer):
    first = sequences(tiny_model, smollm2_tokenizer, ["The quick brown fox"], max_new_tokens=4)
    list(scheduler.submit(first))
    fed = list(first[0].prompt_ids) + first[0].generated_ids[:-1]  # (its last is not fed)
    turn = fed + first[0].generated_ids[-1:] + encode_prompts(smollm2_tokenizer, [" and then"])[0]
    follow_up = build_sequences(tiny_model, smollm2_tokenizer, [turn], max_new_tokens=4)
    stream = scheduler.submit(follow_up)
    list(stream)
    stats = [recorder.stats[seqs[0].request_id[0]] for seqs in (first, follow_up)]
    assert [s.reused_prompt_tokens for s in stats] == [0, len(fed)]


def test_the_load_follows_the_batch_and_returns_to_idle(scheduler, recorder, tiny_model, smollm2_tokenizer):
    prompts = ["Hi", "The quick brown fox"]
    prompt_tokens = sum(len(ids) for ids in encode_prompts(smollm2_tokenizer, prompts))
    list(scheduler.submit(sequences(tiny_model, smollm2_tokenizer, prompts, max_new_tokens=6,
                                    ignore_eos=True)))
    recorder.wait(lambda: recorder.states[-1] == BatchState())

    states = recorder.states
    assert BatchState(running_rows=0, waiting_requests=1, kv_cache_tokens=0) in states  # queued
    running = [s for s in states if s.running_rows]
    assert running and all(s.waiting_requests == 0 for s in running)
    assert all(s.running_rows == 2 for s in running)
    # each row's cache holds its own positions, no padding: the first cycle reads the two
    # prompts and takes their first decode step, and each cycle after adds one position
    # per row; the sixth token's step ends both rows (none running then)
    assert [s.kv_cache_tokens for s in running] == [prompt_tokens + 2 * step
                                                    for step in range(1, 5)]


def test_a_stream_closed_while_running_ends_cancelled(scheduler, recorder, tiny_model, smollm2_tokenizer):
    stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Hello"], max_new_tokens=200))
    next(stream)
    stream.close()
    request_id = stream.sequences[0].request_id[0]
    recorder.wait(lambda: ("ended", request_id, CANCELLED) in recorder.events)
    stats = recorder.stats[request_id]
    assert stats.outcome == CANCELLED
    assert 1 <= stats.generated_tokens < 200
    assert stats.e2e_latency is not None
    recorder.wait(lambda: recorder.states[-1] == BatchState())


class Gate(SchedulerObserver):
    """Holds the decode loop inside the first token of the first request until opened."""

    def __init__(self):
        self.reached = threading.Event()
        self.opened = threading.Event()

    def request_advanced(self, stats, tokens, interval):
        if interval is None and not self.reached.is_set():
            self.reached.set()
            assert self.opened.wait(60)


def test_a_stream_closed_while_waiting_ends_cancelled_without_being_admitted(
        tiny_model, smollm2_tokenizer, recorder):
    gate = Gate()
    scheduler = Scheduler(runner_of(tiny_model, 1), max_batch_size=1,
                          observers=[gate, recorder])
    try:
        running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Hello"], max_new_tokens=200))
        assert gate.reached.wait(60)  # the loop is inside the first request's prefill
        waiting = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Hi"], max_new_tokens=5))
        assert recorder.states[-1].waiting_requests == 1
        waiting.close()
        gate.opened.set()
        waiting_id = waiting.sequences[0].request_id[0]
        recorder.wait(lambda: ("ended", waiting_id, CANCELLED) in recorder.events)
        assert [e[0] for e in recorder.of(waiting_id)] == ["submitted", "ended"]
        stats = recorder.stats[waiting_id]
        assert stats.admitted_at is None and stats.queue_time is None
        assert stats.generated_tokens == 0
        running.close()
        recorder.wait(lambda: recorder.states[-1] == BatchState())
    finally:
        gate.opened.set()
        scheduler.shutdown()


def test_a_failing_step_ends_its_request_failed(scheduler, recorder, tiny_model, smollm2_tokenizer):
    def fail_in_decode(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            raise RuntimeError("simulated device failure")

    handle = tiny_model.register_forward_pre_hook(fail_in_decode, with_kwargs=True)
    try:
        stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Hello there"], max_new_tokens=5))
        with pytest.raises(GenerationFailed):
            list(stream)
    finally:
        handle.remove()
    request_id = stream.sequences[0].request_id[0]
    assert recorder.of(request_id)[-1] == ("ended", request_id, FAILED)
    assert recorder.stats[request_id].generated_tokens == 1  # the prefill's token


class Broken(SchedulerObserver):
    def request_advanced(self, stats, tokens, interval):
        raise RuntimeError("a buggy observer")

    def batch_changed(self, state):
        raise RuntimeError("a buggy observer")


def test_an_observer_that_raises_changes_nothing(tiny_model, smollm2_tokenizer, recorder):
    plain = Scheduler(runner_of(tiny_model), observers=[])
    watched = Scheduler(runner_of(tiny_model), observers=[Broken(), recorder])
    try:
        def text(scheduler):
            stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Colours"], max_new_tokens=8))
            return "".join(step[0] for step in stream)

        assert text(watched) == text(plain)
        assert [e[0] for e in recorder.events][-1] == "ended"
    finally:
        plain.shutdown()
        watched.shutdown()


def test_process_wide_observers_watch_schedulers_without_their_own(tiny_model, smollm2_tokenizer, recorder):
    add_observer(recorder)
    add_observer(recorder)  # once only
    scheduler = Scheduler(runner_of(tiny_model))
    try:
        stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Hi"], max_new_tokens=3))
        steps = list(stream)
        request_id = stream.sequences[0].request_id[0]
        assert [e[0] for e in recorder.of(request_id)].count("advanced") == len(steps)
    finally:
        remove_observer(recorder)
        scheduler.shutdown()
    count = len(recorder.events)
    other = Scheduler(runner_of(tiny_model))
    try:
        list(other.submit(sequences(tiny_model, smollm2_tokenizer, ["Hi"], max_new_tokens=3)))
        assert len(recorder.events) == count  # a removed observer hears nothing
    finally:
        other.shutdown()
