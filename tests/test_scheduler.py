"""Continuous batching: requests join and leave the running batch without changing results."""

from __future__ import annotations

import threading
import time

import pytest

from djl_stream.generation import batch as batch_module
from djl_stream.generation.engines.accelerate import build_sequences, encode_prompts
from djl_stream.generation.errors import GenerationFailed, QueueFullError
from djl_stream.generation.scheduler import Scheduler
from djl_stream.runtime.runner import ForwardRunner, RunnerSettings, load_runner

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog and keeps running",
    "Colours of the rainbow",
    "One two three four five",
]

#: Positions a row may reach in these tests (the tiny model takes 1024).
MAX_POSITIONS = 1024


def tiny_runner(model, rows: int = 32):
    """The tiny Llama's runner: the fast path (one forward pass over every feed) where
    this transformers has the attention interface, the model's forward otherwise."""
    return load_runner(model, RunnerSettings(max_rows=rows, max_positions=MAX_POSITIONS))


@pytest.fixture()
def make_scheduler(tiny_model):
    schedulers = []

    def make(runner=None, **settings):
        # Pass widths sized by the token budget alone: the stall bound times passes on
        # the real clock, so widths would depend on this machine's speed (the bound's
        # own tests drive it with a simulated clock).
        settings.setdefault("prefill_stall_steps", 0)
        if runner is None:
            runner = tiny_runner(tiny_model, settings.get("max_batch_size", 32))
        schedulers.append(Scheduler(runner, **settings))
        return schedulers[-1]
    yield make
    for scheduler in schedulers:
        scheduler.shutdown()


def sequences(model, tokenizer, prompts, **parameters):
    return build_sequences(model, tokenizer, encode_prompts(tokenizer, prompts), **parameters)


def collect(stream):
    texts = None
    steps = 0
    for pieces in stream:
        texts = [""] * len(pieces) if texts is None else texts
        for i, piece in enumerate(pieces):
            texts[i] += piece
        steps += 1
    return texts, steps


class Passes:
    """Every pass a runner runs, recorded by wrapping its ``run``: ``seen`` holds one list
    of ``(handle, tokens fed, positions cached before, logits wanted)`` per pass, ``ok``
    whether each pass returned (a pass that raised did not).

    ``fail_when(feeds)``, given a pass's record, says whether the model's forward fails
    in that pass: a real forward pre-hook on the model raises then, inside the runner's
    pass (as a device failure would)."""

    def __init__(self, runner, fail_when=None):
        self.seen: list[list[tuple]] = []
        self.ok: list[bool] = []
        self._runner = runner
        real = runner.run

        def run(feeds):
            self.seen.append([(f.handle, len(f.tokens), runner.length(f.handle), f.logits)
                              for f in feeds])
            try:
                logits = real(feeds)
            except BaseException:
                self.ok.append(False)
                raise
            self.ok.append(True)
            return logits

        runner.run = run
        self.fail_when = fail_when
        self._hook = None
        if fail_when is not None:
            self._hook = runner.model.register_forward_pre_hook(self._maybe_fail)

    def _maybe_fail(self, module, args):
        if self.seen and self.fail_when(self.seen[-1]):
            raise RuntimeError("simulated device failure")

    @property
    def rows(self) -> list[int]:
        """Feeds (rows) of each pass."""
        return [len(feeds) for feeds in self.seen]

    @property
    def widths(self) -> list[int]:
        """The most tokens one feed of each pass carried."""
        return [max(n for _, n, _, _ in feeds) for feeds in self.seen]

    def remove(self) -> None:
        del self._runner.run  # (the instance attribute: the class's method again)
        if self._hook is not None:
            self._hook.remove()


def is_decode_step(feeds) -> bool:
    """Every feed is one token of a row whose cache holds its prompt: a decode step."""
    return all(n == 1 and cached > 0 for _, n, cached, _ in feeds)


def is_prefill(feeds) -> bool:
    """Some feed reads a prompt (more than one token, or a row's first)."""
    return any(n > 1 or cached == 0 for _, n, cached, _ in feeds)


def solo_texts(make_scheduler, model, tokenizer, prompts, **parameters):
    scheduler = make_scheduler()
    return [collect(scheduler.submit(sequences(model, tokenizer, [p], **parameters)))[0][0] for p in prompts]


def test_staggered_arrivals_give_each_request_its_solo_text(make_scheduler, tiny_model, smollm2_tokenizer):
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=20)
    scheduler = make_scheduler()
    results: dict[int, str] = {}
    passes = Passes(scheduler.runner)

    def client(index, delay_passes):
        # wait until the batch has run `delay_passes` forward passes, then arrive
        while len(passes.seen) < delay_passes:
            time.sleep(0.001)
        stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[index]], max_new_tokens=20))
        results[index] = collect(stream)[0][0]

    threads = [threading.Thread(target=client, args=(i, delay)) for i, delay in enumerate([0, 3, 7, 12])]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        passes.remove()
    assert [results[i] for i in range(len(PROMPTS))] == expected
    # they really shared decode steps: some pass fed several requests' rows at once
    assert any(rows > 1 for rows, feeds in zip(passes.rows, passes.seen) if is_decode_step(feeds))


def test_a_request_with_several_prompts_and_a_late_one_share_the_batch(make_scheduler, tiny_model, smollm2_tokenizer):
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=12)
    scheduler = make_scheduler()
    first = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, PROMPTS[:3], max_new_tokens=12))
    next(first)
    late = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, PROMPTS[3:], max_new_tokens=12))
    late_text = collect(late)[0]
    rest = collect(first)[0]
    assert late_text == expected[3:]
    # `first` lost its first item to next(); the rest must still be its solo suffixes
    assert all(e.endswith(r) for e, r in zip(expected[:3], rest))


def test_seeded_sampling_is_the_same_alone_and_batched(make_scheduler, tiny_model, smollm2_tokenizer):
    sampling = dict(max_new_tokens=12, do_sample=True, temperature=1.3, top_p=0.9, manual_seed=11)
    alone = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, [PROMPTS[1]], **sampling)[0]
    scheduler = make_scheduler()
    other = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=30,
                                       do_sample=True, temperature=1.0))
    next(other)
    seeded = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[1]], **sampling))
    assert collect(seeded)[0][0] == alone
    other.close()


def test_the_running_batch_never_exceeds_max_batch_size(make_scheduler, tiny_model, smollm2_tokenizer):
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=8)
    scheduler = make_scheduler(max_batch_size=2)
    passes = Passes(scheduler.runner)
    try:
        streams = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p], max_new_tokens=8)) for p in PROMPTS]
        texts = [collect(s)[0][0] for s in streams]
    finally:
        passes.remove()
    assert texts == expected
    # a pass feeds the running rows and the rows being read: two at most, two at times
    assert max(passes.rows) == 2
    with pytest.raises(ValueError, match="max_rolling_batch_size"):
        scheduler.submit(sequences(tiny_model, smollm2_tokenizer, PROMPTS[:3], max_new_tokens=2))


def test_a_full_queue_refuses_new_requests(make_scheduler, tiny_model, smollm2_tokenizer):
    scheduler = make_scheduler(max_batch_size=1, max_queue=1)
    running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=500))
    next(running)  # admitted: the batch is now full
    waiting = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[1]], max_new_tokens=2))
    with pytest.raises(QueueFullError, match="job_queue_size"):
        scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[2]], max_new_tokens=2))
    running.close()
    assert collect(waiting)[1] == 2  # the waiting request runs once there is room


def test_closed_streams_leave_the_batch(make_scheduler, tiny_model, smollm2_tokenizer):
    scheduler = make_scheduler()
    streams = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p], max_new_tokens=1000)) for p in PROMPTS]
    for s in streams:
        next(s)
    deadline = time.monotonic() + 10
    # a prefilled request joins the running batch just after its first item is sent
    while scheduler.running_size != len(PROMPTS) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert scheduler.running_size == len(PROMPTS)
    streams[0].close()
    streams[2].close()
    while scheduler.running_size != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running_size == 2
    for s in (streams[1], streams[3]):
        s.close()
    while scheduler.running_size and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running_size == 0
    # and their KV-cache rows are free again
    while scheduler.runner.handles() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.runner.handles() == [] and scheduler.runner.tokens_held == 0


def test_a_failing_prefill_fails_only_its_request(make_scheduler, tiny_model, smollm2_tokenizer):
    # The fast path feeds every row's tokens as one (1, T) sequence: the hook raises in
    # any pass that reads the poisoned prompt, whether alone or beside the running
    # stream's decode step (a mixed pass, which the scheduler then runs apart).
    poison = smollm2_tokenizer("Poison")["input_ids"][-1]
    scheduler = make_scheduler()
    healthy = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[1]], max_new_tokens=30))
    next(healthy)

    def fail_when(module, args, kwargs):
        ids = kwargs["input_ids"]
        if bool((ids == poison).any()) and ids.shape[1] > 1:
            raise RuntimeError("simulated device failure")

    hook = tiny_model.register_forward_pre_hook(fail_when, with_kwargs=True)
    try:
        doomed = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Poison"], max_new_tokens=5))
        with pytest.raises(GenerationFailed, match="simulated device failure"):
            next(doomed)
        assert collect(healthy)[1] == 29
    finally:
        hook.remove()


def test_a_decode_step_that_fails_once_is_retried_apart_and_both_go_on(make_scheduler, tiny_model, smollm2_tokenizer):
    # A failure nobody caused (the device hiccuped): each request runs its step alone,
    # then they share the batch again, and each ends with its solo text.
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS[:2], max_new_tokens=10)
    scheduler = make_scheduler()
    fail = {"armed": True}

    def fail_once_in_decode(feeds):
        if fail["armed"] and len(feeds) == 2 and is_decode_step(feeds):
            fail["armed"] = False
            return True
        return False

    passes = Passes(scheduler.runner, fail_when=fail_once_in_decode)
    try:
        both = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p], max_new_tokens=10)) for p in PROMPTS[:2]]
        assert [collect(stream)[0][0] for stream in both] == expected
        assert not fail["armed"]  # the failure happened
        failed = passes.ok.index(False)
        assert passes.rows[failed] == 2 and is_decode_step(passes.seen[failed])
        after_failure = passes.seen[failed + 1:failed + 3]
        assert [len(feeds) for feeds in after_failure] == [1, 1]  # each alone
        assert {feeds[0][0] for feeds in after_failure} == {h for h, *_ in passes.seen[failed]}
        assert 2 in passes.rows[failed + 3:]  # then side by side again
        assert all(passes.ok[failed + 1:])
        after = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[2]], max_new_tokens=4))
        assert collect(after)[1] == 4
    finally:
        passes.remove()
    assert scheduler.running_size == 0


def test_shutdown_ends_requests_in_flight_with_an_error(make_scheduler, tiny_model, smollm2_tokenizer):
    scheduler = make_scheduler()
    stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=1000))
    next(stream)
    scheduler.shutdown()
    with pytest.raises(GenerationFailed, match="shutting down"):
        collect(stream)


def test_a_request_cancelled_behind_a_waiting_one_leaves_the_queue_at_once(make_scheduler, tiny_model, smollm2_tokenizer):
    # The head of the queue (two prompts) waits for room, and nothing overtakes it; a
    # request behind it whose stream is closed must not wait with it, nor ever be admitted.
    scheduler = make_scheduler(max_batch_size=2)
    running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=1000))
    next(running)  # one row of two is taken
    head = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, PROMPTS[1:3], max_new_tokens=2))
    behind = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[3]], max_new_tokens=2))
    assert scheduler.waiting_size == 2
    behind.close()
    deadline = time.monotonic() + 60
    while scheduler.waiting_size == 2:
        assert time.monotonic() < deadline, "the closed request stayed in the queue"
        time.sleep(0.005)
    assert scheduler.waiting_size == 1 and scheduler.running_size == 1  # `running` goes on
    assert list(behind) == []
    running.close()
    assert collect(head)[1] == 2


def beside_a_stream(scheduler, model, tokenizer, running_prompts, late_prompt):
    """Run ``late_prompt`` (6 new tokens) to its end while a request of ``running_prompts``
    decodes on; return the running request's stream (closed) and the late sequences."""
    running = scheduler.submit(sequences(model, tokenizer, running_prompts,
                                         max_new_tokens=100_000, ignore_eos=True))
    next(running)
    late = sequences(model, tokenizer, [late_prompt], max_new_tokens=6)
    collect(scheduler.submit(late))
    running.close()
    return running, late


def join_passes(make_scheduler, tiny_model, tokenizer, running_prompt, late_prompt):
    """The feeds of every pass while ``late_prompt`` joins a stream of ``running_prompt``,
    from the late prompt's prefill pass on, as (tokens, cached before) per feed; and
    whether the late request generated its solo text.

    On a runner that runs no mixed passes (the model's own forward per sequence: a model
    off the fast path), where a prompt is read in a pass of its own and then joins the
    running batch."""
    scheduler = make_scheduler(runner=ForwardRunner(tiny_model, "joins without mixed passes"))
    passes = Passes(scheduler.runner)
    try:
        late_seqs = beside_a_stream(scheduler, tiny_model, tokenizer, [running_prompt],
                                    late_prompt)[1]
    finally:
        passes.remove()
    seen = [[(n, cached) for _, n, cached, _ in feeds] for feeds in passes.seen]
    prefill = max(i for i, feeds in enumerate(passes.seen) if is_prefill(feeds))
    assert seen[prefill] == [(len(late_seqs[0].prompt_ids), 0)]  # the late prompt alone
    solo = sequences(tiny_model, tokenizer, [late_prompt], max_new_tokens=6)
    collect(make_scheduler(runner=ForwardRunner(tiny_model, "solo")).submit(solo))
    return seen[prefill:], late_seqs[0].generated_ids == solo[0].generated_ids


def test_a_finished_prefill_longer_than_the_running_rows_joins_after_they_stepped_once(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # A cycle is a prefill pass then a decode step. Joined at once, the decode step that
    # follows the prefill's last pass would run the joined (heavier) batch, and a running
    # stream would wait for both; the join waits for the next cycle, which reads no chunk.
    passes, solo_text = join_passes(make_scheduler, tiny_model, smollm2_tokenizer,
                                    PROMPTS[0], PROMPTS[1])
    assert [n for n, _ in passes[1]] == [1]  # the running stream's own step
    assert [n for n, _ in passes[2]] == [1, 1]  # then together
    assert solo_text


def test_a_finished_prefill_no_longer_than_the_running_rows_joins_at_once(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # Its rows add no columns to the running rows' step: waiting a cycle would cost each
    # short prompt a whole decode step.
    passes, solo_text = join_passes(make_scheduler, tiny_model, smollm2_tokenizer,
                                    PROMPTS[1], PROMPTS[2])
    assert [n for n, _ in passes[1]] == [1, 1]
    assert solo_text


@pytest.mark.fast_path
def test_a_prompt_read_beside_a_stream_shares_its_step_and_joins_it_at_once(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # On the fast path, a prompt arriving while a stream decodes is read in the pass of
    # the stream's step (a mixed pass: the weights read once for both), and the next pass
    # is their shared decode step, whatever the prompt's length.
    scheduler = make_scheduler()
    passes = Passes(scheduler.runner)
    try:
        _, late = beside_a_stream(scheduler, tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                                  PROMPTS[1])
    finally:
        passes.remove()
    prefill = max(i for i, feeds in enumerate(passes.seen) if is_prefill(feeds))
    seen = [[(n, cached > 0) for _, n, cached, _ in feeds] for feeds in passes.seen]
    assert seen[prefill] == [(1, True), (len(late[0].prompt_ids), False)]
    assert seen[prefill + 1] == [(1, True), (1, True)]
    assert_solo_text(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS[1], late)


LONG_PROMPT = " ".join(PROMPTS * 3)


def reading_in_mixed_passes(make_scheduler, monkeypatch, mixed_pass):
    """A scheduler reading prefill chunks of 8 tokens (a long prompt beside a stream is
    read in mixed passes, each through ``mixed_pass``, which must call the real one)."""
    from djl_stream.generation import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "mixed_pass", mixed_pass)
    scheduler = make_scheduler(max_batch_prefill_tokens=8, max_batch_size=4)
    assert scheduler.runner.mixes_passes
    return scheduler


def assert_solo_text(make_scheduler, model, tokenizer, prompt, served):
    solo = sequences(model, tokenizer, [prompt], max_new_tokens=6)
    collect(make_scheduler().submit(solo))
    assert served[0].generated_ids == solo[0].generated_ids


@pytest.mark.fast_path
def test_a_long_prompt_beside_a_stream_is_read_in_mixed_passes(
        make_scheduler, tiny_model, smollm2_tokenizer, monkeypatch):
    # A long prompt is read in chunks that each share a pass with the running rows'
    # decode step, and generates its solo text.
    mixed = []

    def counted_mixed_pass(*args):
        mixed.append(args[3])
        return batch_module.mixed_pass(*args)

    scheduler = reading_in_mixed_passes(make_scheduler, monkeypatch, counted_mixed_pass)
    _, late = beside_a_stream(scheduler, tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                              LONG_PROMPT)
    monkeypatch.undo()
    reused = scheduler.runner.tokens_reused  # (where it began as the running prompt did)
    assert len(mixed) >= 3 and sum(mixed) + reused == len(late[0].prompt_ids)  # all mixed
    assert_solo_text(make_scheduler, tiny_model, smollm2_tokenizer, LONG_PROMPT, late)


@pytest.mark.fast_path
def test_a_prompt_whose_running_neighbour_ends_during_its_prefill_is_served(
        make_scheduler, tiny_model, smollm2_tokenizer, monkeypatch):
    # The running request is cancelled after the first mixed pass of a long prompt: the
    # prompt's other chunks are read alone, and it generates its solo text.
    passes = []

    def mixed_pass_then_cancel(*args):
        result = batch_module.mixed_pass(*args)
        passes.append(args[3])
        if len(passes) == 1:
            running.close()
        return result

    scheduler = reading_in_mixed_passes(make_scheduler, monkeypatch, mixed_pass_then_cancel)
    running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                                         max_new_tokens=100_000, ignore_eos=True))
    next(running)
    late = sequences(tiny_model, smollm2_tokenizer, [LONG_PROMPT], max_new_tokens=6)
    collect(scheduler.submit(late))
    monkeypatch.undo()
    assert len(passes) == 1 and passes[0] < len(late[0].prompt_ids)  # one mixed pass, then alone
    assert_solo_text(make_scheduler, tiny_model, smollm2_tokenizer, LONG_PROMPT, late)


def test_a_failure_while_a_prefill_joins_fails_its_request_instead_of_losing_it(
        make_scheduler, tiny_model, smollm2_tokenizer, monkeypatch):
    # A bug raising at the join (the prefill has left the prefill queue, and is not in the
    # running batch yet) reaches the loop's safety net, which failed the requests of the
    # batches it knew: the newcomer waited forever. Every admitted request fails now,
    # and the scheduler serves the next.
    from djl_stream.generation import scheduler as scheduler_module

    def broken_join(batches):
        raise RuntimeError("a bug at the join")

    scheduler = make_scheduler()
    running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[1]],
                                         max_new_tokens=100_000, ignore_eos=True))
    next(running)
    monkeypatch.setattr(scheduler_module.CausalLMBatch, "concatenate", broken_join)
    # (read beside the running row's step: it joins in the cycle of its prefill)
    late = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[2]],
                                      max_new_tokens=4))
    outcomes = {}

    def drain(name, stream):
        try:
            collect(stream)
            outcomes[name] = "finished"
        except GenerationFailed as failure:
            outcomes[name] = str(failure)

    drains = [threading.Thread(target=drain, args=item, daemon=True)
              for item in (("late", late), ("running", running))]
    for thread in drains:
        thread.start()
    for thread in drains:
        thread.join(120)  # (before the fix, the late request's stream never ended)
    assert set(outcomes) == {"late", "running"}
    assert all("a bug at the join" in outcome for outcome in outcomes.values())
    monkeypatch.undo()
    after = sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=3)
    collect(scheduler.submit(after))
    assert len(after[0].generated_ids) == 3


@pytest.mark.fast_path
def test_a_prompt_arriving_as_the_only_running_request_is_cancelled_is_served(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # The next cycle's prefill finds the running batch holding only a cancelled request:
    # dropping it leaves no running batch, and the prefill must go on alone (a mixed pass
    # with no running batch failed once: a 424 for the newcomer).
    in_step, release = threading.Event(), threading.Event()

    def hold_a_decode_step(module, args, kwargs):
        # the running request's decode step: one token past its prompt
        if int(kwargs["position_ids"].min()) > 0 and not release.is_set():
            in_step.set()
            assert release.wait(30)

    scheduler = make_scheduler()
    handle = tiny_model.register_forward_pre_hook(hold_a_decode_step, with_kwargs=True)
    try:
        running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                                             max_new_tokens=100_000, ignore_eos=True))
        assert in_step.wait(30)  # the loop is inside the running request's decode step
        late = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[2]],
                                          max_new_tokens=4, ignore_eos=True))
        running.close()
        release.set()
        texts, _ = collect(late)
    finally:
        release.set()
        handle.remove()
    assert texts is not None and late.sequences[0].finished
    assert len(late.sequences[0].generated_ids) == 4


def test_a_shut_down_scheduler_s_thread_ends_and_another_serves_the_model(smollm2_tokenizer):
    # A scheduler's thread (and the OpenMP pool it holds) must be gone once it is shut
    # down; a new scheduler on the same model serves it as before.
    from conftest import build_tiny_llama
    from djl_stream.generation.sequence import GenerationSequence

    model = build_tiny_llama(len(smollm2_tokenizer), seed=21)

    def tokens(scheduler):
        seq = GenerationSequence(0, [1, 2, 3], smollm2_tokenizer, max_new_tokens=4,
                                 eos_token_ids=set(), ignore_eos=True)
        for _ in scheduler.submit([seq]):
            pass
        return seq.generated_ids

    first = Scheduler(tiny_runner(model, 4))
    expected = tokens(first)
    first.shutdown()
    assert not first._thread.is_alive()
    second = Scheduler(tiny_runner(model, 4))
    assert tokens(second) == expected
    second.shutdown()
    second.shutdown()  # already stopped: nothing to do
    assert not second._thread.is_alive()
