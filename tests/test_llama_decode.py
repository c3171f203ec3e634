"""djl-stream's Llama decode step (``option.decode_step``): the same logits, tokens and KV
cache as the model's forward through everything continuous batching does to a batch
(padding, rows leaving, rows joining, buffers growing), which models keep their forward,
and that a step that disagrees with the forward is never attached."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import build_tiny_llama
from djl_stream.generation import kv_cache, llama_decode
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


def run_continuous_batch(model, tokenizer, logits_seen):
    """Three prompts decode in one left-padded batch; after 3 steps the middle one leaves,
    after 5 a fourth prompt (longer than the running rows) joins, and all decode to the
    end. Returns every sequence's tokens and the final cache's keys of the last step's
    rows; ``logits_seen`` gets each step's logits."""
    hook = model.register_forward_hook(
        lambda module, args, kwargs, output: logits_seen.append(output.logits[:, -1].clone()),
        with_kwargs=True)
    try:
        running = sequences(tokenizer, PROMPTS[:3], 12)
        batch = CausalLMBatch.from_sequences(running, pad_token_id=2, device="cpu")
        _, batch = generate_token(model, batch)
        for _ in range(3):
            _, batch = generate_token(model, batch)
        batch = batch.filter([running[0].request_id, running[2].request_id])
        for _ in range(2):
            _, batch = generate_token(model, batch)
        late = sequences(tokenizer, PROMPTS[3:], 6, first_id=10)
        newcomer = CausalLMBatch.from_sequences(late, pad_token_id=2, device="cpu")
        _, newcomer = generate_token(model, newcomer)
        batch = CausalLMBatch.concatenate([batch, newcomer])
        keys = None
        while batch is not None:
            keys = [layer.keys.clone() for layer in kv_cache.layers(batch.past_key_values)]
            _, batch = generate_token(model, batch)
    finally:
        hook.remove()
    return [seq.generated_ids for seq in running + late], keys


class StepLogits:
    """Collects the logits the attached step returns (it does not call the model)."""

    def __init__(self, model, monkeypatch):
        step = llama_decode.step_of(model)
        self.seen = []
        original = step.logits

        def recording(batch):
            logits = original(batch)
            self.seen.append(logits.clone())
            return logits

        monkeypatch.setattr(step, "logits", recording)


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
        smollm2_tokenizer, monkeypatch, packed, compiled):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    # the one-row graph takes the plain layers before they are packed, as at load
    one_row = llama_decode.one_row_graph(model) if compiled else None
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


# -- the compiled one-row step (option.decode_step=compiled) ----------------------------

def decode_alone(model, tokenizer, new_tokens, room_on_left=0):
    """One prompt decoded alone (one row) from buffers of the smallest size, so that the
    steps grow them, ``room_on_left`` columns left free before it; its tokens and the
    column capacities its cache went through."""
    (seq,) = sequences(tokenizer, PROMPTS[1:2], new_tokens)
    batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu")
    batch.past_key_values.reserve_columns = 1
    batch.past_key_values.room_on_left = room_on_left
    capacities = set()
    while batch is not None:
        _, batch = generate_token(model, batch)
        if batch is not None:
            capacities.add(batch.past_key_values._slabs[0].column_capacity)
    return seq.generated_ids, capacities


def compiled_one_row_step(model, tokenizer, monkeypatch):
    """``model``'s step with its one-row graph, built from the plain layers before they
    are packed (as at load); and a list that counts the graph's calls."""
    one_row = llama_decode.one_row_graph(model)
    assert pack_linear_layers(model) > 0
    step = llama_decode.attach(model, tokenizer, one_row=one_row)
    assert step is not None and step.compiled
    calls = []
    run = one_row.run

    def counting(*inputs):
        calls.append(inputs[0].shape[0])
        return run(*inputs)

    monkeypatch.setattr(one_row, "run", counting)
    return step, calls


@_NO_PACKING
@pytest.mark.parametrize("room_on_left", [0, 7])
def test_the_compiled_one_row_step_gives_the_forward_s_tokens_and_logits_as_its_buffers_grow(
        smollm2_tokenizer, monkeypatch, caplog, room_on_left):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=8)
    forward_logits = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, output: forward_logits.append(output.logits[:, -1].clone()),
        with_kwargs=True)
    expected, _ = decode_alone(model, smollm2_tokenizer, 80, room_on_left)
    hook.remove()

    caplog.set_level("INFO", logger=llama_decode.__name__)
    step, calls = compiled_one_row_step(model, smollm2_tokenizer, monkeypatch)
    # Inductor froze (and packed) every projection and the LM head: the graph no longer
    # reads the plain weights, which were given back
    frozen = [p for p in step.one_row.projections.parameters()] + [step.one_row.lm_head.weight]
    assert step.one_row.released_bytes >= sum(p.numel() * p.element_size() for p in frozen)
    assert "plain weights given back" in caplog.text
    step_logits = StepLogits(model, monkeypatch)
    fills = step._fills
    filled, starts = [], set()
    monkeypatch.setattr(step, "_fills", lambda keys, start, column: starts.add(start) or (
        fills(keys, start, column) and not filled.append(column)))
    tokens, capacities = decode_alone(model, smollm2_tokenizer, 80, room_on_left)

    assert tokens == expected
    assert len(capacities) > 1  # the buffers grew: other shapes, the same graph
    # every decode step but those that wrote their buffers' last column (one per growth:
    # a view of the whole buffers, run eagerly), and none fell back for good
    assert calls == [1] * (79 - len(filled)) and len(filled) < len(capacities)
    assert step.compiled
    # the first column attended over: 0 (the steps that fill their buffers are among
    # them) or, with room on the left, past that room (no step fills its buffers then)
    assert min(starts) == room_on_left and bool(filled) is (room_on_left == 0)
    assert len(step_logits.seen) == len(forward_logits) - 1  # the prefill ran the forward
    for theirs, ours in zip(forward_logits[1:], step_logits.seen):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@_NO_PACKING
def test_a_compiled_one_row_step_that_fails_gives_way_to_the_eager_step(
        smollm2_tokenizer, monkeypatch, caplog):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=9)
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)
    step, calls = compiled_one_row_step(model, smollm2_tokenizer, monkeypatch)

    def failing(*inputs):
        raise RuntimeError("a guard failed")

    monkeypatch.setattr(step.one_row, "_compiled", failing)
    tokens, _ = decode_alone(model, smollm2_tokenizer, 12)
    assert tokens == expected
    assert calls == [1] and not step.compiled  # tried once, then the eager step
    assert "run the eager step from now on" in caplog.text


@_NO_PACKING
def test_option_decode_step_compiled_builds_the_one_row_graph_before_packing(tiny_model_dir):
    from djl_stream.generation.loading import load_model_and_tokenizer
    from djl_stream.generation.packed_linear import PackedLinear

    props = ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "compiled"})
    model, _ = load_model_and_tokenizer(props)
    step = llama_decode.step_of(model)
    assert step is not None and step.compiled
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert not step.one_row.shares_weights_with(model)


@_NO_PACKING
def test_the_scheduler_s_pacer_counts_eager_steps_only(smollm2_tokenizer, monkeypatch):
    # A compiled one-row step is far faster than the eager pass that reads a prompt beside
    # the stream: counted, it would make every such pass look like a stall.
    import math

    from djl_stream.generation.prefill_pacing import PrefillPacer
    from djl_stream.generation.scheduler import Scheduler

    model = build_tiny_llama(len(smollm2_tokenizer), seed=10)
    step, calls = compiled_one_row_step(model, smollm2_tokenizer, monkeypatch)
    pacer = PrefillPacer(1.5, math.inf)
    scheduler = Scheduler(model, pad_token_id=2, device="cpu", max_batch_size=4, pacer=pacer)
    try:
        alone = scheduler.submit(sequences(smollm2_tokenizer, PROMPTS[:1], 100_000))
        for _ in range(6):
            next(alone)
        assert len(calls) >= 5 and pacer.step_seconds is None  # compiled: not counted
        beside = sequences(smollm2_tokenizer, PROMPTS[1:2], 8, first_id=10)
        for _ in scheduler.submit(beside):
            pass
        assert len(beside[0].generated_ids) == 8
        assert pacer.step_seconds is not None  # two rows: the eager step, counted
        alone.close()
    finally:
        scheduler.shutdown()


@_NO_PACKING
def test_a_graph_that_cannot_be_compiled_leaves_the_eager_step_attached(smollm2_tokenizer,
                                                                        monkeypatch, caplog):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=11)
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)
    one_row = llama_decode.one_row_graph(model)
    assert pack_linear_layers(model) > 0

    def no_compiler(*inputs):  # what Inductor raises on a machine without a C++ compiler
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(llama_decode.OneRowGraph, "compile",
                        lambda graph: object.__setattr__(graph, "_compiled", no_compiler))
    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step is not None and llama_decode.step_of(model) is step and not step.compiled
    assert "compiling the one-row decode step failed (RuntimeError: Failed to find C compiler)" \
        in caplog.text
    assert decode_alone(model, smollm2_tokenizer, 12)[0] == expected
