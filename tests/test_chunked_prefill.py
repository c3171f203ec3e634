"""Chunked prefill: a long prompt is read at most ``max_batch_prefill_tokens`` tokens (rows ×
columns) per forward pass, the running batch takes a decode step between its chunks, and
what it generates is what a one-pass prefill (and transformers' ``generate()``) generates.

On the tiny model through the real scheduler and its real runner; passes are observed by
wrapping the runner's ``run`` (:class:`Passes`), which every pass goes through: the
prompt chunks, the prompts' last columns, decode steps and mixed passes. A chunk of ``c``
columns over a batch is a pass whose feeds follow the rule of
:meth:`~djl_stream.generation.batch.CausalLMBatch.chunk_feeds` (the prompts aligned on
their ends).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, List, NamedTuple, Optional

import pytest
import torch

from djl_stream.generation.batch import CausalLMBatch, generate_token, prefill_chunk
from djl_stream.generation.errors import GenerationFailed
from djl_stream.generation.prefill_pacing import PrefillPacer
from djl_stream.generation.scheduler import (BURST_PASSES, BURST_RATIO, CANCELLED, BatchState, Scheduler,
                                             IDLE_PREFILL_FACTOR, attention_parity_context,
                                             prefill_columns,
                                             SchedulerObserver)
from djl_stream.runtime.runner import RunnerSettings, load_runner
from test_scheduler import collect, sequences

#: 169 tokens with the SmolLM2 tokenizer: many chunks of the budgets below.
LONG = "The history of the city begins with a small settlement by the river, " * 12
SHORT = "Colours of the rainbow"
BUDGET = 16
#: Rows and positions of the runners the tests make (the longest prompt here is 338 tokens).
#: (Prompts are read from their first token: these tests count what each pass reads, and
#: a prompt that begins as an earlier one did would start with that one's keys and values.)
RUNNER_SETTINGS = RunnerSettings(max_rows=16, max_positions=1024, reuse_prefixes=False)


class Fed(NamedTuple):
    """One feed of a pass: its sequence's handle, the tokens fed, the positions cached
    before, whether it wanted logits, and whether the tokens are its prompt's (not a
    decode step's token)."""

    handle: int
    tokens: int
    cached: int
    logits: bool
    prompt: bool


class Passes:
    """Every pass of ``runner`` as the list of its :class:`Fed` feeds, by wrapping its
    ``run`` (in the scheduler's thread).

    ``hold_first_prefill``: the first pass that reads a prompt waits (60 s at most) until
    ``release`` is set, ``prefill_started`` set meanwhile. ``fails(feeds)``: where it says
    so, the pass raises inside the model's forward (at its output layer, once every layer
    wrote its keys and values). ``events``: a list that gets ``("prefill", prompt tokens)``
    for each pass that reads a prompt. ``on_pass(feeds)`` is called before each pass runs.
    A sequence's feeds are its prompt's up to the first that wanted logits (its prompt's
    last chunk), which succeeded.
    """

    def __init__(self, runner, *, hold_first_prefill: bool = False,
                 fails: Optional[Callable[[List[Fed]], bool]] = None,
                 events: Optional[list] = None,
                 on_pass: Optional[Callable[[List[Fed]], None]] = None):
        self.runner = runner
        self.seen: List[List[Fed]] = []
        self.failed: List[int] = []  # indices in seen of the passes that raised
        self.fails = fails
        self.events = events
        self.on_pass = on_pass
        self.prefill_started = threading.Event()
        self.release = threading.Event()
        if not hold_first_prefill:
            self.release.set()
        self._decoding: set = set()
        self._failing = False
        self._hook = runner.model.get_output_embeddings().register_forward_pre_hook(self._raise)
        real = runner.run

        def run(feeds):
            record = [Fed(f.handle, len(f.tokens), runner.length(f.handle), f.logits,
                          f.handle not in self._decoding) for f in feeds]
            self.seen.append(record)
            index = len(self.seen) - 1
            reads_prompt = any(f.prompt for f in record)
            if self.events is not None and reads_prompt:
                self.events.append(("prefill", sum(f.tokens for f in record if f.prompt)))
            if self.on_pass is not None:
                self.on_pass(record)
            if reads_prompt and not self.prefill_started.is_set():
                self.prefill_started.set()
                self.release.wait(60)
            self._failing = self.fails is not None and self.fails(record)
            try:
                logits = real(feeds)
            except Exception:
                self.failed.append(index)
                raise
            finally:
                self._failing = False
            self._decoding.update(f.handle for f in feeds if f.logits)
            return logits

        runner.run = run

    def _raise(self, module, args):
        if self._failing:
            raise RuntimeError("simulated device failure")

    def remove(self):
        self._hook.remove()

    def clear(self):
        self.seen.clear()
        self.failed.clear()

    @property
    def ran(self) -> List[List[Fed]]:
        """The passes that did not raise."""
        failed = set(self.failed)
        return [p for i, p in enumerate(self.seen) if i not in failed]

    def prompt_passes(self) -> List[List[Fed]]:
        """The prompt feeds of each pass (that did not raise) that read any."""
        return [[f for f in p if f.prompt] for p in self.ran if any(f.prompt for f in p)]

    def prefill_shapes(self) -> List[tuple]:
        """Each pass that read prompts as ``(rows fed, columns: the most tokens a row
        was fed, the most positions a row had cached)``."""
        return [(len(p), max(f.tokens for f in p), max(f.cached for f in p))
                for p in self.prompt_passes()]


def is_mixed(feeds: List[Fed]) -> bool:
    """Whether a pass carried both prompt tokens and a decode step's."""
    return any(f.prompt for f in feeds) and any(not f.prompt for f in feeds)


class Tokens(SchedulerObserver):
    """Records, into a list shared with :class:`Passes`, each step that gave a request
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
        runner = load_runner(tiny_model, RUNNER_SETTINGS)
        schedulers.append(Scheduler(runner, **settings))
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


def aligned_counts(lengths, passes):
    """The tokens each row is fed in each of ``passes`` chunk widths when prompts of
    ``lengths`` are read aligned on their ends (0 where a row is not fed)."""
    pending = list(lengths)
    counts = []
    for columns in passes:
        width = max(pending)
        fed = [max(0, p - (width - columns)) for p in pending]
        counts.append(fed)
        pending = [p - n for p, n in zip(pending, fed)]
    return counts


@pytest.mark.parametrize("budget", [BUDGET, 40])
def test_a_prompt_of_many_chunks_generates_what_generate_does(make_scheduler, tiny_model,
                                                              smollm2_tokenizer, budget):
    prompt = smollm2_tokenizer(LONG, return_tensors="pt")
    length = prompt["input_ids"].shape[1]
    reference = tiny_model.generate(**prompt, max_new_tokens=20, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)[0, length:].tolist()
    assert 2 not in reference  # eos cannot end the reference early, nor this run
    scheduler = make_scheduler(max_batch_prefill_tokens=budget, max_idle_prefill_tokens=budget)
    passes = Passes(scheduler.runner)
    try:
        seqs = sequences(tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=20)
        collect(scheduler.submit(seqs))
    finally:
        passes.remove()
    assert seqs[0].generated_ids == reference
    # the prompt went in chunks, each seeing the cache of the ones before: the first of
    # the whole budget, later ones narrower as the context they attend to grows, each as
    # wide as the budget affords at its depth
    chunks = passes.prefill_shapes()
    assert len(chunks) >= 4
    assert all(rows == 1 for rows, _, _ in chunks)
    assert chunks[0][1] == budget
    assert [cached for _, _, cached in chunks] == [
        sum(columns for _, columns, _ in chunks[:i]) for i in range(len(chunks))]
    assert sum(columns for _, columns, _ in chunks) == length
    parity = attention_parity_context(tiny_model)
    for _, columns, cached in chunks[:-1]:
        assert columns * (1 + cached / parity) <= budget < (columns + 1) * (1 + cached / parity)
    assert chunks[-2][1] < budget  # the tiny model reaches parity at 288 columns
    # only the last chunk asked for logits: the one that chose the first token
    wanted = [f.logits for p in passes.prompt_passes() for f in p]
    assert wanted == [False] * (len(chunks) - 1) + [True]


def test_with_nothing_decoding_a_long_prompt_is_read_in_wider_passes(
        make_scheduler, tiny_model, smollm2_tokenizer):
    expected = one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, [LONG],
                            max_new_tokens=8)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET)
    passes = Passes(scheduler.runner)
    try:
        seqs = sequences(tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=8)
        collect(scheduler.submit(seqs))
    finally:
        passes.remove()
    assert [seqs[0].generated_ids] == expected
    assert scheduler.max_idle_prefill_tokens == IDLE_PREFILL_FACTOR * BUDGET
    chunks = passes.prefill_shapes()
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
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_idle_prefill_tokens=BUDGET)
    passes = Passes(scheduler.runner)
    try:
        seqs = sequences(tiny_model, smollm2_tokenizer, prompts, max_new_tokens=16)
        steps = list(scheduler.submit(seqs))
    finally:
        passes.remove()
    assert [seq.generated_ids for seq in seqs] == expected
    # four rows of a budget of 16: chunks of four columns at most, fewer deeper in
    chunks = passes.prompt_passes()
    assert len(chunks) > 10
    widths = [max(f.tokens for f in chunk) for chunk in chunks]
    assert all(len(prompts) * columns <= BUDGET for columns in widths)
    # each chunk fed every row its share of those columns, the prompts aligned on their
    # ends: the short rows join the last chunks, and every row is read to its end
    lengths = [len(seq.prompt_ids) for seq in seqs]
    handles = sorted({f.handle for chunk in chunks for f in chunk})
    assert len(handles) == len(prompts)
    fed = [[next((f.tokens for f in chunk if f.handle == h), 0) for h in handles]
           for chunk in chunks]
    assert fed == aligned_counts(lengths, widths)
    assert [sum(row) for row in zip(*fed)] == lengths
    # every prompt got its first token in the same step, as from a one-pass prefill
    assert all(f.logits for f in chunks[-1]) and len(chunks[-1]) == len(prompts)
    assert all(generation is not None for generation in steps[0].generations)


def test_a_running_stream_takes_decode_steps_between_the_chunks_of_a_long_prompt(
        make_scheduler, tiny_model, smollm2_tokenizer):
    expected_long = one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, [LONG],
                                 max_new_tokens=8)[0]
    events: list[tuple] = []
    tokens = Tokens(events)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, observers=[tokens])
    passes = Passes(scheduler.runner, events=events)
    try:
        running_seqs, long_seqs = long_prompt_beside_a_stream(
            scheduler, tiny_model, smollm2_tokenizer, once_decoding=events.clear)
    finally:
        passes.remove()
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
    # Simulated time (nothing depends on this machine's speed): each pass advances the
    # pacer's clock by what it costs, the weights read once plus each token fed. A decode
    # step of the running stream (one token) costs 60 ms; 1.5 of them, 90 ms, is what a
    # chunk may add to the step it shares a pass with: 9 columns, fewer than the budget
    # affords near the prompt's start.
    clock = [0.0]

    def cost(tokens):
        return 0.050 + 0.010 * tokens

    def advance(feeds):
        clock[0] += cost(sum(f.tokens for f in feeds))

    parity = attention_parity_context(tiny_model)
    pacer = PrefillPacer(stall_steps, parity, clock=lambda: clock[0])
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, pacer=pacer)
    passes = Passes(scheduler.runner, on_pass=advance)
    try:
        running_seqs, long_seqs = long_prompt_beside_a_stream(
            scheduler, tiny_model, smollm2_tokenizer, once_decoding=passes.clear)
    finally:
        passes.remove()
    assert long_seqs[0].generated_ids == one_pass_ids(
        make_scheduler, tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=8)[0]
    chunks = passes.prompt_passes()
    assert sum(f.tokens for chunk in chunks for f in chunk) == len(long_seqs[0].prompt_ids)
    assert all(len(chunk) == 1 for chunk in chunks)
    # each chunk shared a pass with the running stream's decode step
    assert all(is_mixed(p) for p in passes.ran if any(f.prompt for f in p))
    widths = [(chunk[0].tokens, chunk[0].cached) for chunk in chunks]
    by_budget = [prefill_columns(BUDGET, 1, cached, parity) for _, cached in widths]
    if not stall_steps:  # the token budget alone sizes them
        assert [columns for columns, _ in widths[:-1]] == by_budget[:-1]
        return
    # what each chunk added to the running stream's step is within the bound, give or
    # take a column (sized from the passes timed before it, the running stream's own
    # prefill first), and never wider than the budget's
    step = cost(1)
    bound = stall_steps * step
    assert all(cost(1 + columns) - step <= bound + cost(1) - cost(0)
               for columns, _ in widths), (widths, bound)
    assert all(columns <= budget for (columns, _), budget in zip(widths, by_budget))
    assert sum(columns < budget for (columns, _), budget in zip(widths[:-1], by_budget)) >= 2


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
    """Holds the scheduler inside its next decode step (a pass of one token per feed,
    while only running streams are served) while the ``with`` block runs: requests
    submitted in it all wait for the same admission, whatever the threads' timing."""

    def __init__(self, runner):
        self.runner = runner
        self.holding = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def __enter__(self):
        self._real = real = self.runner.run

        def run(feeds):
            if self.holding.is_set() and all(len(f.tokens) == 1 for f in feeds):
                self.holding.clear()
                self.entered.set()
                self.release.wait(60)
            return real(feeds)

        self.runner.run = run
        self.holding.set()
        assert self.entered.wait(60), "the scheduler never took a decode step"
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.runner.run = self._real


def burst_beside_running(scheduler, model, tokenizer, passes, prompts, running_prompts):
    """``running_prompts`` decode (one request each, until closed); while the scheduler
    is held in one of their steps, ``prompts`` arrive (one request each, 4 new tokens)
    and are read to their end. Returns their sequences; the passes ``passes`` saw before
    are cleared."""
    running = [scheduler.submit(sequences(model, tokenizer, [prompt], max_new_tokens=100_000,
                                          ignore_eos=True)) for prompt in running_prompts]
    for stream in running:
        next(stream)  # decoding
    with HeldDecodeStep(scheduler.runner):
        passes.clear()
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
    the scheduler, the arrivals' sequences and the prompt feeds of each pass that read
    any; with ``same_ids``, checks that each arrival generated what it generates alone."""
    expected = one_pass_ids(make_scheduler, model, tokenizer, prompts,
                            max_new_tokens=4) if same_ids else None
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_batch_size=8)
    passes = Passes(scheduler.runner)
    try:
        arrived = burst_beside_running(scheduler, model, tokenizer, passes, prompts,
                                       running_prompts)
    finally:
        passes.remove()
    if same_ids:
        assert [seqs[0].generated_ids for seqs in arrived] == expected
    return scheduler, arrived, passes.prompt_passes()


def test_a_burst_beside_a_stream_is_admitted_and_read_with_the_idle_budget(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # Four requests arrive while one stream decodes: 4 >= BURST_RATIO x 1 rows. Together
    # their prompts pass the budget (so they would be admitted two by two and read a few
    # columns a pass), not the idle budget: they are admitted together and read at once.
    prompts = [SHORT, "Hi there", "Name three rivers", "Tell me a joke"]
    _, arrived, passes = burst_passes(make_scheduler, tiny_model, smollm2_tokenizer, prompts,
                                      [SHORT])
    lengths = [len(seqs[0].prompt_ids) for seqs in arrived]
    assert len(prompts) >= BURST_RATIO * 1
    assert len(prompts) * max(lengths) > BUDGET
    assert len(passes) == 1, passes
    assert [(f.tokens, f.cached) for f in passes[0]] == [(n, 0) for n in lengths]


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
    assert 2 <= len(passes) <= BURST_PASSES, passes
    assert all(len(p) == len(prompts) and len(prompts) * max(f.tokens for f in p) <= idle
               for p in passes), passes


def test_a_request_beside_as_many_streams_is_not_a_burst(make_scheduler, tiny_model,
                                                          smollm2_tokenizer):
    # Two requests arrive while two streams decode (2 < BURST_RATIO x 2): the running
    # streams are protected, as for a single arrival: each pass within the budget.
    prompts = [LONG[:60], LONG[:45]]
    _, arrived, passes = burst_passes(make_scheduler, tiny_model, smollm2_tokenizer, prompts,
                                      [SHORT, "Hi there"])
    assert len(prompts) * max(len(seqs[0].prompt_ids) for seqs in arrived) > BUDGET
    assert len(passes) >= 2
    assert all(len(p) * max(f.tokens for f in p) <= BUDGET for p in passes), passes


def test_a_burst_of_long_prompts_is_paced_as_any_prefill(make_scheduler, tiny_model,
                                                        smollm2_tokenizer):
    # Two long prompts beside one stream are a burst, but the first alone does not fit in
    # BURST_PASSES passes of the idle budget: each is read within the budget, the running
    # stream between.
    scheduler, arrived, passes = burst_passes(make_scheduler, tiny_model, smollm2_tokenizer,
                                              [LONG * 2, LONG], [SHORT], same_ids=False)
    assert len(arrived[0][0].prompt_ids) > BURST_PASSES * scheduler.max_idle_prefill_tokens
    assert len(passes) > 2 * len(arrived[0][0].prompt_ids) // scheduler.max_idle_prefill_tokens
    assert all(len(p) * max(f.tokens for f in p) <= BUDGET for p in passes), passes


def test_requests_waiting_while_nothing_decodes_are_admitted_with_the_idle_budget(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # Nobody waits between tokens: three prompts past the budget together (but within the
    # idle budget) are one prefill pass, as one request of three prompts would be.
    prompts = [SHORT, LONG[:60], LONG[:45]]
    expected = one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, prompts,
                            max_new_tokens=4)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_batch_size=8)
    passes = Passes(scheduler.runner, hold_first_prefill=True)
    try:
        first = sequences(tiny_model, smollm2_tokenizer, ["Hi there"], max_new_tokens=1)
        first_stream = scheduler.submit(first)
        assert passes.prefill_started.wait(60)  # the scheduler is inside its prefill
        arrived = [sequences(tiny_model, smollm2_tokenizer, [prompt], max_new_tokens=4)
                   for prompt in prompts]
        streams = [scheduler.submit(seqs) for seqs in arrived]
        passes.release.set()
        collect(first_stream)  # one token: it ends at its prefill, nothing decodes after
        for stream in streams:
            collect(stream)
        settled(scheduler)
    finally:
        passes.remove()
    assert [seqs[0].generated_ids for seqs in arrived] == expected
    lengths = [len(seqs[0].prompt_ids) for seqs in arrived]
    assert len(prompts) * max(lengths) > BUDGET
    assert [[(f.tokens, f.cached) for f in p] for p in passes.prompt_passes()] == [
        [(len(first[0].prompt_ids), 0)], [(n, 0) for n in lengths]]


def test_a_request_cancelled_mid_prefill_leaves_with_its_cache(make_scheduler, tiny_model,
                                                                smollm2_tokenizer):
    events: list[tuple] = []
    tokens = Tokens(events)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_idle_prefill_tokens=BUDGET,
                               observers=[tokens])
    passes = Passes(scheduler.runner, hold_first_prefill=True)
    try:
        stream = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [LONG],
                                            max_new_tokens=8))
        assert passes.prefill_started.wait(60)
        assert scheduler.prefilling_size == 1
        stream.close()
        passes.release.set()
        request_id = stream.sequences[0].request_id[0]
        tokens.wait(lambda: tokens.stats[request_id].outcome is not None)
        tokens.wait(lambda: tokens.state == BatchState())
    finally:
        passes.remove()
    stats = tokens.stats[request_id]
    assert stats.outcome == CANCELLED
    assert stats.generated_tokens == 0  # it never got to its first token
    # the held pass found its request gone at its first layer: no chunk ran to its end
    assert passes.prefill_shapes() == []
    assert scheduler.prefilling_size == 0
    # the chunk's cache left with it
    assert scheduler.runner.handles() == [] and scheduler.runner.tokens_held == 0
    # and the scheduler serves on
    assert collect(scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [SHORT],
                                              max_new_tokens=3)))[1] == 3


def test_a_pass_stops_at_the_next_layer_once_its_only_request_is_cancelled(
        make_scheduler, tiny_model, smollm2_tokenizer):
    # The client leaves while the first layer of a prompt's pass runs: the pass stops
    # before the next layer, rather than reading the rest of its columns for nobody.
    events: list[tuple] = []
    tokens = Tokens(events)
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_idle_prefill_tokens=BUDGET,
                               observers=[tokens])
    layers = tiny_model.model.layers
    submitted = threading.Event()
    box: dict = {}
    reached: list[int] = []

    def layer_starts(index):
        def hook(module, args):
            if index == 0 and not reached:  # the first pass: the client leaves now
                assert submitted.wait(60)
                box["stream"].close()
            reached.append(index)
        return hook

    hooks = [layer.register_forward_pre_hook(layer_starts(i)) for i, layer in enumerate(layers)]
    try:
        box["stream"] = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [LONG],
                                                   max_new_tokens=8))
        submitted.set()
        request_id = box["stream"].sequences[0].request_id[0]
        tokens.wait(lambda: tokens.stats[request_id].outcome is not None)
        tokens.wait(lambda: tokens.state == BatchState())
    finally:
        for hook in hooks:
            hook.remove()
    assert len(layers) > 1
    assert reached == [0]  # no other layer, and no other pass
    assert tokens.stats[request_id].outcome == CANCELLED
    assert scheduler.runner.handles() == [] and scheduler.runner.tokens_held == 0
    assert collect(scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [SHORT],
                                              max_new_tokens=3)))[1] == 3


def test_a_chunk_that_raises_fails_only_its_request(make_scheduler, tiny_model,
                                                     smollm2_tokenizer):
    scheduler = make_scheduler(max_batch_prefill_tokens=BUDGET, max_idle_prefill_tokens=BUDGET)
    # a later chunk of a prompt (not its first) fails, inside the model's forward
    passes = Passes(scheduler.runner, fails=lambda feeds: any(
        f.prompt and f.cached > 0 and f.tokens > 1 for f in feeds))
    try:
        running_seqs = sequences(tiny_model, smollm2_tokenizer, [SHORT],
                                 max_new_tokens=100_000, ignore_eos=True)
        running = scheduler.submit(running_seqs)
        next(running)
        doomed = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [LONG],
                                            max_new_tokens=8))
        with pytest.raises(GenerationFailed, match="simulated device failure"):
            collect(doomed)
        passes.fails = None
        assert passes.failed
        assert scheduler.prefilling_size == 0
        # the running stream goes on, with its solo text, and the next long prompt goes in
        next(running)
        after = sequences(tiny_model, smollm2_tokenizer, [LONG], max_new_tokens=8)
        collect(scheduler.submit(after))
        running.close()
        settled(scheduler)
    finally:
        passes.remove()
    assert scheduler.runner.handles() == []  # no cache left behind by the failed request
    generated = running_seqs[0].generated_ids
    assert one_pass_ids(make_scheduler, tiny_model, smollm2_tokenizer, [SHORT],
                        max_new_tokens=len(generated), ignore_eos=True)[0] == generated
    assert after[0].generated_ids == one_pass_ids(make_scheduler, tiny_model,
                                                  smollm2_tokenizer, [LONG],
                                                  max_new_tokens=8)[0]


def cached_keys(runner, batch):
    """Each row's keys and values in ``runner``'s cache, every layer, its positions only."""
    cache = runner.cache
    rows = []
    for handle in batch.handles:
        row, length = cache.row_of(handle), runner.length(handle)
        rows.append([layer[row, :, :length].clone() for layer in cache.keys + cache.values])
    return rows


def test_prefill_chunk_builds_the_cache_a_one_pass_prefill_builds(tiny_model, smollm2_tokenizer):
    prompts = [LONG[:120], SHORT]
    runner = load_runner(tiny_model, RUNNER_SETTINGS)
    assert runner.path == "attention"

    def batch_of():
        seqs = sequences(tiny_model, smollm2_tokenizer, prompts, max_new_tokens=6)
        return seqs, CausalLMBatch.from_sequences(runner, seqs)

    one_pass, batch = batch_of()
    _, batch = generate_token(runner, batch)
    expected_cache = cached_keys(runner, batch)
    while batch is not None:
        _, batch = generate_token(runner, batch)
    chunked, batch = batch_of()
    lengths = [len(seq.prompt_ids) for seq in chunked]
    width = batch.columns_to_feed
    assert width == max(lengths)
    batch = prefill_chunk(runner, batch, 5)
    batch = prefill_chunk(runner, batch, 7)
    assert (batch.cache_length, batch.columns_to_feed) == (12, width - 12)
    # each row cached its share of the 12 columns, the prompts aligned on their ends
    assert [runner.length(h) for h in batch.handles] == [max(0, n - (width - 12))
                                                         for n in lengths]
    _, batch = generate_token(runner, batch)
    assert [runner.length(h) for h in batch.handles] == lengths
    for ours, theirs in zip(cached_keys(runner, batch), expected_cache):
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    while batch is not None:
        _, batch = generate_token(runner, batch)
    assert [s.generated_ids for s in chunked] == [s.generated_ids for s in one_pass]
    assert runner.handles() == []  # finished rows left, their caches freed
    seqs, fresh = batch_of()
    with pytest.raises(ValueError, match="1 to"):
        prefill_chunk(runner, fresh, width)  # the last column picks a token
    fresh.release()


def test_the_budget_is_at_least_a_decode_step_and_has_a_default_per_device(tiny_model):
    runner = load_runner(tiny_model, RUNNER_SETTINGS)
    with pytest.raises(ValueError, match="at least max_batch_size"):
        Scheduler(runner, max_batch_size=8, max_batch_prefill_tokens=4)
    from djl_stream.generation.scheduler import default_max_batch_prefill_tokens

    scheduler = Scheduler(runner, max_batch_size=4)
    try:
        assert scheduler.max_batch_prefill_tokens == default_max_batch_prefill_tokens("cpu")
    finally:
        scheduler.shutdown()
