"""Chunked prefill: a long prompt is read at most ``max_batch_prefill_tokens`` tokens (rows ×
columns) per forward pass, the running batch takes a decode step between its chunks, and
what it generates is what a one-pass prefill (and transformers' ``generate()``) generates.

On the tiny model through the real scheduler; forward passes are counted by a real forward
pre-hook on the decoder (``model.model``), which every pass goes through: the chunks,
which skip the LM head, and the full model's prefill ends and decode steps.
"""

from __future__ import annotations

import threading
import time

import pytest

from djl_stream.generation.batch import CausalLMBatch, generate_token, prefill_chunk
from djl_stream.generation.errors import GenerationFailed
from djl_stream.runtime.forward_kwargs import cache_in
from djl_stream.generation.prefill_pacing import PrefillPacer
from djl_stream.generation.scheduler import (BURST_PASSES, BURST_RATIO, CANCELLED, BatchState, Scheduler,
                                             IDLE_PREFILL_FACTOR, attention_parity_context,
                                             prefill_columns,
                                             SchedulerObserver)
from test_scheduler import collect, sequences

#: 169 tokens with the SmolLM2 tokenizer: many chunks of the budgets below.
LONG = "The history of the city begins with a small settlement by the river, " * 12
SHORT = "Colours of the rainbow"
BUDGET = 16


class Forwards:
    """Every forward pass of the decoder as ``(rows, columns fed, columns cached)``; can
    hold the first prefill chunk until released, or raise where ``fails(kwargs)`` says."""

    def __init__(self, model, *, hold_first_chunk=False, fails=None, events=None):
        self.passes: list[tuple[int, int, int]] = []
        self.events = events
        self.fails = fails
        self.chunk_started = threading.Event()
        self.release = threading.Event()
        if not hold_first_chunk:
            self.release.set()
        self._handle = model.model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        ids = kwargs["input_ids"]
        cached = cache_in(kwargs).get_seq_length()
        self.passes.append((ids.shape[0], ids.shape[1], cached))
        if self.events is not None and ids.shape[1] > 1:
            self.events.append(("prefill", ids.shape[0] * ids.shape[1]))
        if ids.shape[1] > 1 and not self.chunk_started.is_set():
            self.chunk_started.set()
            self.release.wait(60)
        if self.fails is not None and self.fails(kwargs):
            raise RuntimeError("simulated device failure")

    @property
    def prefill_passes(self) -> list[tuple[int, int, int]]:
        return [p for p in self.passes if p[1] > 1]

    def remove(self):
        self._handle.remove()


class Tokens(SchedulerObserver):
    """Records, into a list shared with :class:`Forwards`, each step that gave a request
    tokens, and keeps each request's stats and the last load."""

    def __init__(self, events):
        self.events = events
        self.stats = {}
        self.state = None
        self.ended = threading.Condition()

    def request_submitted(self, stats):
        self.stats[stats.request_id] = stats

    def request_advanced(self, stats, tokens, interval):
        self.events.append(("token", stats.request_id))

    def request_ended(self, stats):
        with self.ended:
            self.ended.notify_all()

    def batch_changed(self, state):
        with self.ended:
            self.state = state
            self.ended.notify_all()

    def wait(self, condition):
        with self.ended:
            assert self.ended.wait_for(condition, 60)


@pytest.fixture()
def make_scheduler(tiny_model):
    schedulers = []

    def make(**settings):
        settings.setdefault("max_batch_size", 4)
        # Pass widths sized by the token budget alone: the stall bound times passes on
        # the real clock, so widths would depend on this machine's speed (the bound's
        # own tests drive it with a simulated clock).
        settings.setdefault("prefill_stall_steps", 0)
        schedulers.append(Scheduler(tiny_model, pad_token_id=2, device="cpu", **settings))
        return schedulers[-1]
    yield make
    for scheduler in schedulers:
        scheduler.shutdown()


def settled(scheduler):
    """Wait (60 s at most) until no request is running or prefilling: a closed stream's
    request leaves at the scheduler's next step, and may take one more token first."""
    deadline = time.monotonic() + 60
    while (scheduler.running_size or scheduler.prefilling_size) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not scheduler.running_size and not scheduler.prefilling_size


def long_prompt_beside_a_stream(scheduler, model, tokenizer, once_decoding):
    """A short prompt decodes (``ignore_eos``: it runs until closed, however the random
    model's tokens fall); once it is, ``once_decoding()`` is called and :data:`LONG` is
    read to its end (8 new tokens) beside it. Returns both requests' sequences, the
    stream closed and the scheduler idle."""
    running_seqs = sequences(model, tokenizer, [SHORT], max_new_tokens=100_000, ignore_eos=True)
    running = scheduler.submit(running_seqs)
    next(running)  # it is decoding
    once_decoding()
    long_seqs = sequences(model, tokenizer, [LONG], max_new_tokens=8)
    collect(scheduler.submit(long_seqs))
    running.close()
    settled(scheduler)
    return running_seqs, long_seqs


def one_pass_ids(make_scheduler, model, tokenizer, prompts, **parameters):
    """Each prompt's generated ids alone, its prefill in one forward pass."""
    scheduler = make_scheduler(max_batch_prefill_tokens=100_000)
    ids = []
    for prompt in prompts:
        seqs = sequences(model, tokenizer, [prompt], **parameters)
        collect(scheduler.submit(seqs))
        ids.append(seqs[0].generated_ids)
    return ids


@pytest.mark.parametrize("budget", [BUDGET, 40])
def test_a_prompt_of_many_chunks_generates_what_generate_does(make_scheduler, tiny_model,
                                                              smollm2_tokenizer, budget):
    prompt = smollm2_tokenizer(LONG, return_tensors="pt")
    length = prompt["input_ids"].shape[1]
    reference = tiny_model.generate(**prompt, max_new_tokens=20, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)[0, length:].tolist()
    assert 2 not in reference  # eos cannot end the reference early, nor this run
    forwards = Forwards(tiny_model)
    try:
        seqs = sequences(tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=20)
        collect(make_scheduler(max_batch_prefill_tokens=budget,
                               max_idle_prefill_tokens=budget).submit(seqs))
    finally:
        forwards.remove()
    assert seqs[0].generated_ids == reference
    # the prompt went in chunks, each seeing the cache of the ones before: the first of
    # the whole budget, later ones narrower as the context they attend to grows, each as
    # wide as the budget affords at its depth
    chunks = forwards.prefill_passes
    assert len(chunks) >= 4
    assert chunks[0][1] == budget
    assert [cached for _, _, cached in chunks] == [
        sum(columns for _, columns, _ in chunks[:i]) for i in range(len(chunks))]
    assert sum(columns for _, columns, _ in chunks) == length
    parity = attention_parity_context(tiny_model)
    for _, columns, cached in chunks[:-1]:
        assert columns * (1 + cached / parity) <= budget < (columns + 1) * (1 + cached / parity)
    assert chunks[-2][1] < budget  # the tiny model reaches parity at 288 columns


def test_with_nothing_decoding_a_long_prompt_is_read_in_wider_passes(
        make_scheduler, tiny_model, smollm2_tokenizer):
    expected = one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, [LONG],
                            max_new_tokens=8)
    forwards = Forwards(tiny_model)
    try:
        seqs = sequences(tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=8)
        scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET)
        collect(scheduler.submit(seqs))
    finally:
        forwards.remove()
    assert [seqs[0].generated_ids] == expected
    assert scheduler.max_idle_prefill_tokens == IDLE_PREFILL_FACTOR * BUDGET
    chunks = forwards.prefill_passes
    assert chunks[0][1] == IDLE_PREFILL_FACTOR * BUDGET  # not BUDGET: nobody is waiting
    assert 2 <= len(chunks) < -(-len(seqs[0].prompt_ids) // BUDGET)


def test_chunks_narrow_as_the_context_grows_so_each_costs_the_budget(tiny_model):
    # the tiny model's attention width and weights, from its config and parameters
    parity = attention_parity_context(tiny_model)
    assert 250 < parity < 330
    widths = [prefill_columns(64, 1, cached, 288.0) for cached in (0, 288, 864)]
    assert widths == [64, 32, 16]
    assert prefill_columns(64, 4, 0, parity) == 16
    assert prefill_columns(8, 16, 10_000, parity) == 1  # every prefill moves on


def test_a_request_with_prompts_of_different_lengths_is_chunked_as_one_batch(
        make_scheduler, tiny_model, smollm2_tokenizer):
    prompts = [LONG, "Hi", LONG[:150], SHORT]
    expected = one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, prompts,
                            max_new_tokens=16)
    forwards = Forwards(tiny_model)
    try:
        seqs = sequences(tiny_model, smollm2_tokenizer, prompts, max_new_tokens=16)
        steps = list(make_scheduler(max_batch_prefill_tokens=BUDGET,
                                    max_idle_prefill_tokens=BUDGET).submit(seqs))
    finally:
        forwards.remove()
    assert [seq.generated_ids for seq in seqs] == expected
    # four rows of a budget of 16: chunks of four columns, the short rows' padding too
    chunks = forwards.prefill_passes
    assert len(chunks) > 10
    assert all(rows * columns <= BUDGET for rows, columns, _ in chunks)
    # every prompt got its first token in the same step, as from a one-pass prefill
    assert all(generation is not None for generation in steps[0].generations)


def test_a_running_stream_takes_decode_steps_between_the_chunks_of_a_long_prompt(
        make_scheduler, tiny_model, smollm2_tokenizer):
    expected_long = one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, [LONG],
                                 max_new_tokens=8)[0]
    events: list[tuple] = []
    tokens = Tokens(events)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, observers=[tokens])
    forwards = Forwards(tiny_model, events=events)
    try:
        running_seqs, long_seqs = long_prompt_beside_a_stream(
            scheduler, tiny_model, smollm2_tokenizer, once_decoding=events.clear)
    finally:
        forwards.remove()
    running_id = running_seqs[0].request_id[0]
    prefills = [i for i, event in enumerate(events) if event[0] == "prefill"]
    assert len(prefills) >= 4
    assert all(event[1] <= BUDGET for event in events if event[0] == "prefill")
    for before, after in zip(prefills, prefills[1:]):
        assert ("token", running_id) in events[before:after], events
    # both generated what they generate alone
    assert long_seqs[0].generated_ids == expected_long
    generated = running_seqs[0].generated_ids
    assert one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, [SHORT],
                        max_new_tokens=len(generated), ignore_eos=True)[0] == generated


@pytest.mark.parametrize("stall_steps", [1.5, 0])
def test_while_a_stream_decodes_a_pass_takes_at_most_the_stall_bound_of_its_steps(
        make_scheduler, tiny_model, smollm2_tokenizer, stall_steps):
    # Simulated time (nothing depends on this machine's speed): a forward hook advances
    # the pacer's clock by what a pass costs on a CPU, the weights streamed once plus
    # each token fed. A decode step (1 x 1) costs 54 ms; 1.5 of them afford 7 columns.
    clock = [0.0]

    def cost(rows, columns):
        return 0.050 + 0.004 * rows * columns

    def advance(module, args, kwargs):
        clock[0] += cost(*kwargs["input_ids"].shape)

    parity = attention_parity_context(tiny_model)
    pacer = PrefillPacer(stall_steps, parity, clock=lambda: clock[0])
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, pacer=pacer)
    forwards = Forwards(tiny_model)
    timing = tiny_model.model.register_forward_pre_hook(advance, with_kwargs=True)
    try:
        _, long_seqs = long_prompt_beside_a_stream(
            scheduler, tiny_model, smollm2_tokenizer, once_decoding=forwards.passes.clear)
    finally:
        timing.remove()
        forwards.remove()
    assert long_seqs[0].generated_ids == one_pass_ids(
        make_scheduler, tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=8)[0]
    passes = forwards.prefill_passes
    # (a last column alone looks like a decode step: 1 x 1)
    assert len(long_seqs[0].prompt_ids) - sum(columns for _, columns, _ in passes) in (0, 1)
    by_budget = [prefill_columns(BUDGET, rows, cached, parity) for rows, _, cached in passes]
    if not stall_steps:  # the token budget alone sizes them
        assert [columns for _, columns, _ in passes[:-1]] == by_budget[:-1]
        return
    # each within the bound, give or take a column (sized from the passes timed before
    # it, the running stream's own prefill first), and never wider than the budget's
    bound = stall_steps * cost(1, 1)
    assert all(cost(rows, columns) <= bound + cost(rows, 1) - cost(0, 0)
               for rows, columns, _ in passes), (passes, bound)
    assert all(columns <= budget for (_, columns, _), budget in zip(passes, by_budget))
    assert any(columns < budget for (_, columns, _), budget in zip(passes, by_budget))


class RecordingPacer(PrefillPacer):
    """A pacer that records what each call of :meth:`columns` was told."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked = []

    def columns(self, budget, rows, cached, **kwargs):
        self.asked.append((cached, kwargs.get("prompt_length")))
        return super().columns(budget, rows, cached, **kwargs)


def test_the_pacer_is_told_how_long_the_prompt_being_read_is(make_scheduler, tiny_model,
                                                             smollm2_tokenizer):
    # (a short prompt's passes may stretch beyond the bound, a long one's not:
    # prefill_pacing.STRETCHED_PASS)
    pacer = RecordingPacer(1.5, attention_parity_context(tiny_model))
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, pacer=pacer)
    _, long_seqs = long_prompt_beside_a_stream(scheduler, tiny_model, smollm2_tokenizer,
                                               once_decoding=pacer.asked.clear)
    assert len(pacer.asked) >= 2, pacer.asked        # paced beside the stream, in chunks
    assert {length for _, length in pacer.asked} == {len(long_seqs[0].prompt_ids)}
    assert [cached for cached, _ in pacer.asked] == sorted(cached for cached, _ in pacer.asked)


class HeldDecodeStep:
    """Holds the scheduler inside its next decode step (a forward pass of one column)
    while the ``with`` block runs: requests submitted in it all wait for the same
    admission, whatever the threads' timing."""

    def __init__(self, model):
        self.model = model
        self.holding = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def _hold(self, module, args, kwargs):
        if self.holding.is_set() and kwargs["input_ids"].shape[1] == 1:
            self.holding.clear()
            self.entered.set()
            self.release.wait(60)

    def __enter__(self):
        self._handle = self.model.model.register_forward_pre_hook(self._hold, with_kwargs=True)
        self.holding.set()
        assert self.entered.wait(60), "the scheduler never took a decode step"
        return self

    def __exit__(self, *exc):
        self.release.set()
        self._handle.remove()


def burst_beside_running(scheduler, model, tokenizer, forwards, prompts, running_prompts):
    """``running_prompts`` decode (one request each, until closed); while the scheduler
    is held in one of their steps, ``prompts`` arrive (one request each, 4 new tokens)
    and are read to their end. Returns their sequences; the prefill passes ``forwards``
    saw before are cleared."""
    running = [scheduler.submit(sequences(model, tokenizer, [prompt], max_new_tokens=100_000,
                                          ignore_eos=True)) for prompt in running_prompts]
    for stream in running:
        next(stream)  # decoding
    with HeldDecodeStep(model):
        forwards.passes.clear()
        arrived = [sequences(model, tokenizer, [prompt], max_new_tokens=4) for prompt in prompts]
        streams = [scheduler.submit(seqs) for seqs in arrived]
    for stream in streams:
        collect(stream)
    for stream in running:
        stream.close()
    settled(scheduler)
    return arrived


def burst_passes(make_scheduler, model, tokenizer, prompts, running_prompts, *,
                 same_ids=True):
    """:func:`burst_beside_running` on a scheduler of budget :data:`BUDGET` and 8 rows:
    the scheduler, the arrivals' sequences and the prefill passes they were read in;
    with ``same_ids``, checks that each arrival generated what it generates alone."""
    expected = one_pass_ids(make_scheduler, model, tokenizer, prompts,
                            max_new_tokens=4) if same_ids else None
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_batch_size=8)
    forwards = Forwards(model)
    try:
        arrived = burst_beside_running(scheduler, model, tokenizer, forwards, prompts,
                                       running_prompts)
    finally:
        forwards.remove()
    if same_ids:
        assert [seqs[0].generated_ids for seqs in arrived] == expected
    return scheduler, arrived, forwards.prefill_passes


def test_a_burst_beside_a_stream_is_admitted_and_read_with_the_idle_budget(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # Four requests arrive while one stream decodes: 4 >= BURST_RATIO x 1 rows. Together
    # their prompts pass the budget (so they would be admitted two by two and read a few
    # columns a pass), not the idle budget: they are admitted together and read at once.
    prompts = [SHORT, "Hi there", "Name three rivers", "Tell me a joke"]
    _, arrived, passes = burst_passes(make_scheduler, tiny_model, smollm2_tokenizer, prompts,
                                      [SHORT])
    longest = max(len(seqs[0].prompt_ids) for seqs in arrived)
    assert len(prompts) >= BURST_RATIO * 1
    assert len(prompts) * longest > BUDGET
    assert passes == [(len(prompts), longest, 0)]


def test_a_burst_past_one_idle_pass_is_read_together_in_idle_passes(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # Four prompts that take more than one pass of the idle budget, and no more than
    # BURST_PASSES: admitted together, every pass reads all four rows, each pass within
    # the idle budget.
    prompts = [LONG[:200], LONG[:190], LONG[:180], LONG[:170]]
    scheduler, arrived, passes = burst_passes(make_scheduler, tiny_model, smollm2_tokenizer,
                                              prompts, [SHORT])
    idle = scheduler.max_idle_prefill_tokens
    longest = max(len(seqs[0].prompt_ids) for seqs in arrived)
    assert idle < len(prompts) * longest <= BURST_PASSES * idle
    assert 2 <= len(passes) <= BURST_PASSES + 1, passes  # (+1: a last column alone)
    assert all(rows == len(prompts) and rows * columns <= idle for rows, columns, _ in passes)


def test_a_request_beside_as_many_streams_is_not_a_burst(make_scheduler, tiny_model,
                                                          smollm2_tokenizer):
    # Two requests arrive while two streams decode (2 < BURST_RATIO x 2): the running
    # streams are protected, as for a single arrival: each pass within the budget.
    prompts = [LONG[:60], LONG[:45]]
    _, arrived, passes = burst_passes(make_scheduler, tiny_model, smollm2_tokenizer, prompts,
                                      [SHORT, "Hi there"])
    assert len(prompts) * max(len(seqs[0].prompt_ids) for seqs in arrived) > BUDGET
    assert len(passes) >= 2
    assert all(rows * columns <= BUDGET for rows, columns, _ in passes), passes


def test_a_burst_of_long_prompts_is_paced_as_any_prefill(make_scheduler, tiny_model,
                                                        smollm2_tokenizer):
    # Two long prompts beside one stream are a burst, but the first alone does not fit in
    # BURST_PASSES passes of the idle budget: each is read within the budget, the running
    # stream between.
    scheduler, arrived, passes = burst_passes(make_scheduler, tiny_model, smollm2_tokenizer,
                                              [LONG * 2, LONG], [SHORT], same_ids=False)
    assert len(arrived[0][0].prompt_ids) > BURST_PASSES * scheduler.max_idle_prefill_tokens
    assert len(passes) > 2 * len(arrived[0][0].prompt_ids) // scheduler.max_idle_prefill_tokens
    assert all(rows * columns <= BUDGET for rows, columns, _ in passes), passes


def test_requests_waiting_while_nothing_decodes_are_admitted_with_the_idle_budget(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # Nobody waits between tokens: three prompts past the budget together (but within the
    # idle budget) are one prefill pass, as one request of three prompts would be.
    prompts = [SHORT, LONG[:60], LONG[:45]]
    expected = one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, prompts,
                            max_new_tokens=4)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_batch_size=8)
    forwards = Forwards(tiny_model, hold_first_chunk=True)
    try:
        first = sequences(tiny_model, smollm2_tokenizer, ["Hi there"], max_new_tokens=1)
        first_stream = scheduler.submit(first)
        assert forwards.chunk_started.wait(60)  # the scheduler is inside its prefill
        arrived = [sequences(tiny_model, smollm2_tokenizer, [prompt], max_new_tokens=4)
                   for prompt in prompts]
        streams = [scheduler.submit(seqs) for seqs in arrived]
        forwards.release.set()
        collect(first_stream)  # one token: it ends at its prefill, nothing decodes after
        for stream in streams:
            collect(stream)
        settled(scheduler)
    finally:
        forwards.remove()
    assert [seqs[0].generated_ids for seqs in arrived] == expected
    longest = max(len(seqs[0].prompt_ids) for seqs in arrived)
    assert len(prompts) * longest > BUDGET
    assert (len(prompts), longest, 0) in forwards.prefill_passes


def test_a_request_cancelled_mid_prefill_leaves_with_its_cache(make_scheduler, tiny_model,
                                                                smollm2_tokenizer):
    events: list[tuple] = []
    tokens = Tokens(events)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_idle_prefill_tokens=BUDGET,
                               observers=[tokens])
    forwards = Forwards(tiny_model, hold_first_chunk=True)
    try:
        stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [LONG],
                                            max_new_tokens=8))
        assert forwards.chunk_started.wait(60)
        assert scheduler.prefilling_size == 1
        stream.close()
        forwards.release.set()
        request_id = stream.sequences[0].request_id[0]
        tokens.wait(lambda: tokens.stats[request_id].outcome is not None)
        tokens.wait(lambda: tokens.state == BatchState())
    finally:
        forwards.remove()
    stats = tokens.stats[request_id]
    assert stats.outcome == CANCELLED
    assert stats.generated_tokens == 0  # it never got to its first token
    assert forwards.prefill_passes == [(1, BUDGET, 0)]  # one chunk, no more
    assert scheduler.prefilling_size == 0
    # and the scheduler serves on
    assert collect(scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [SHORT],
                                              max_new_tokens=3)))[1] == 3


def test_a_chunk_that_raises_fails_only_its_request(make_scheduler, tiny_model,
                                                     smollm2_tokenizer):
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_idle_prefill_tokens=BUDGET)
    failing = Forwards(tiny_model, fails=lambda kwargs: kwargs["input_ids"].shape[1] > 1
                       and cache_in(kwargs).get_seq_length() > 0)  # a later chunk
    try:
        running_seqs = sequences(tiny_model, smollm2_tokenizer, [SHORT],
                                 max_new_tokens=100_000, ignore_eos=True)
        running = scheduler.submit(running_seqs)
        next(running)
        doomed = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [LONG],
                                            max_new_tokens=8))
        with pytest.raises(GenerationFailed, match="simulated device failure"):
            collect(doomed)
    finally:
        failing.remove()
    assert scheduler.prefilling_size == 0
    # the running stream goes on, with its solo text, and the next long prompt goes in
    next(running)
    after = sequences(tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=8)
    collect(scheduler.submit(after))
    running.close()
    settled(scheduler)
    generated = running_seqs[0].generated_ids
    assert one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, [SHORT],
                        max_new_tokens=len(generated), ignore_eos=True)[0] == generated
    assert after[0].generated_ids == one_pass_ids(make_scheduler, tiny_model,
                                                  smollm2_tokenizer, [LONG],
                                                  max_new_tokens=8)[0]


def test_prefill_chunk_builds_the_cache_a_one_pass_prefill_builds(tiny_model, smollm2_tokenizer):
    prompts = [LONG[:120], SHORT]

    def batch_of():
        seqs = sequences(tiny_model, smollm2_tokenizer, prompts, max_new_tokens=6)
        return seqs, CausalLMBatch.from_sequences(seqs, pad_token_id=2, device="cpu")

    one_pass, batch = batch_of()
    while batch is not None:
        _, batch = generate_token(tiny_model, batch)
    chunked, batch = batch_of()
    width = batch.columns_to_feed
    batch = prefill_chunk(tiny_model, batch, 5)
    batch = prefill_chunk(tiny_model, batch, 7)
    assert (batch.cache_length, batch.columns_to_feed) == (12, width - 12)
    assert batch.attention_mask.shape[1] == width  # cached + still to feed
    while batch is not None:
        _, batch = generate_token(tiny_model, batch)
    assert [s.generated_ids for s in chunked] == [s.generated_ids for s in one_pass]
    with pytest.raises(ValueError, match="1 to"):
        prefill_chunk(tiny_model, batch_of()[1], width)  # the last column picks a token


def test_the_budget_is_at_least_a_decode_step_and_has_a_default_per_device(tiny_model):
    with pytest.raises(ValueError, match="at least max_batch_size"):
        Scheduler(tiny_model, pad_token_id=2, device="cpu", max_batch_size=8,
                  max_batch_prefill_tokens=4)
    from djl_stream.generation.scheduler import default_max_batch_prefill_tokens

    scheduler = Scheduler(tiny_model, pad_token_id=2, device="cpu", max_batch_size=4)
    try:
        assert scheduler.max_batch_prefill_tokens == default_max_batch_prefill_tokens("cpu")
    finally:
        scheduler.shutdown()
