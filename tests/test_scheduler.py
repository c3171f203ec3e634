"""Continuous batching: requests join and leave the running batch without changing results."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from djl_stream.generation import batch as batch_module
from djl_stream.generation.engines.accelerate import build_sequences, encode_prompts
from djl_stream.generation.errors import GenerationFailed, QueueFullError
from djl_stream.generation.scheduler import Scheduler

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog and keeps running",
    "Colours of the rainbow",
    "One two three four five",
]


@pytest.fixture()
def make_scheduler(tiny_model):
    def make(**settings):
        # Pass widths sized by the token budget alone: the stall bound times passes on
        # the real clock, so widths would depend on this machine's speed (the bound's
        # own tests drive it with a simulated clock).
        settings.setdefault("prefill_stall_steps", 0)
        return Scheduler(tiny_model, pad_token_id=2, device="cpu", **settings)
    return make


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


class BatchSizes:
    """Batch size of every forward pass, recorded by a real forward hook."""

    def __init__(self, model, fail_when=None):
        self.sizes: list[int] = []
        self.widths: list[int] = []
        self.fail_when = fail_when
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        self.sizes.append(ids.shape[0])
        self.widths.append(ids.shape[1])
        if self.fail_when is not None and self.fail_when(ids):
            raise RuntimeError("simulated device failure")

    def remove(self):
        self._handle.remove()


def solo_texts(make_scheduler, model, tokenizer, prompts, **parameters):
    scheduler = make_scheduler()
    return [collect(scheduler.submit(sequences(model, tokenizer, [p], **parameters)))[0][0] for p in prompts]


def test_staggered_arrivals_give_each_request_its_solo_text(make_scheduler, tiny_model, smollm2_tokenizer):
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=20)
    scheduler = make_scheduler()
    results: dict[int, str] = {}
    recorder = BatchSizes(tiny_model)

    def client(index, delay_steps):
        # wait until the batch has run `delay_steps` forward passes, then arrive
        while len(recorder.sizes) < delay_steps:
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
        recorder.remove()
    assert [results[i] for i in range(len(PROMPTS))] == expected
    # they really shared decode steps: some forward pass ran several requests at once
    assert max(recorder.sizes) > 1


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
    recorder = BatchSizes(tiny_model)
    try:
        streams = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p], max_new_tokens=8)) for p in PROMPTS]
        texts = [collect(s)[0][0] for s in streams]
    finally:
        recorder.remove()
    assert texts == expected
    assert max(recorder.sizes) <= 2
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


def test_a_failing_prefill_fails_only_its_request(make_scheduler, tiny_model, smollm2_tokenizer):
    poison = smollm2_tokenizer("Poison")["input_ids"][-1]
    scheduler = make_scheduler()
    healthy = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[1]], max_new_tokens=30))
    next(healthy)
    recorder = BatchSizes(tiny_model, fail_when=lambda ids: bool((ids == poison).any()) and ids.shape[1] > 1)
    try:
        doomed = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Poison"], max_new_tokens=5))
        with pytest.raises(GenerationFailed, match="simulated device failure"):
            next(doomed)
        assert collect(healthy)[1] == 29
    finally:
        recorder.remove()


def test_a_decode_step_that_fails_once_is_retried_apart_and_both_go_on(make_scheduler, tiny_model, smollm2_tokenizer):
    # A failure nobody caused (the device hiccuped): each request runs its step alone,
    # then they share the batch again, and each ends with its solo text.
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS[:2], max_new_tokens=10)
    scheduler = make_scheduler()
    fail = {"armed": True}

    def fail_once_in_decode(ids):
        if fail["armed"] and ids.shape[0] == 2 and ids.shape[1] == 1:
            fail["armed"] = False
            return True
        return False

    recorder = BatchSizes(tiny_model, fail_when=fail_once_in_decode)
    try:
        both = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p], max_new_tokens=10)) for p in PROMPTS[:2]]
        assert [collect(stream)[0][0] for stream in both] == expected
        assert not fail["armed"]  # the failure happened
        failed = next(i for i, (size, width) in enumerate(zip(recorder.sizes, recorder.widths))
                      if (size, width) == (2, 1))
        assert recorder.sizes[failed + 1:failed + 3] == [1, 1]  # each alone
        assert 2 in recorder.sizes[failed + 3:]  # then side by side again
        after = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[2]], max_new_tokens=4))
        assert collect(after)[1] == 4
    finally:
        recorder.remove()
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
    """(rows, columns) of every forward pass while ``late_prompt`` joins a stream of
    ``running_prompt``, from the late prompt's last prefill pass on; and whether the late
    request generated its solo text."""
    scheduler = make_scheduler()
    forwards = BatchSizes(tiny_model)
    try:
        late_seqs = beside_a_stream(scheduler, tiny_model, tokenizer, [running_prompt],
                                    late_prompt)[1]
    finally:
        forwards.remove()
    passes = list(zip(forwards.sizes, forwards.widths))
    prefill = max(i for i, (_, width) in enumerate(passes) if width > 1)
    assert passes[prefill] == (1, len(late_seqs[0].prompt_ids))
    solo = sequences(tiny_model, tokenizer, [late_prompt], max_new_tokens=6)
    collect(make_scheduler().submit(solo))
    return passes[prefill:], late_seqs[0].generated_ids == solo[0].generated_ids


def test_a_finished_prefill_longer_than_the_running_rows_joins_after_they_stepped_once(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # A cycle is a prefill pass then a decode step. Joined at once, the decode step that
    # follows the prefill's last pass would run the joined (heavier) batch, and a running
    # stream would wait for both; the join waits for the next cycle, which reads no chunk.
    passes, solo_text = join_passes(make_scheduler, tiny_model, smollm2_tokenizer,
                                    PROMPTS[0], PROMPTS[1])
    assert passes[1] == (1, 1)  # the running stream's own step
    assert passes[2] == (2, 1)  # then together
    assert solo_text


def test_a_finished_prefill_no_longer_than_the_running_rows_joins_at_once(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # Its rows add no columns to the running rows' step: waiting a cycle would cost each
    # short prompt a whole decode step.
    passes, solo_text = join_passes(make_scheduler, tiny_model, smollm2_tokenizer,
                                    PROMPTS[1], PROMPTS[2])
    assert passes[1] == (2, 1)
    assert solo_text


def test_a_longer_prompt_joins_the_running_rows_in_their_own_cache(make_scheduler, tiny_model,
                                                                   smollm2_tokenizer):
    # On a CPU the running batch's cache reserves free rows and columns on the left: a
    # newcomer longer than the running rows is prefilled into them, and the running rows
    # stay in the cache they were decoding in (before slots, a longer newcomer's cache
    # took them in: a copy of every running row's cache at every such join).
    from djl_stream.runtime.forward_kwargs import cache_in

    decode_caches = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            decode_caches.append((kwargs["input_ids"].shape[0], id(cache_in(kwargs))))

    handle = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    scheduler = make_scheduler(max_batch_size=4)
    long_prompt = PROMPTS[1] + " " + PROMPTS[1]
    try:
        running, late = beside_a_stream(scheduler, tiny_model, smollm2_tokenizer, PROMPTS[1:],
                                        long_prompt)
    finally:
        handle.remove()
    assert len(late[0].prompt_ids) > max(len(seq.prompt_ids) for seq in running.sequences) + 4
    alone = {cache for rows, cache in decode_caches if rows == 3}
    together = {cache for rows, cache in decode_caches if rows == 4}
    assert together and together <= alone  # the running rows' own cache, throughout
    solo = sequences(tiny_model, smollm2_tokenizer, [long_prompt], max_new_tokens=6)
    collect(make_scheduler().submit(solo))
    assert late[0].generated_ids == solo[0].generated_ids


LONG_PROMPT = " ".join(PROMPTS * 3)


@contextlib.contextmanager
def reading_in_mixed_passes(make_scheduler, model, tokenizer, monkeypatch, mixed_pass,
                            **slab_methods):
    """A scheduler whose model runs djl-stream's Llama step, with prefill chunks of 8
    tokens (a long prompt beside a stream is read in mixed passes, each through
    ``mixed_pass``) and ``slab_methods`` replacing the KV-cache slab's; all undone after."""
    from djl_stream.generation import kv_cache, llama_decode
    from djl_stream.generation import scheduler as scheduler_module

    assert llama_decode.attach(model, tokenizer) is not None
    for name, method in slab_methods.items():
        monkeypatch.setattr(kv_cache._Slab, name, method)
    monkeypatch.setattr(scheduler_module, "mixed_pass", mixed_pass)
    try:
        yield make_scheduler(max_batch_prefill_tokens=8, max_batch_size=4)
    finally:
        monkeypatch.undo()
        llama_decode.detach(model)


def assert_solo_text(make_scheduler, model, tokenizer, prompt, served):
    solo = sequences(model, tokenizer, [prompt], max_new_tokens=6)
    collect(make_scheduler().submit(solo))
    assert served[0].generated_ids == solo[0].generated_ids


def test_a_prompt_read_in_mixed_passes_takes_its_slot_on_admission(
        make_scheduler, tiny_model, smollm2_tokenizer, monkeypatch):
    # With the Llama step, a long prompt is read in chunks that share passes with the
    # running rows' decode steps; its chunks are written into the running cache's free
    # rows, and its join copies nothing (any copy of rows at a join raises here).
    mixed = []

    def copying(*args):
        raise AssertionError("a join copied rows")

    def counted_mixed_pass(*args):
        mixed.append(args[3])
        return batch_module.mixed_pass(*args)

    with reading_in_mixed_passes(make_scheduler, tiny_model, smollm2_tokenizer, monkeypatch,
                                 counted_mixed_pass, take=copying) as scheduler:
        _, late = beside_a_stream(scheduler, tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                                  LONG_PROMPT)
    assert len(mixed) >= 3 and sum(mixed) == len(late[0].prompt_ids)  # all in mixed passes
    assert_solo_text(make_scheduler, tiny_model, smollm2_tokenizer, LONG_PROMPT, late)


def test_a_prompt_whose_lender_ends_during_its_prefill_moves_out_and_is_served(
        make_scheduler, tiny_model, smollm2_tokenizer, monkeypatch):
    # The running request is cancelled after the first mixed pass of a long prompt
    # written into its cache's lent rows: the prompt goes on alone, copying what it holds
    # into buffers of its own (the gone cache's buffers are not kept), and generates its
    # solo text.
    from djl_stream.generation import kv_cache

    moved, passes = [], []
    copy_to_own_buffers = kv_cache._Slab.copy_to_own_buffers

    def counted_copy(slab):
        moved.append(slab)
        copy_to_own_buffers(slab)

    def mixed_pass_then_cancel(*args):
        result = batch_module.mixed_pass(*args)
        passes.append(args[3])
        if len(passes) == 1:
            running.close()
        return result

    with reading_in_mixed_passes(make_scheduler, tiny_model, smollm2_tokenizer, monkeypatch,
                                 mixed_pass_then_cancel,
                                 copy_to_own_buffers=counted_copy) as scheduler:
        running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                                             max_new_tokens=100_000, ignore_eos=True))
        next(running)
        late = sequences(tiny_model, smollm2_tokenizer, [LONG_PROMPT], max_new_tokens=6)
        collect(scheduler.submit(late))
    assert len(passes) == 1 and moved  # one mixed pass, then alone in its own buffers
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
    # (shorter than the running row: it joins in the cycle of its prefill)
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


def test_a_prompt_arriving_as_the_only_running_request_is_cancelled_is_served(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # The next cycle's prefill finds the running batch holding only a cancelled request:
    # dropping it leaves no running batch, and the prefill must go on alone. With the
    # Llama step (which may run a mixed pass) it failed with "'NoneType' object has no
    # attribute 'past_key_values'": a 424 for the newcomer.
    from djl_stream.generation import llama_decode

    in_step, release = threading.Event(), threading.Event()

    def hold_a_decode_step(module, args):
        # the Llama step's LM head gets (rows, hidden); the model's forward (rows, 1, hidden)
        if args[0].dim() == 2 and not release.is_set():
            in_step.set()
            assert release.wait(30)

    assert llama_decode.attach(tiny_model, smollm2_tokenizer) is not None
    scheduler = make_scheduler()
    handle = tiny_model.lm_head.register_forward_pre_hook(hold_a_decode_step)
    try:
        running = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                                             max_new_tokens=100_000, ignore_eos=True))
        assert in_step.wait(30)  # the loop is inside the running request's decode step
        late = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[2]],
                                          max_new_tokens=4))
        running.close()
        release.set()
        texts, _ = collect(late)
    finally:
        release.set()
        handle.remove()
        llama_decode.detach(tiny_model)
    assert texts is not None and late.sequences[0].finished
    assert len(late.sequences[0].generated_ids) == 4


def test_what_a_prefill_reserves_on_a_cpu_and_elsewhere(tiny_model, smollm2_tokenizer):
    # On a CPU, room costs address space only: every prefill reserves rows up to the
    # batch size and columns on the left for the longest prompt allowed. Elsewhere
    # (contract only: no GPU here; "cuda" names the device, nothing runs on it) a prompt
    # reserves rows for the running ones only when it is longer than they are.
    from djl_stream.generation.batch import CausalLMBatch, generate_token

    from types import SimpleNamespace

    short, longer = (sequences(tiny_model, smollm2_tokenizer, [p]) for p in PROMPTS[:2])

    def room(device, prompt, running=None):  # the method, on a scheduler's settings alone
        settings = SimpleNamespace(device=device, max_batch_size=8, max_input_length=300,
                                   _running=running)
        return Scheduler._room_to_reserve(settings, prompt)

    assert room("cpu", short) == {"room_for_rows": 7, "room_on_left": 300}
    assert room("cuda", longer) == {}  # nothing runs
    _, running = generate_token(tiny_model, CausalLMBatch.from_sequences(
        sequences(tiny_model, smollm2_tokenizer, PROMPTS[2:]), pad_token_id=2, device="cpu"))
    assert len(longer[0].prompt_ids) > running.cache_length >= len(short[0].prompt_ids)
    assert room("cuda", longer, running) == {"room_for_rows": 2}
    assert room("cuda", short, running) == {}
    assert room("cpu", longer, running) == {"room_for_rows": 7, "room_on_left": 300}


def test_a_retired_scheduler_s_thread_ends_and_the_next_use_starts_another(smollm2_tokenizer):
    # benchmarks.inprocess retires it between the ways it measures: its thread's OpenMP
    # pool must be gone (see loading.in_passing_thread)
    from conftest import build_tiny_llama
    from djl_stream.generation.scheduler import retire_scheduler, scheduler_for
    from djl_stream.generation.sequence import GenerationSequence

    model = build_tiny_llama(len(smollm2_tokenizer), seed=21)

    def tokens(scheduler):
        seq = GenerationSequence(0, [1, 2, 3], smollm2_tokenizer, max_new_tokens=4,
                                 eos_token_ids=set(), ignore_eos=True)
        for _ in scheduler.submit([seq]):
            pass
        return seq.generated_ids

    first = scheduler_for(model, pad_token_id=2, device="cpu")
    expected = tokens(first)
    retire_scheduler(model)
    assert not first._thread.is_alive()
    second = scheduler_for(model, pad_token_id=2, device="cpu")
    assert second is not first and tokens(second) == expected
    retire_scheduler(model)
    retire_scheduler(model)  # none left: nothing to do
