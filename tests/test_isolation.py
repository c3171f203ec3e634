"""A request's failure is its own: what one request's parameters or numbers break ends that
request, and every request it shared the batch with finishes with its solo text.

On the tiny model through the real scheduler: a row whose sampling overflows (the kind of
parameters the schema now refuses, sent past it), a multi-prompt request with one such row,
a decode step that raises for one request's rows (a model with a position limit, failing
after its layers wrote the step into the KV cache), and a shared prefill that raises for
one prompt.
"""

from __future__ import annotations

import threading

import pytest
import torch

from djl_stream.generation.errors import GenerationFailed
from djl_stream.generation.sampling import TokenChooser, UnusableScores, choose_next_tokens
from test_scheduler import PROMPTS, Passes, collect, sequences, solo_texts, tiny_runner

#: What the schema refuses, handed straight to the engine: the scores divided by it overflow
#: (the tiny model's logits are small, so it takes less than the 1e-37 that broke SmolLM2's).
OVERFLOWING = dict(do_sample=True, temperature=1e-45, manual_seed=1)


@pytest.fixture()
def make_scheduler(tiny_model):
    from djl_stream.generation.scheduler import Scheduler

    schedulers = []

    def make(**settings):
        # Pass widths sized by the token budget alone: the stall bound times passes on
        # the real clock, so widths would depend on this machine's speed (the bound's
        # own tests drive it with a simulated clock).
        settings.setdefault("prefill_stall_steps", 0)
        runner = tiny_runner(tiny_model, settings.get("max_batch_size", 32))
        schedulers.append(Scheduler(runner, **settings))
        return schedulers[-1]
    yield make
    for scheduler in schedulers:
        scheduler.shutdown()


class Hook:
    """A real forward hook on the model that raises where ``fails(kwargs)`` says, after
    the forward pass ran (so every layer has written the step into the KV cache), and can
    hold the first forward until released."""

    def __init__(self, module, fails=None, hold_first=False):
        self.fails = fails
        self.calls = 0
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.handle = module.register_forward_hook(self._after, with_kwargs=True)

    def _after(self, module, args, kwargs, output):
        self.calls += 1
        self.started.set()
        self.release.wait(60)
        if self.fails is not None and self.fails(kwargs):
            raise IndexError("position out of range")

    def remove(self):
        self.handle.remove()


def test_an_overflowing_row_fails_alone_and_its_neighbours_choose():
    logits = torch.tensor([[0.5, 2.0, 1.0], [3.0, 1.0, 0.0], [0.0, 1.0, 4.0]])
    choosers = [TokenChooser(), TokenChooser(**OVERFLOWING), TokenChooser(repetition_penalty=1.2)]
    tokens, failures = choose_next_tokens(choosers, logits, [[], [], [0]])
    assert list(failures) == [1] and isinstance(failures[1], UnusableScores)
    assert (tokens[0], tokens[2]) == (1, 2)


def test_a_poisoned_request_among_running_streams_fails_alone(make_scheduler, tiny_model,
                                                               smollm2_tokenizer):
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS,
                          max_new_tokens=12)
    scheduler = make_scheduler()
    running = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p],
                                          max_new_tokens=12)) for p in PROMPTS]
    firsts = [next(stream) for stream in running]  # all four are decoding
    poisoned = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, ["Count to 100."],
                                          max_new_tokens=30, **OVERFLOWING))
    with pytest.raises(GenerationFailed, match="UnusableScores"):
        collect(poisoned)
    for first, stream, text in zip(firsts, running, expected):
        rest, _ = collect(stream)
        assert first[0] + (rest[0] if rest else "") == text
    assert scheduler.running_size == 0


def test_a_request_with_one_poisoned_prompt_fails_whole_and_leaves_the_batch(
        make_scheduler, tiny_model, smollm2_tokenizer):
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS[:1],
                          max_new_tokens=40)
    scheduler = make_scheduler()
    healthy = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, PROMPTS[:1],
                                         max_new_tokens=40))
    first = next(healthy)
    mixed = sequences(tiny_model, smollm2_tokenizer, [PROMPTS[2]], max_new_tokens=40)
    mixed += sequences(tiny_model, smollm2_tokenizer, [PROMPTS[3]], max_new_tokens=40,
                       **OVERFLOWING)
    with pytest.raises(GenerationFailed, match="UnusableScores"):
        collect(scheduler.submit(mixed))
    rest, _ = collect(healthy)
    assert first[0] + rest[0] == expected[0]


def test_a_decode_step_that_raises_for_one_request_is_retried_without_it(
        make_scheduler, tiny_model, smollm2_tokenizer):
    """A model that cannot go past position 20 (as one with learned positions): the long
    prompt reaches it first. The hook raises after the forward pass, so the failed step has
    written every layer's keys and values into the KV cache; the retry must not count
    them, or the short prompt's text would change."""
    short, long = PROMPTS[0], PROMPTS[1]
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, [short],
                          max_new_tokens=12)[0]
    assert len(smollm2_tokenizer(long)["input_ids"]) + 12 > 20 > \
        len(smollm2_tokenizer(short)["input_ids"]) + 12
    scheduler = make_scheduler()
    passes = Passes(scheduler.runner)
    hook = Hook(tiny_model,
                fails=lambda kwargs: bool((kwargs["position_ids"] >= 20).any()))
    try:
        doomed = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [long],
                                            max_new_tokens=12))
        fine = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [short],
                                          max_new_tokens=12))
        with pytest.raises(GenerationFailed, match="position out of range"):
            collect(doomed)
        assert collect(fine)[0][0] == expected
    finally:
        hook.remove()
        passes.remove()
    assert False in passes.ok  # a pass failed
    # Every pass must find each row's cache exactly as long as the passes that succeeded
    # made it: what the failed step wrote is not counted before the retry.
    fed: dict[int, int] = {}
    for feeds, ok in zip(passes.seen, passes.ok):
        for handle, tokens, cached, _ in feeds:
            assert cached == fed.get(handle, 0), (handle, cached, fed)
        if ok:
            for handle, tokens, _, _ in feeds:
                fed[handle] = fed.get(handle, 0) + tokens


def test_every_request_fails_when_each_fails_alone(make_scheduler, tiny_model,
                                                   smollm2_tokenizer):
    # Every pass that carries a decode token fails (on the fast path a decode step and a
    # prompt read beside it are one (1, T) pass: the pass's feeds tell them apart).
    scheduler = make_scheduler()
    passes = Passes(scheduler.runner)
    hook = Hook(tiny_model, fails=lambda kwargs: any(
        tokens == 1 and cached > 0 for _, tokens, cached, _ in passes.seen[-1]))
    try:
        streams = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p],
                                              max_new_tokens=8)) for p in PROMPTS[:3]]
        for stream in streams:
            with pytest.raises(GenerationFailed, match="position out of range"):
                collect(stream)
        assert scheduler.running_size == 0
    finally:
        hook.remove()
        passes.remove()
    assert all(not ok for feeds, ok in zip(passes.seen, passes.ok)
               if any(tokens == 1 and cached > 0 for _, tokens, cached, _ in feeds))


def test_a_shared_prefill_that_raises_is_retried_one_request_at_a_time(
        make_scheduler, tiny_model, smollm2_tokenizer):
    poison = smollm2_tokenizer("Poison")["input_ids"][-1]
    expected = solo_texts(make_scheduler, tiny_model, smollm2_tokenizer, PROMPTS[2:4],
                          max_new_tokens=6)
    # The first forward (a blocker's prefill) is held until the others have queued, so
    # that they are admitted together and prefilled in one pass. The fast path feeds that
    # pass's rows as one (1, T) sequence: the hook raises in any pass reading the
    # poisoned prompt, the shared one, and the poisoned prompt's own.
    scheduler = make_scheduler()
    passes = Passes(scheduler.runner)
    hook = Hook(tiny_model, hold_first=True,
                fails=lambda kwargs: kwargs["input_ids"].shape[1] > 1
                and bool((kwargs["input_ids"] == poison).any()))
    try:
        blocker = scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [PROMPTS[0]],
                                             max_new_tokens=1))
        assert hook.started.wait(60)
        queued = [scheduler.submit(sequences(tiny_model, smollm2_tokenizer, [p],
                                             max_new_tokens=6))
                  for p in (PROMPTS[2], "Poison", PROMPTS[3])]
        hook.release.set()
        collect(blocker)
        texts = []
        for index, stream in enumerate(queued):
            if index == 1:
                with pytest.raises(GenerationFailed):
                    collect(stream)
            else:
                texts.append(collect(stream)[0][0])
        assert texts == expected
    finally:
        hook.remove()
        passes.remove()
    # they were prefilled together (three prompts in one pass), and that pass failed
    shared = [i for i, feeds in enumerate(passes.seen)
              if len(feeds) == 3 and all(cached == 0 for _, _, cached, _ in feeds)]
    assert shared and not passes.ok[shared[0]]
