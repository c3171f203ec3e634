"""The Accelerate engine on a tiny random Llama with the real SmolLM2 tokenizer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from conftest import build_tiny_llama
from djl_stream import StreamingUtils
from djl_stream.generation.batch import CausalLMBatch, generate_token
from djl_stream.generation.engines.accelerate import (AccelerateEngine, AccelerateSettings,
                                                      build_sequences, encode_prompts)
from djl_stream.runtime.runner import RunnerSettings, load_runner

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog because",
    "Name a primary colour.",
]


@pytest.fixture(scope="module")
def runner(tiny_model):
    return load_runner(tiny_model, RunnerSettings(max_rows=8, max_positions=256))


def stream_text(model, tokenizer, prompts, **parameters):
    """Run the registered stream generator; return each prompt's text and the step count."""
    generator = StreamingUtils.get_stream_generator("Accelerate")
    texts = [""] * len(prompts)
    steps = 0
    for pieces in generator(model, tokenizer, prompts, **parameters):
        assert len(pieces) == len(prompts)
        steps += 1
        for i, piece in enumerate(pieces):
            texts[i] += piece
    return texts, steps


def run_tokens(runner, tokenizer, prompts, **parameters):
    """Token ids each prompt generates, driving generate_token directly."""
    sequences = build_sequences(runner.model, tokenizer, encode_prompts(tokenizer, prompts),
                                **parameters)
    batch = CausalLMBatch.from_sequences(runner, sequences)
    while batch is not None:
        _, batch = generate_token(runner, batch)
    return [seq.generated_ids for seq in sequences]


class Passes:
    """Records each pass a runner runs: one list of ``(handle, tokens fed, positions cached
    before)`` per pass, one item per feed."""

    def __init__(self, runner):
        self.seen: list[list[tuple[int, int, int]]] = []
        real = runner.run

        def run(feeds):
            self.seen.append([(f.handle, len(f.tokens), runner.length(f.handle)) for f in feeds])
            return real(feeds)

        runner.run = run


def scheduler_threads() -> int:
    return sum(t.name == "djl-stream-scheduler" and t.is_alive() for t in threading.enumerate())


def test_greedy_matches_transformers_generate(tiny_model, runner, smollm2_tokenizer):
    prompt = PROMPTS[1]
    ids = smollm2_tokenizer(prompt, return_tensors="pt")
    reference = tiny_model.generate(
        **ids, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=2
    )[0, ids["input_ids"].shape[1]:].tolist()
    # eos can't end the reference early (eos_token_id=None), so make sure it isn't hit here
    assert 2 not in reference
    assert run_tokens(runner, smollm2_tokenizer, [prompt], max_new_tokens=20) == [reference]


def test_batched_prompts_of_different_lengths_match_each_prompt_alone(tiny_model, runner,
                                                                     smollm2_tokenizer):
    together = run_tokens(runner, smollm2_tokenizer, PROMPTS, max_new_tokens=24)
    alone = [run_tokens(runner, smollm2_tokenizer, [p], max_new_tokens=24)[0] for p in PROMPTS]
    assert together == alone
    texts, _ = stream_text(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=24)
    assert texts == [stream_text(tiny_model, smollm2_tokenizer, [p], max_new_tokens=24)[0][0] for p in PROMPTS]


def test_the_prompt_runs_once_and_each_step_feeds_one_token(tiny_model, smollm2_tokenizer):
    engine = AccelerateEngine(tiny_model, smollm2_tokenizer,
                              AccelerateSettings(max_batch_size=4, max_input_length=64,
                                                 max_new_tokens=16))
    passes = Passes(engine.runner)
    try:
        steps = len(list(engine.generate(PROMPTS[:2], max_new_tokens=10, ignore_eos=True)))
    finally:
        engine.shutdown()
    lengths = [len(ids) for ids in encode_prompts(smollm2_tokenizer, PROMPTS[:2])]
    assert steps == 10
    assert len(passes.seen) == 10
    # one pass reads both prompts whole, from empty caches...
    prefill, *decode = passes.seen
    assert [(tokens, cached) for _, tokens, cached in prefill] == [(n, 0) for n in lengths]
    handles = [handle for handle, _, _ in prefill]
    # ...then each step feeds each row the one token it chose, after what it holds
    for step, feeds in enumerate(decode):
        assert [(h, tokens) for h, tokens, _ in feeds] == [(h, 1) for h in handles]
        assert [cached for _, _, cached in feeds] == [n + step for n in lengths]


def test_each_prompt_stops_at_max_new_tokens_and_the_list_keeps_its_shape(tiny_model, smollm2_tokenizer):
    generator = StreamingUtils.get_stream_generator("Accelerate")
    items = list(generator(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=5))
    assert len(items) == 5
    assert all(len(item) == len(PROMPTS) for item in items)


def test_generation_stops_at_any_eos_id_and_emits_no_eos_text(runner, smollm2_tokenizer):
    free_run = run_tokens(runner, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=12)[0]
    # Make the 4th greedy token an end-of-sequence id: generation must end right there.
    eos = free_run[3]
    sequences = build_sequences(runner.model, smollm2_tokenizer,
                                encode_prompts(smollm2_tokenizer, [PROMPTS[0]]), max_new_tokens=12)
    sequences[0].eos_token_ids = frozenset({2, eos})
    batch = CausalLMBatch.from_sequences(runner, sequences)
    steps = 0
    while batch is not None:
        generations, batch = generate_token(runner, batch)
        steps += 1
    seq = sequences[0]
    assert steps == free_run.index(eos) + 1
    assert seq.finish_reason == "eos"
    assert seq.generated_ids == free_run[: free_run.index(eos)]
    assert seq.text == smollm2_tokenizer.decode(seq.generated_ids, skip_special_tokens=True)
    assert runner.handles() == []  # the finished row's cache was freed


def test_stop_string_ends_generation_without_emitting_it(tiny_model, smollm2_tokenizer):
    full, _ = stream_text(tiny_model, smollm2_tokenizer, [PROMPTS[1]], max_new_tokens=30)
    text = full[0]
    assert len(text) > 12, "the random model should produce some text"
    stop = text[6:10]
    expected = text[: text.index(stop)]
    generator = StreamingUtils.get_stream_generator("Accelerate")
    emitted = ""
    for pieces in generator(tiny_model, smollm2_tokenizer, [PROMPTS[1]], max_new_tokens=30, stop=[stop]):
        emitted += pieces[0]
        # nothing past the stop string's start is ever sent, not even a prefix of it
        assert expected.startswith(emitted)
    assert emitted == expected


def test_manual_seed_makes_sampling_reproducible_alone_or_batched(runner, smollm2_tokenizer):
    sampling = dict(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=200, top_p=0.95)
    first = run_tokens(runner, smollm2_tokenizer, [PROMPTS[1]], manual_seed=7, **sampling)
    again = run_tokens(runner, smollm2_tokenizer, [PROMPTS[1]], manual_seed=7, **sampling)
    other = run_tokens(runner, smollm2_tokenizer, [PROMPTS[1]], manual_seed=8, **sampling)
    assert first == again
    assert first != other
    greedy = run_tokens(runner, smollm2_tokenizer, [PROMPTS[1]], max_new_tokens=16)
    assert first != greedy
    # batched with other prompts, the seeded row samples what it sampled alone
    batched = run_tokens(runner, smollm2_tokenizer, PROMPTS, manual_seed=7, **sampling)
    assert batched[1] == first[0]


def test_repetition_penalty_changes_greedy_output(runner, smollm2_tokenizer):
    plain = run_tokens(runner, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=20)[0]
    penalised = run_tokens(runner, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=20,
                           repetition_penalty=5.0)[0]
    # a random tiny model repeats itself; a strong penalty must reduce repeats
    assert len(set(penalised)) > len(set(plain))


def test_unknown_parameter_is_refused(tiny_model, smollm2_tokenizer):
    generator = StreamingUtils.get_stream_generator("Accelerate")
    with pytest.raises(ValueError, match="num_beams"):
        generator(tiny_model, smollm2_tokenizer, ["hi"], num_beams=2)


def test_closing_the_stream_stops_generation(tiny_model, smollm2_tokenizer):
    engine = AccelerateEngine(tiny_model, smollm2_tokenizer,
                              AccelerateSettings(max_batch_size=4, max_input_length=64,
                                                 max_new_tokens=1000))
    passes = Passes(engine.runner)
    try:
        stream = engine.generate([PROMPTS[0]], max_new_tokens=1000, ignore_eos=True)
        next(stream)
        next(stream)
        stream.close()
        with pytest.raises(StopIteration):
            next(stream)
        # The decode loop runs ahead of its readers; it notices the cancellation at
        # its next step, after which no forward pass runs for this request.
        deadline = time.monotonic() + 10
        while engine.scheduler.running_size and time.monotonic() < deadline:
            time.sleep(0.01)
        calls = len(passes.seen)
        time.sleep(0.3)
        assert len(passes.seen) == calls
        assert engine.scheduler.running_size == 0
        # and the request's cache is freed
        assert engine.runner.handles() == [] and engine.runner.tokens_held == 0
    finally:
        engine.shutdown()
    assert calls < 1000


def test_a_one_call_stream_shuts_its_engine_down_when_it_ends_or_is_closed(
        tiny_model, smollm2_tokenizer):
    generator = StreamingUtils.get_stream_generator("Accelerate")
    before = scheduler_threads()
    stream = generator(tiny_model, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=1000,
                       ignore_eos=True)
    next(stream)
    assert scheduler_threads() == before + 1
    stream.close()
    assert scheduler_threads() == before
    stream = generator(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=3)
    assert len(list(stream)) <= 3
    assert scheduler_threads() == before


def test_separate_calls_of_the_stream_generator_each_give_what_one_call_alone_gives(
        tiny_model, smollm2_tokenizer):
    generator = StreamingUtils.get_stream_generator("Accelerate")
    alone = [stream_text(tiny_model, smollm2_tokenizer, [p], max_new_tokens=8)[0][0]
             for p in PROMPTS[:2]]
    first = generator(tiny_model, smollm2_tokenizer, [PROMPTS[0]], max_new_tokens=8)
    second = generator(tiny_model, smollm2_tokenizer, [PROMPTS[1]], max_new_tokens=8)
    try:
        texts = ["".join(p[0] for p in first), "".join(p[0] for p in second)]
    finally:
        first.close()
        second.close()
    assert texts == alone


@pytest.mark.fast_path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_holds_the_model_s_dtype(smollm2_tokenizer, dtype):
    model = build_tiny_llama(len(smollm2_tokenizer)).to(dtype)
    runner = load_runner(model, RunnerSettings(max_rows=2, max_positions=64))
    assert runner.path == "attention", getattr(runner, "reason", "")
    assert {keys.dtype for keys in runner.cache.keys} == {dtype}
    assert {values.dtype for values in runner.cache.values} == {dtype}
    tokens = run_tokens(runner, smollm2_tokenizer, ["hi"], max_new_tokens=3)
    assert len(tokens[0]) <= 3 and runner.tokens_held == 0
