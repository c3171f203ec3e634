"""Mixed passes: on the fast path (the model's own forward on djl-stream's KV cache), a
prompt chunk read while requests decode shares one forward pass with their decode step
(the weights are read once for both). Each batch must get what its own passes give it:
the same logits, the same KV cache, the same tokens; a mixed pass that fails runs the two
apart; a runner on the forward path never mixes.

On tiny random models (Llamas with grouped and ungrouped heads, and other architectures
of ``architectures.py``) through the real runner and the real scheduler; separate passes
are the reference.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import architectures
from conftest import build_tiny_llama
from djl_stream.generation.batch import (CausalLMBatch, generate_token, mixed_pass,
                                         prefill_chunk)
from djl_stream.generation.scheduler import Scheduler
from djl_stream.runtime.runner import ForwardRunner, RunnerSettings, load_runner
import test_chunked_prefill as chunked
from test_chunked_prefill import LONG, SHORT, Passes, collect, is_mixed, sequences

RUNNING = ["The capital of France is", "Once upon a time, in a land far away, there lived"]
NEWCOMERS = ["1, 2, 3,", "A very long list of things to remember: milk, eggs, bread, butter,"]
SETTINGS = RunnerSettings(max_rows=8, max_positions=1024)


def llama(tokenizer, kv_heads, seed=7):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        pad_token_id=2)).eval()


def decoding_batch(runner, tokenizer, prompts, steps=2):
    """A batch of ``prompts`` on ``runner``, past its prefill and ``steps`` decode steps."""
    batch = CausalLMBatch.from_sequences(runner, sequences(runner.model, tokenizer, prompts,
                                                           max_new_tokens=50, ignore_eos=True))
    for _ in range(steps + 1):
        _, batch = generate_token(runner, batch)
    return batch


def newcomer_batch(runner, tokenizer, prompts=NEWCOMERS):
    return CausalLMBatch.from_sequences(runner, sequences(runner.model, tokenizer, prompts,
                                                          max_new_tokens=50, ignore_eos=True))


def cached(runner, batch):
    """Every row's keys and values in ``runner``'s cache, every layer, its positions only."""
    cache = runner.cache
    return [[layer[cache.row_of(h), :, :runner.length(h)].clone()
             for layer in cache.keys + cache.values] for h in batch.handles]


def assert_same_cache(ours, theirs, tolerance):
    assert len(ours) == len(theirs)
    for our_row, their_row in zip(ours, theirs):
        for a, b in zip(our_row, their_row):
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("make_model", [
    pytest.param(lambda tokenizer: llama(tokenizer, 2), id="llama-grouped"),
    pytest.param(lambda tokenizer: llama(tokenizer, 4), id="llama-ungrouped"),
    # a sliding window shorter than the prompts; soft-capping and alternating windows;
    # learned positions and no grouped heads
    pytest.param(lambda tokenizer: architectures.build("mistral", len(tokenizer)), id="mistral"),
    pytest.param(lambda tokenizer: architectures.build("gemma2", len(tokenizer)), id="gemma2"),
    pytest.param(lambda tokenizer: architectures.build("gpt2", len(tokenizer)), id="gpt2"),
])
def test_a_mixed_pass_gives_each_batch_what_its_own_passes_give(smollm2_tokenizer, make_model):
    model = make_model(smollm2_tokenizer)
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 1e-8
    apart_runner, mixed_runner = load_runner(model, SETTINGS), load_runner(model, SETTINGS)
    assert apart_runner.path == mixed_runner.path == "attention"
    assert mixed_runner.mixes_passes
    chunk = 5

    # apart: the running rows' step in a pass of its own, the chunks in passes of theirs
    running = decoding_batch(apart_runner, smollm2_tokenizer, RUNNING)
    expected_step = apart_runner.run(running.decode_feeds())
    expected_running = cached(apart_runner, running)
    newcomer = newcomer_batch(apart_runner, smollm2_tokenizer)
    apart_runner.run(newcomer.chunk_feeds(chunk))
    newcomer = newcomer.after_chunk(chunk)
    expected_after_chunk = cached(apart_runner, newcomer)
    expected_first = apart_runner.run(newcomer.chunk_feeds(newcomer.columns_to_feed))
    expected_newcomer = cached(apart_runner, newcomer)

    # mixed: the same two batches, a chunk then the rest, each beside a decode step
    running = decoding_batch(mixed_runner, smollm2_tokenizer, RUNNING)
    newcomer = newcomer_batch(mixed_runner, smollm2_tokenizer)
    step_logits = mixed_runner.run(running.decode_feeds() + newcomer.chunk_feeds(chunk))
    # not the last chunk: logits for the running rows alone
    assert step_logits.shape == expected_step.shape
    torch.testing.assert_close(step_logits, expected_step, rtol=tolerance, atol=tolerance)
    assert_same_cache(cached(mixed_runner, running), expected_running, tolerance)
    newcomer = newcomer.after_chunk(chunk)
    assert_same_cache(cached(mixed_runner, newcomer), expected_after_chunk, tolerance)

    # (the running rows take another step: any batch at a step will do)
    logits = mixed_runner.run(running.decode_feeds()
                              + newcomer.chunk_feeds(newcomer.columns_to_feed))
    assert logits.shape[0] == len(RUNNING) + len(NEWCOMERS)
    torch.testing.assert_close(logits[len(RUNNING):], expected_first, rtol=tolerance,
                               atol=tolerance)
    assert [mixed_runner.length(h) for h in newcomer.handles] == [
        len(seq.prompt_ids) for seq in newcomer.sequences]
    assert_same_cache(cached(mixed_runner, newcomer), expected_newcomer, tolerance)


def test_mixed_passes_choose_the_tokens_separate_passes_choose(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=11)

    def run(mixed):
        runner = load_runner(model, SETTINGS)
        passes = Passes(runner)
        try:
            running = decoding_batch(runner, smollm2_tokenizer, RUNNING)
            newcomer = newcomer_batch(runner, smollm2_tokenizer)
            first = []
            while not first:
                width = min(4, newcomer.columns_to_feed)
                if mixed:
                    _, running, first, newcomer = mixed_pass(runner, running, newcomer, width)
                elif width < newcomer.columns_to_feed:
                    newcomer = prefill_chunk(runner, newcomer, width)
                    _, running = generate_token(runner, running)
                else:
                    first, newcomer = generate_token(runner, newcomer)
                    _, running = generate_token(runner, running)
            batch = CausalLMBatch.concatenate([running, newcomer])
            for _ in range(6):
                _, batch = generate_token(runner, batch)
        finally:
            passes.remove()
        assert any(is_mixed(p) for p in passes.seen) is mixed
        return [seq.generated_ids for seq in batch.sequences]

    apart = run(False)
    assert run(True) == apart
    longest = max(len(smollm2_tokenizer(p)["input_ids"]) for p in NEWCOMERS)
    passes = -(-longest // 4)  # the running rows took a step in each
    assert [len(ids) for ids in apart] == [3 + passes + 6] * 2 + [1 + 6] * 2


def test_a_runner_on_the_forward_path_never_mixes(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=5)
    runner = ForwardRunner(model, "chosen by the test")
    assert runner.path == "forward" and not runner.mixes_passes
    expected_long = alone(model, smollm2_tokenizer, LONG, max_new_tokens=8)
    scheduler = Scheduler(runner, max_batch_size=4, max_batch_prefill_tokens=16,
                          prefill_stall_steps=0)
    passes = Passes(runner)
    try:
        running_seqs, long_seqs = chunked.long_prompt_beside_a_stream(
            scheduler, model, smollm2_tokenizer, once_decoding=passes.clear)
    finally:
        scheduler.shutdown()
        passes.remove()
    # the long prompt went in chunks of its own, the running stream's steps in passes of
    # theirs, and both generated what they generate alone
    chunks = passes.prompt_passes()
    assert len(chunks) >= len(long_seqs[0].prompt_ids) // 16
    assert not any(is_mixed(p) for p in passes.ran)
    assert long_seqs[0].generated_ids == expected_long
    generated = running_seqs[0].generated_ids
    assert alone(model, smollm2_tokenizer, SHORT, max_new_tokens=len(generated),
                 ignore_eos=True) == generated


def mixed_passes(passes):
    """The mixed passes ``passes`` saw (raised or not), each as ``(decode rows, prompt
    rows, prompt columns)``."""
    return [(sum(not f.prompt for f in p), sum(f.prompt for f in p),
             max(f.tokens for f in p if f.prompt)) for p in passes.seen if is_mixed(p)]


@pytest.fixture()
def model(smollm2_tokenizer):
    return build_tiny_llama(len(smollm2_tokenizer), seed=5)


def alone(model, tokenizer, prompt, **parameters):
    scheduler = Scheduler(load_runner(model, SETTINGS), max_batch_prefill_tokens=100_000,
                          prefill_stall_steps=0)
    try:
        seqs = sequences(model, tokenizer, [prompt], **parameters)
        collect(scheduler.submit(seqs))
    finally:
        scheduler.shutdown()
    return seqs[0].generated_ids


def long_prompt_beside_a_stream(model, tokenizer, budget=16, **watching):
    """test_chunked_prefill's scenario (:data:`LONG` read beside :data:`SHORT` decoding,
    chunks of ``budget`` tokens) on ``model``. Returns both requests' sequences and the
    :class:`Passes` (of ``watching``'s options) that saw it, from the moment the
    short prompt decodes."""
    runner = load_runner(model, SETTINGS)
    assert runner.mixes_passes
    scheduler = Scheduler(runner, max_batch_size=4, max_batch_prefill_tokens=budget,
                          prefill_stall_steps=0)
    passes = Passes(runner, **watching)
    try:
        running_seqs, long_seqs = chunked.long_prompt_beside_a_stream(
            scheduler, model, tokenizer, once_decoding=passes.clear)
    finally:
        scheduler.shutdown()
        passes.remove()
    return running_seqs, long_seqs, passes


def test_a_prompt_read_beside_a_stream_shares_its_passes_and_both_generate_what_they_do_alone(
        model, smollm2_tokenizer):
    expected_long = alone(model, smollm2_tokenizer, LONG, max_new_tokens=8)
    running_seqs, long_seqs, passes = long_prompt_beside_a_stream(model, smollm2_tokenizer)
    assert long_seqs[0].generated_ids == expected_long
    generated = running_seqs[0].generated_ids
    assert alone(model, smollm2_tokenizer, SHORT, max_new_tokens=len(generated),
                 ignore_eos=True) == generated
    # the long prompt went in mixed passes only, each beside the running row's step and
    # within the budget
    prompt_length = len(long_seqs[0].prompt_ids)
    assert all(is_mixed(p) for p in passes.seen if any(f.prompt for f in p))
    mixed = mixed_passes(passes)
    assert sum(columns for _, _, columns in mixed) == prompt_length
    assert all(rows == 1 and prompt_rows == 1 and columns <= 16
               for rows, prompt_rows, columns in mixed)
    assert len(mixed) >= prompt_length // 16


def test_a_mixed_pass_that_fails_runs_the_prefill_and_the_step_apart(
        model, smollm2_tokenizer, caplog):
    expected_long = alone(model, smollm2_tokenizer, LONG, max_new_tokens=8)
    failures = [2]

    def fails(feeds):  # the first two mixed passes raise, inside the model's forward
        if is_mixed(feeds) and failures[0]:
            failures[0] -= 1
            return True
        return False

    with caplog.at_level(logging.WARNING, logger="djl_stream.generation.scheduler"):
        running_seqs, long_seqs, passes = long_prompt_beside_a_stream(
            model, smollm2_tokenizer, fails=fails)
    assert sum("a mixed pass failed" in r.getMessage() for r in caplog.records) == 2
    assert long_seqs[0].generated_ids == expected_long
    generated = running_seqs[0].generated_ids
    assert alone(model, smollm2_tokenizer, SHORT, max_new_tokens=len(generated),
                 ignore_eos=True) == generated
    # each failed pass was run apart: its chunk in a pass of its own, then the step in one
    # of its own; the rest of the prompt went mixed
    assert failures == [0] and len(passes.failed) == 2
    for index in passes.failed:
        failed, chunk, step = passes.seen[index:index + 3]
        assert is_mixed(failed)
        assert [(f.handle, f.cached) for f in chunk] == [(f.handle, f.cached)
                                                        for f in failed if f.prompt]
        assert all(f.prompt for f in chunk)
        assert [(f.handle, f.tokens, f.cached) for f in step] == [
            (f.handle, f.tokens, f.cached) for f in failed if not f.prompt]
    ran = passes.prompt_passes()
    assert sum(f.tokens for p in ran for f in p) == len(long_seqs[0].prompt_ids)
    assert any(is_mixed(p) for p in passes.ran)


def test_a_prompt_cancelled_part_way_leaves_at_the_next_pass_and_the_stream_goes_on(
        model, smollm2_tokenizer):
    runner = load_runner(model, SETTINGS)
    scheduler = Scheduler(runner, max_batch_size=4, max_batch_prefill_tokens=16,
                          prefill_stall_steps=0)
    streams, closed_at = [], []

    def leave(feeds):  # the client of the long prompt leaves during its second mixed pass
        if is_mixed(feeds) and streams and not closed_at:
            count = len(mixed_passes(passes))  # (this one included)
            if count >= 2:
                closed_at.append(count)
                streams[0].close()

    passes = Passes(runner, on_pass=leave)
    try:
        running = scheduler.submit(sequences(model, smollm2_tokenizer, [SHORT],
                                             max_new_tokens=100_000, ignore_eos=True))
        next(running)
        streams.append(scheduler.submit(sequences(model, smollm2_tokenizer, [LONG],
                                                  max_new_tokens=8)))
        for _ in range(200):  # until it has left and its prefill with it
            next(running)
            if closed_at and not scheduler.prefilling_size:
                break
        # the pass under way when it left was its last; the stream goes on alone
        assert closed_at and len(mixed_passes(passes)) == closed_at[0], (
            closed_at, mixed_passes(passes))
        assert sum(columns for _, _, columns in mixed_passes(passes)) < len(
            smollm2_tokenizer(LONG)["input_ids"])
        for _ in range(3):
            next(running)
        assert len(mixed_passes(passes)) == closed_at[0]
        # the stream's steps since feed its row alone
        assert all(len(p) == 1 and not p[0].prompt for p in passes.seen[-3:])
        running.close()
    finally:
        scheduler.shutdown()
        passes.remove()


def test_a_running_batch_whose_step_is_outdated_takes_its_step_alone(
        model, smollm2_tokenizer, monkeypatch):
    # The scheduler hands the pacer each step's rows, and where the pacer says the running
    # batch outgrew the last step timed alone (prefill_pacing.STEP_GROWTH), the prompt's
    # chunks are read in passes of their own and the running batch's steps run alone
    # (timed), instead of in mixed passes.
    runner = load_runner(model, SETTINGS)
    scheduler = Scheduler(runner, max_batch_size=4, max_batch_prefill_tokens=16,
                          prefill_stall_steps=1.5)
    passes = Passes(runner)
    monkeypatch.setattr(scheduler._pacer, "step_outdated", lambda rows: True)
    try:
        running_seqs, long_seqs = chunked.long_prompt_beside_a_stream(
            scheduler, model, smollm2_tokenizer, once_decoding=lambda: None)
        steps = list(scheduler._pacer._recent_steps)
    finally:
        scheduler.shutdown()
        passes.remove()
    assert mixed_passes(passes) == []
    assert len(passes.prompt_passes()) >= 2  # the long prompt went in chunks all the same
    assert len(long_seqs[0].generated_ids) == 8
    assert steps and {rows for rows, _ in steps} <= {1, 2}  # one row, then the two
