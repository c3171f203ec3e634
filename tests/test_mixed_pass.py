"""Mixed passes: where djl-stream's Llama step is attached, a prompt chunk read while
requests decode shares one forward pass with their decode step (the weights are read once
for both). Each batch must get what its own passes give it: the same logits, the same KV
cache, the same tokens; a mixed pass that fails runs the two apart.

On tiny random Llamas (grouped and ungrouped heads, plain and prepacked weights) through
the real step and the real scheduler; the model's forward is the reference.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import build_tiny_llama
from djl_stream.generation import kv_cache, llama_decode
from djl_stream.generation.batch import (CausalLMBatch, forward_logits, generate_token,
                                         mixed_pass, mixed_pass_possible, prefill_chunk)
from djl_stream.generation.packed_linear import pack_linear_layers, packing_unavailable
from djl_stream.generation.row_padding import RowPaddedLinear
from djl_stream.generation.scheduler import Scheduler
import test_chunked_prefill as chunked
from test_chunked_prefill import LONG, SHORT
from test_row_padding import pad_everything
from test_scheduler import collect, sequences

RUNNING = ["The capital of France is", "Once upon a time, in a land far away, there lived"]
NEWCOMERS = ["1, 2, 3,", "A very long list of things to remember: milk, eggs, bread, butter,"]

_NO_PACKING = pytest.mark.skipif(packing_unavailable() is not None,
                                 reason=f"this PyTorch cannot prepack: {packing_unavailable()}")


def llama(tokenizer, kv_heads, seed=7):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=1024,
        pad_token_id=2)).eval()


def decoding_batch(model, tokenizer, prompts, steps=2):
    """A left-padded batch of ``prompts`` past its prefill and ``steps`` decode steps."""
    batch = CausalLMBatch.from_sequences(sequences(model, tokenizer, prompts, max_new_tokens=50,
                                                   ignore_eos=True),
                                         pad_token_id=2, device="cpu")
    for _ in range(steps + 1):
        _, batch = generate_token(model, batch)
    return batch


def newcomer_batch(model, tokenizer, prompts=NEWCOMERS):
    return CausalLMBatch.from_sequences(sequences(model, tokenizer, prompts, max_new_tokens=50,
                                                  ignore_eos=True),
                                        pad_token_id=2, device="cpu")


def real_columns(batch):
    """The cache's keys of every layer, padding columns zeroed (what fills them is
    nobody's: no real column attends to them)."""
    mask = batch.attention_mask[:, :batch.cache_length].bool()[:, None, :, None]
    return [layer.keys * mask for layer in kv_cache.layers(batch.past_key_values)]


@pytest.mark.parametrize("kv_heads, packed, padded", [
    pytest.param(2, False, False, id="grouped"),
    pytest.param(4, False, False, id="ungrouped"),
    pytest.param(2, True, False, id="grouped-packed", marks=_NO_PACKING),
    # products of 1-15 rows padded to 16 (row_padding): the first mixed pass is 12 rows
    pytest.param(2, False, True, id="grouped-padded"),
])
def test_a_mixed_pass_gives_each_batch_what_its_own_passes_give(smollm2_tokenizer, monkeypatch,
                                                                 kv_heads, packed, padded):
    model = llama(smollm2_tokenizer, kv_heads)
    if packed:
        assert pack_linear_layers(model) > 0
    if padded:
        pad_everything(monkeypatch)
    step = llama_decode.attach(model, smollm2_tokenizer)
    assert step is not None
    assert isinstance(step.lm_head, RowPaddedLinear) is padded
    chunk = 5

    # apart: the running rows' step through the step, the chunks through the forward
    running = decoding_batch(model, smollm2_tokenizer, RUNNING)
    expected_step = step.logits(running)
    newcomer = prefill_chunk(model, newcomer_batch(model, smollm2_tokenizer), chunk)
    expected_keys_after_chunk = real_columns(newcomer)
    expected_first = forward_logits(model, newcomer)
    expected_keys = real_columns(newcomer)

    # mixed: the same two batches, a chunk then the rest, each beside a decode step
    running = decoding_batch(model, smollm2_tokenizer, RUNNING)
    newcomer = newcomer_batch(model, smollm2_tokenizer)
    assert mixed_pass_possible(model, running, newcomer)
    step_logits, none = step.mixed_logits(running, newcomer, chunk)
    assert none is None  # not the last chunk: no logits for the newcomer
    torch.testing.assert_close(step_logits, expected_step, rtol=1e-4, atol=1e-4)
    newcomer = newcomer.after_prompt_columns(chunk)
    for ours, theirs in zip(real_columns(newcomer), expected_keys_after_chunk):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    running = decoding_batch(model, smollm2_tokenizer, RUNNING)  # any batch at a step
    _, first = step.mixed_logits(running, newcomer, newcomer.columns_to_feed)
    torch.testing.assert_close(first, expected_first, rtol=1e-4, atol=1e-4)
    assert newcomer.cache_length == len(expected_keys[0][0, 0])
    for ours, theirs in zip(real_columns(newcomer), expected_keys):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_mixed_passes_choose_the_tokens_separate_passes_choose(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=11)
    assert llama_decode.attach(model, smollm2_tokenizer) is not None

    def run(mixed):
        running = decoding_batch(model, smollm2_tokenizer, RUNNING)
        newcomer = newcomer_batch(model, smollm2_tokenizer)
        first = []
        while not first:
            width = min(4, newcomer.columns_to_feed)
            if mixed:
                _, running, first, newcomer = mixed_pass(model, running, newcomer, width)
            elif width < newcomer.columns_to_feed:
                newcomer = prefill_chunk(model, newcomer, width)
                _, running = generate_token(model, running)
            else:
                first, newcomer = generate_token(model, newcomer)
                _, running = generate_token(model, running)
        batch = CausalLMBatch.concatenate([running, newcomer])
        for _ in range(6):
            _, batch = generate_token(model, batch)
        return [seq.generated_ids for seq in batch.sequences]

    apart = run(False)
    assert run(True) == apart
    longest = max(len(smollm2_tokenizer(p)["input_ids"]) for p in NEWCOMERS)
    passes = -(-longest // 4)  # the running rows took a step in each
    assert [len(ids) for ids in apart] == [3 + passes + 6] * 2 + [1 + 6] * 2


def test_models_without_the_step_never_mix(tiny_model, smollm2_tokenizer):
    running = decoding_batch(tiny_model, smollm2_tokenizer, RUNNING)
    assert llama_decode.step_of(tiny_model) is None
    assert not mixed_pass_possible(tiny_model, running, newcomer_batch(tiny_model,
                                                                       smollm2_tokenizer))


class MixedPasses:
    """Counts the step's mixed passes as ``(decode rows, prompt rows, columns)``; can
    make the first ``failures`` raise."""

    def __init__(self, step, monkeypatch, failures=0, on_pass=None):
        self.passes = []
        self.failures = failures
        original = step.mixed_logits

        def counting(decode, prefill, columns):
            self.passes.append((len(decode), len(prefill), columns))
            if on_pass is not None:
                on_pass(len(self.passes))
            if self.failures:
                self.failures -= 1
                raise RuntimeError("simulated failure of a mixed pass")
            return original(decode, prefill, columns)

        monkeypatch.setattr(step, "mixed_logits", counting)


@pytest.fixture()
def stepped_model(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=5)
    assert llama_decode.attach(model, smollm2_tokenizer) is not None
    return model


def alone(model, tokenizer, prompt, **parameters):
    scheduler = Scheduler(model, pad_token_id=2, device="cpu", max_batch_prefill_tokens=100_000,
                          prefill_stall_steps=0)
    try:
        seqs = sequences(model, tokenizer, [prompt], **parameters)
        collect(scheduler.submit(seqs))
    finally:
        scheduler.shutdown()
    return seqs[0].generated_ids


def long_prompt_beside_a_stream(model, tokenizer, budget=16):
    """test_chunked_prefill's scenario (:data:`LONG` read beside :data:`SHORT` decoding,
    chunks of ``budget`` tokens) on ``model``. Returns both requests' sequences."""
    scheduler = Scheduler(model, pad_token_id=2, device="cpu", max_batch_size=4,
                          max_batch_prefill_tokens=budget, prefill_stall_steps=0)
    try:
        return chunked.long_prompt_beside_a_stream(scheduler, model, tokenizer,
                                                   once_decoding=lambda: None)
    finally:
        scheduler.shutdown()


def test_a_prompt_read_beside_a_stream_shares_its_passes_and_both_generate_what_they_do_alone(
        stepped_model, smollm2_tokenizer, monkeypatch):
    expected_long = alone(stepped_model, smollm2_tokenizer, LONG, max_new_tokens=8)
    mixed = MixedPasses(llama_decode.step_of(stepped_model), monkeypatch)
    forwards = []
    hook = stepped_model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        running_seqs, long_seqs = long_prompt_beside_a_stream(stepped_model, smollm2_tokenizer)
    finally:
        hook.remove()
    assert long_seqs[0].generated_ids == expected_long
    generated = running_seqs[0].generated_ids
    assert alone(stepped_model, smollm2_tokenizer, SHORT, max_new_tokens=len(generated),
                 ignore_eos=True) == generated
    # the long prompt went in mixed passes only, each beside the running row's step and
    # within the budget; the model's forward read the short prompt alone (nothing ran)
    prompt_length = len(long_seqs[0].prompt_ids)
    assert forwards == [torch.Size([1, len(running_seqs[0].prompt_ids)])]
    assert sum(columns for _, _, columns in mixed.passes) == prompt_length
    assert all(rows == 1 and prompt_rows == 1 and columns <= 16
               for rows, prompt_rows, columns in mixed.passes)
    assert len(mixed.passes) >= prompt_length // 16


def test_a_mixed_pass_that_fails_runs_the_prefill_and_the_step_apart(
        stepped_model, smollm2_tokenizer, monkeypatch, caplog):
    expected_long = alone(stepped_model, smollm2_tokenizer, LONG, max_new_tokens=8)
    mixed = MixedPasses(llama_decode.step_of(stepped_model), monkeypatch, failures=2)
    with caplog.at_level(logging.WARNING, logger="djl_stream.generation.scheduler"):
        running_seqs, long_seqs = long_prompt_beside_a_stream(stepped_model, smollm2_tokenizer)
    assert sum("a mixed pass failed" in r.getMessage() for r in caplog.records) == 2
    assert long_seqs[0].generated_ids == expected_long
    generated = running_seqs[0].generated_ids
    assert alone(stepped_model, smollm2_tokenizer, SHORT, max_new_tokens=len(generated),
                 ignore_eos=True) == generated
    # the two failed passes were run apart; the rest of the prompt went mixed
    assert mixed.failures == 0
    assert sum(columns for _, _, columns in mixed.passes[2:]) < len(long_seqs[0].prompt_ids)


def test_a_prompt_cancelled_part_way_leaves_at_the_next_pass_and_the_stream_goes_on(
        stepped_model, smollm2_tokenizer, monkeypatch):
    scheduler = Scheduler(stepped_model, pad_token_id=2, device="cpu", max_batch_size=4,
                          max_batch_prefill_tokens=16, prefill_stall_steps=0)
    try:
        running = scheduler.submit(sequences(stepped_model, smollm2_tokenizer, [SHORT],
                                             max_new_tokens=100_000, ignore_eos=True))
        next(running)
        streams, closed_at = [], []

        def leave(count):  # the client of the long prompt leaves during a mixed pass
            if count >= 2 and streams and not closed_at:
                closed_at.append(count)
                streams[0].close()

        mixed = MixedPasses(llama_decode.step_of(stepped_model), monkeypatch, on_pass=leave)
        streams.append(scheduler.submit(sequences(stepped_model, smollm2_tokenizer, [LONG],
                                                  max_new_tokens=8)))
        for _ in range(200):  # until it has left and its prefill with it
            next(running)
            if closed_at and not scheduler.prefilling_size:
                break
        # the pass under way when it left was its last; the stream goes on alone
        assert closed_at and len(mixed.passes) == closed_at[0], (closed_at, mixed.passes)
        assert sum(columns for _, _, columns in mixed.passes) < len(
            smollm2_tokenizer(LONG)["input_ids"])
        for _ in range(3):
            next(running)
        assert len(mixed.passes) == closed_at[0]
        running.close()
    finally:
        scheduler.shutdown()


def test_a_running_batch_whose_step_is_outdated_takes_its_step_alone(
        stepped_model, smollm2_tokenizer, monkeypatch):
    # The scheduler hands the pacer each step's rows, and where the pacer says the running
    # batch outgrew the last step timed alone (prefill_pacing.STEP_GROWTH), the prompt's
    # chunks are read in passes of their own and the running batch's steps run alone
    # (timed), instead of in mixed passes.
    scheduler = Scheduler(stepped_model, pad_token_id=2, device="cpu", max_batch_size=4,
                          max_batch_prefill_tokens=16, prefill_stall_steps=1.5)
    mixed = MixedPasses(llama_decode.step_of(stepped_model), monkeypatch)
    monkeypatch.setattr(scheduler._pacer, "step_outdated", lambda rows: True)
    try:
        running_seqs, long_seqs = chunked.long_prompt_beside_a_stream(
            scheduler, stepped_model, smollm2_tokenizer, once_decoding=lambda: None)
        steps = list(scheduler._pacer._recent_steps)
    finally:
        scheduler.shutdown()
    assert mixed.passes == []
    assert len(long_seqs[0].generated_ids) == 8
    assert steps and {rows for rows, _ in steps} <= {1, 2}  # one row, then the two
