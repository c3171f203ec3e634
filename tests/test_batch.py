"""Batches of runner handles: what each pass feeds, who leaves, who joins."""

from __future__ import annotations

import pytest
import torch

from djl_stream.generation.batch import (CausalLMBatch, generate_token, mixed_pass,
                                         prefill_chunk)
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.runtime.runner import RunnerSettings, load_runner


@pytest.fixture()
def runner(tiny_model):
    return load_runner(tiny_model, RunnerSettings(max_rows=8, max_positions=256))


def sequences(tokenizer, prompts, new_tokens=6, first_id=0):
    return [GenerationSequence(first_id + i, tokenizer(p)["input_ids"], tokenizer,
                               max_new_tokens=new_tokens, eos_token_ids=set(), ignore_eos=True)
            for i, p in enumerate(prompts)]


def test_the_prompts_of_a_batch_are_read_aligned_on_their_ends(runner, smollm2_tokenizer):
    batch = CausalLMBatch.from_sequences(runner, [
        GenerationSequence(0, [5, 6, 7, 8, 9], smollm2_tokenizer, max_new_tokens=2,
                           eos_token_ids=set()),
        GenerationSequence(1, [10, 11], smollm2_tokenizer, max_new_tokens=2,
                           eos_token_ids=set())])
    assert batch.columns_to_feed == 5
    first = batch.chunk_feeds(2)
    assert [list(f.tokens) for f in first] == [[5, 6]] and not first[0].logits
    batch = prefill_chunk(runner, batch, 2)
    second = batch.chunk_feeds(2)
    assert [list(f.tokens) for f in second] == [[7, 8], [10]]
    batch = prefill_chunk(runner, batch, 2)
    last = batch.chunk_feeds(batch.columns_to_feed)
    assert [list(f.tokens) for f in last] == [[9], [11]] and all(f.logits for f in last)


def test_chunked_and_one_pass_prefills_choose_the_same_tokens(tiny_model, smollm2_tokenizer):
    prompts = ["The quick brown fox jumps over the lazy dog", "Hello"]

    def generated(chunk: int):
        runner = load_runner(tiny_model, RunnerSettings(max_rows=4, max_positions=128))
        seqs = sequences(smollm2_tokenizer, prompts)
        batch = CausalLMBatch.from_sequences(runner, seqs)
        while chunk and batch.columns_to_feed > chunk:
            batch = prefill_chunk(runner, batch, chunk)
        while batch is not None:
            _, batch = generate_token(runner, batch)
        return [s.generated_ids for s in seqs]

    assert generated(chunk=3) == generated(chunk=0)


def test_filter_frees_the_leaving_rows_and_a_finished_batch_frees_all(runner, smollm2_tokenizer):
    batch = CausalLMBatch.from_sequences(runner, sequences(smollm2_tokenizer, ["a b", "c d e"]))
    _, batch = generate_token(runner, batch)
    assert len(runner.handles()) == 2
    kept = batch.filter([1])
    assert kept.request_ids == [1] and runner.handles() == kept.handles
    while kept is not None:
        _, kept = generate_token(runner, kept)
    assert runner.handles() == [] and runner.tokens_held == 0


def test_a_prefilled_batch_joins_a_running_one_and_each_row_keeps_its_tokens(
        runner, tiny_model, smollm2_tokenizer):
    from conftest import greedy_in_one_batch

    alone = [greedy_in_one_batch(load_runner(tiny_model), smollm2_tokenizer, [p], 6)[0]
             for p in ("One two three", "A much longer prompt than the other one")]
    first = sequences(smollm2_tokenizer, ["One two three"])
    running = CausalLMBatch.from_sequences(runner, first)
    for _ in range(3):
        _, running = generate_token(runner, running)
    late = sequences(smollm2_tokenizer, ["A much longer prompt than the other one"], first_id=1)
    joining = CausalLMBatch.from_sequences(runner, late)
    _, joining = generate_token(runner, joining)
    running = CausalLMBatch.concatenate([running, joining])
    assert running.request_ids == [0, 1]
    while running is not None:
        _, running = generate_token(runner, running)
    assert [first[0].generated_ids, late[0].generated_ids] == alone


def test_a_mixed_pass_gives_both_batches_what_their_own_passes_give(tiny_model, smollm2_tokenizer):
    def run(mixed: bool):
        runner = load_runner(tiny_model, RunnerSettings(max_rows=4, max_positions=128))
        stream_seqs = sequences(smollm2_tokenizer, ["Colours of the rainbow"], new_tokens=10)
        prompt_seqs = sequences(smollm2_tokenizer, ["One two three four five six"], first_id=1)
        stream = CausalLMBatch.from_sequences(runner, stream_seqs)
        _, stream = generate_token(runner, stream)
        prefill = CausalLMBatch.from_sequences(runner, prompt_seqs)
        while not prefill.decoding:
            columns = min(2, prefill.columns_to_feed)
            if mixed:
                _, stream, _, prefill = mixed_pass(runner, stream, prefill, columns)
                continue
            if columns < prefill.columns_to_feed:
                prefill = prefill_chunk(runner, prefill, columns)
            else:
                _, prefill = generate_token(runner, prefill)
            _, stream = generate_token(runner, stream)
        joined = CausalLMBatch.concatenate([stream, prefill])
        while joined is not None:
            _, joined = generate_token(runner, joined)
        return stream_seqs[0].generated_ids, prompt_seqs[0].generated_ids

    assert run(mixed=True) == run(mixed=False)


def test_a_batch_needs_a_prompt_in_every_row(runner, smollm2_tokenizer):
    with pytest.raises(ValueError, match="empty prompt"):
        CausalLMBatch.from_sequences(runner, [GenerationSequence(
            0, [], smollm2_tokenizer, max_new_tokens=2, eos_token_ids=set())])
    assert runner.handles() == []
