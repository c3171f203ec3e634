"""djl-stream's Llama decode step (``option.decode_step``): the same logits, tokens and KV
cache as the model's forward through everything continuous batching does to a batch
(padding, rows leaving, rows joining, buffers growing), which models keep their forward,
and that a step that disagrees with the forward is never attached."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import COMPILED_SEED, StepLogits, build_tiny_llama, resident_bytes
from djl_stream.generation import compiled_decode, kv_cache, llama_decode
from djl_stream.generation.batch import CausalLMBatch, forward_logits, generate_token
from djl_stream.generation.packed_linear import pack_linear_layers, packing_unavailable
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.serving.properties import ModelProperties, PropertyError

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived",
           "1, 2, 3,", "A very long list of things to remember: milk, eggs, bread, butter,"]


def sequences(tokenizer, prompts, new_tokens, first_id=0):
    return [GenerationSequence(first_id + i, tokenizer(p)["input_ids"], tokenizer,
                               max_new_tokens=new_tokens, eos_token_ids=set(), ignore_eos=True)
            for i, p in enumerate(prompts)]


def run_continuous_batch(model, tokenizer, logits_seen=None, *, device="cpu", room_for_rows=0,
                         new_tokens=(12, 6)):
    """Three prompts decode in one left-padded batch (``new_tokens[0]`` each); after 3 steps
    the middle one leaves, after 5 a fourth prompt (longer than the running rows,
    ``new_tokens[1]``) joins, and all decode to the end. Returns every sequence's tokens
    and the final cache's keys of the last step's rows; ``logits_seen`` gets each
    forward's logits."""
    hook = None if logits_seen is None else model.register_forward_hook(
        lambda module, args, kwargs, output: logits_seen.append(output.logits[:, -1].clone()),
        with_kwargs=True)
    try:
        running = sequences(tokenizer, PROMPTS[:3], new_tokens[0])
        batch = CausalLMBatch.from_sequences(running, pad_token_id=2, device=device,
                                             room_for_rows=room_for_rows)
        _, batch = generate_token(model, batch)
        for _ in range(3):
            _, batch = generate_token(model, batch)
        batch = batch.filter([running[0].request_id, running[2].request_id])
        for _ in range(2):
            _, batch = generate_token(model, batch)
        late = sequences(tokenizer, PROMPTS[3:], new_tokens[1], first_id=10)
        newcomer = CausalLMBatch.from_sequences(late, pad_token_id=2, device=device)
        _, newcomer = generate_token(model, newcomer)
        batch = CausalLMBatch.concatenate([batch, newcomer])
        keys = None
        while batch is not None:
            keys = [layer.keys.clone() for layer in kv_cache.layers(batch.past_key_values)]
            _, batch = generate_token(model, batch)
    finally:
        if hook is not None:
            hook.remove()
    return [seq.generated_ids for seq in running + late], keys


# The packed cases need a PyTorch with oneDNN (every CPU build this project installs has
# it); without one there is nothing packed to run them on, as in test_packed_linear.
_NO_PACKING = pytest.mark.skipif(packing_unavailable() is not None,
                                 reason=f"this PyTorch cannot prepack: {packing_unavailable()}")


@pytest.mark.parametrize("packed, compiled", [
    pytest.param(False, False, id="eager"),
    pytest.param(True, False, id="eager-packed", marks=_NO_PACKING),
    pytest.param(True, True, id="compiled-packed", marks=_NO_PACKING),
])
def test_the_step_gives_the_forward_s_tokens_logits_and_cache_through_leaves_and_joins(
        smollm2_tokenizer, monkeypatch, one_row_cache, packed, compiled):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    # the one-row program is compiled from the plain layers before they are packed, as at
    # load (tests/test_compiled_decode.py has its own tests)
    one_row = compiled_decode.compile_one_row(model) if compiled else None
    if packed:
        assert pack_linear_layers(model) > 0
    forward_logits = []
    expected_tokens, expected_keys = run_continuous_batch(model, smollm2_tokenizer, forward_logits)

    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step is not None and step.compiled is compiled
    step_logits = StepLogits(model, monkeypatch)
    prefill_logits = []
    tokens, keys = run_continuous_batch(model, smollm2_tokenizer, prefill_logits)

    assert tokens == expected_tokens
    assert [len(t) for t in tokens] == [12, 4, 12, 6]  # the middle one left after 4
    # the forward now ran the prefills only: 2 (the first batch and the newcomer)
    assert len(prefill_logits) == 2 and len(step_logits.seen) == len(forward_logits) - 2
    # every decode step's logits, in order, against the forward's (prefills taken out)
    prefill_rows = {0, 6}  # the first pass, and the newcomer's after 3 + 2 steps
    decode_forward = [logits for i, logits in enumerate(forward_logits) if i not in prefill_rows]
    assert len(decode_forward) == len(step_logits.seen)
    for theirs, ours in zip(decode_forward, step_logits.seen):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    for theirs, ours in zip(expected_keys, keys):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_reserved_rows_stay_zero_and_the_buffers_grow_when_the_step_writes(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=4)
    assert llama_decode.attach(model, smollm2_tokenizer) is not None
    (seq,) = sequences(smollm2_tokenizer, PROMPTS[:1], 80)
    batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu", room_for_rows=2)
    batch.past_key_values.reserve_columns = 1  # the smallest buffers: the steps must grow them
    _, batch = generate_token(model, batch)
    slab = batch.past_key_values._slabs[0]
    first_capacity = slab.column_capacity
    for _ in range(70):
        _, batch = generate_token(model, batch)
    slab = batch.past_key_values._slabs[0]
    assert slab.column_capacity > first_capacity  # grown by the step
    assert slab.row_capacity >= 3
    in_use = slice(slab.start, slab.end)
    assert slab.end - slab.start == len(seq.prompt_ids) + 70  # one column a step
    assert torch.count_nonzero(slab.keys_buffer[1:, :, in_use]) == 0
    assert torch.count_nonzero(slab.values_buffer[1:, :, in_use]) == 0


def test_models_it_does_not_know_keep_their_forward(smollm2_tokenizer):
    biased = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          attention_bias=True))
    assert "biases" in llama_decode.unsupported_reason(biased)
    assert llama_decode.attach(biased, smollm2_tokenizer) is None
    assert llama_decode.step_of(biased) is None
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))
    assert "not a Llama" in llama_decode.unsupported_reason(gpt2)
    assert llama_decode.attach(gpt2, smollm2_tokenizer) is None


def test_a_step_that_disagrees_with_the_forward_is_not_attached(smollm2_tokenizer, monkeypatch,
                                                                caplog):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=5)
    # a step that forgot its RMSNorms
    monkeypatch.setattr(llama_decode, "_norm", lambda x, weight, eps: x)
    assert llama_decode.attach(model, smollm2_tokenizer) is None
    assert llama_decode.step_of(model) is None
    assert "differs from the model's forward" in caplog.text


def test_a_step_whose_mixed_pass_disagrees_with_the_forward_is_not_attached(
        smollm2_tokenizer, monkeypatch, caplog):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=5)
    # a mixed pass whose prompt columns see the columns after them (no causal mask)
    monkeypatch.setattr(llama_decode.LlamaDecodeStep, "_prompt_mask",
                        lambda self, mask, cached, columns, dtype: torch.zeros(
                            (mask.shape[0], 1, columns, cached + columns), dtype=dtype))
    assert llama_decode.attach(model, smollm2_tokenizer) is None
    assert llama_decode.step_of(model) is None
    assert "mixed pass differs from the model's forward" in caplog.text


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=_NO_PACKING)])
def test_a_bfloat16_model_gets_the_step_with_the_forward_s_logits(smollm2_tokenizer, packed):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=6).to(torch.bfloat16)
    if packed:
        pack_linear_layers(model)  # packed where this CPU multiplies bfloat16 natively
    step = llama_decode.attach(model, smollm2_tokenizer)
    assert step is not None
    batch = CausalLMBatch.from_sequences(sequences(smollm2_tokenizer, PROMPTS[:3], 4),
                                         pad_token_id=2, device="cpu")
    _, batch = generate_token(model, batch)
    reference = CausalLMBatch.from_sequences(sequences(smollm2_tokenizer, PROMPTS[:3], 4),
                                             pad_token_id=2, device="cpu")
    llama_decode.detach(model)
    _, reference = generate_token(model, reference)
    theirs = forward_logits(model, reference)
    ours = step.logits(batch)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    scale = float(theirs.float().abs().max())
    assert float((ours.float() - theirs.float()).abs().max()) <= (
        llama_decode.TOLERANCE[torch.bfloat16] * scale)


def test_option_decode_step(tmp_path):
    assert ModelProperties.from_init_properties({}).decode_step == "auto"
    for value in ("forward", "eager", "compiled", "AUTO"):
        props = ModelProperties.from_init_properties({"decode_step": value})
        assert props.decode_step == value.lower()
    with pytest.raises(PropertyError) as error:
        ModelProperties.from_init_properties({"decode_step": "fast"})
    assert "option.decode_step" in str(error.value) and "forward" in str(error.value)


def test_option_decode_step_forward_keeps_the_model_s_forward(tmp_path, tiny_model_dir):
    from djl_stream.generation.loading import load_model_and_tokenizer

    for value, attached in (("forward", False), ("auto", True)):
        props = ModelProperties.from_init_properties(
            {"model_dir": str(tiny_model_dir), "decode_step": value})
        model, _ = load_model_and_tokenizer(props)
        assert (llama_decode.step_of(model) is not None) is attached


def test_a_model_without_grouped_heads_gets_the_step_too(smollm2_tokenizer):
    torch.manual_seed(6)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4)).eval()
    # attach() checks the step's logits against the forward's on 1 and 3 rows
    assert llama_decode.attach(model, smollm2_tokenizer) is not None
    forward = LlamaForCausalLM(model.config).eval()
    forward.load_state_dict(model.state_dict())
    ours, _ = run_continuous_batch(model, smollm2_tokenizer, [])
    theirs, _ = run_continuous_batch(forward, smollm2_tokenizer, [])
    assert ours == theirs


def test_the_step_grows_a_cache_whose_leading_columns_were_trimmed(smollm2_tokenizer):
    """A longer row leaves, so the columns only it used leave the cache (its first column
    in use is no longer 0), and then the buffers fill up and grow under the step: every
    layer must move alike (a CI run caught layers left at different columns)."""
    def run(model):
        long_prompt, short_prompt = PROMPTS[3], PROMPTS[2]
        rows = sequences(smollm2_tokenizer, [long_prompt, short_prompt], 90)
        batch = CausalLMBatch.from_sequences(rows, pad_token_id=2, device="cpu")
        batch.past_key_values.reserve_columns = 1  # the smallest buffers: the steps grow them
        _, batch = generate_token(model, batch)
        batch = batch.filter([rows[1].request_id])
        slab = batch.past_key_values._slabs[0]
        assert slab.start > 0 and slab.end < slab.column_capacity  # trimmed, not yet full
        first_capacity = slab.column_capacity
        while batch is not None:
            _, batch = generate_token(model, batch)
        return rows[1].generated_ids, first_capacity

    model = build_tiny_llama(len(smollm2_tokenizer), seed=7)
    expected, _ = run(model)
    assert llama_decode.attach(model, smollm2_tokenizer) is not None
    tokens, first_capacity = run(model)
    assert len(tokens) == 90 and first_capacity < len(tokens)  # it had to grow
    assert tokens == expected


def _resident_growth_of_padded_steps(step, steps: int, to_last_column: bool) -> tuple:
    """Resident memory gained over ``steps`` decode steps of one real row padded to 16
    (fresh, lazily mapped buffers of 8 heads × 512 columns), and the buffers."""
    rows, heads, capacity, dim = 16, 8, 512, 64  # a page holds 16 columns of a row's head
    like = torch.zeros(1)
    keys = [kv_cache.zeroed_buffer((rows, heads, capacity, dim), like)]
    values = [kv_cache.zeroed_buffer((rows, heads, capacity, dim), like)]
    real = (torch.arange(rows) < 1).view(rows, 1, 1, 1)  # one real row, 15 padding rows
    angles = torch.randn(rows, 1, 1, dim)
    before = resident_bytes()
    with torch.inference_mode():
        for column in range(steps):
            llama_decode._decode_logits(
                step.geometry, step.layers, step.final_norm, step.lm_head,
                torch.randn(rows, heads * dim), angles.cos(), angles.sin(),
                torch.zeros(rows, 1, 1, column + 1), keys, values, torch.tensor([column]), 0,
                real=real, padding_to_last_column=to_last_column)
    return resident_bytes() - before, keys[0], values[0]


def test_padding_rows_of_a_cpu_batch_program_write_back_at_their_last_column():
    # A padding row writes back what its slot holds; at the step's column that made its
    # lazily mapped pages resident step after step, as a real row's (the 16-row program's
    # padding: 9 rows of SmolLM2 over 300 steps, +224 MB against +126 eager). At the last
    # column it costs a page per head, layer, keys and values, once. (The CUDA graphs
    # still write back at the step's column: GPU memory is allocated whole.)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=8,
                                         num_key_value_heads=8)).eval()
    step = llama_decode.LlamaDecodeStep(model)
    _resident_growth_of_padded_steps(step, 64, True)  # allocations that stay, first
    at_last, keys, values = _resident_growth_of_padded_steps(step, 320, True)
    at_step, _, _ = _resident_growth_of_padded_steps(step, 320, False)
    padding_pages = 15 * 8 * 2 * 20 * 4096  # 15 rows, 8 heads, keys and values, 20 pages
    assert at_last < padding_pages // 2, (at_last, at_step)
    assert at_step - at_last > padding_pages // 2, (at_last, at_step)
    assert not keys[1:, :, :511].any() and not values[1:].any()  # the slots still read zeros
    assert keys[0, :, :320].abs().sum() > 0  # the real row wrote its columns
