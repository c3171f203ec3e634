"""The generality suite: every architecture of :mod:`architectures` takes djl-stream's fast
path, and streams exactly what ``generate()`` gives, alone, among concurrent streams, read
in chunks beside a running stream, and joining a running batch (with sliding windows
shorter than the prompts); prompts that begin as earlier ones did start from their keys
and values and stream what ``generate()`` gives; its int8 weights load and stream. The checks are
:mod:`generality`'s, which run on any causal LM."""

from __future__ import annotations

import pytest
import torch

from architectures import ARCHITECTURES, build
from djl_stream.runtime.quantization import quantize_after_load
from generality import (PROMPTS, chunked_beside_a_stream, concurrent_streams, engine_for,
                        follow_up_prompts, id_references, late_joiner,
                        prompts_that_begin_alike, runner_for, solo_references)

pytestmark = pytest.mark.fast_path

#: Mixture-of-experts layers in transformers multiply with grouped products that take
#: float32 at most.
FLOAT32_ONLY = {"mixtral", "qwen2_moe"}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def architecture(request, smollm2_tokenizer):
    """(name, model, its solo greedy references, and the follow-up prompts of the first
    prompt with theirs), the references taken before djl-stream touched the model."""
    name = request.param
    dtype = torch.float32 if name in FLOAT32_ONLY else torch.float64
    model = build(name, vocab_size=len(smollm2_tokenizer), dtype=dtype)
    references = solo_references(model, smollm2_tokenizer)
    follow_ups = follow_up_prompts(smollm2_tokenizer, references[0])
    return name, model, references, (follow_ups, id_references(model, follow_ups))


def test_the_model_takes_the_fast_path(architecture):
    name, model, _, _ = architecture
    runner = runner_for(model)
    assert runner.path == "attention", getattr(runner, "reason", "")
    assert runner.mixes_passes


def test_a_stream_alone_is_what_generate_gives(architecture, smollm2_tokenizer):
    _, model, references, _ = architecture
    engine = engine_for(model, smollm2_tokenizer)
    try:
        for prompt, reference in zip(PROMPTS, references):
            tokens = [step.generations[0].token_id for step in
                      engine.generate([prompt], max_new_tokens=len(reference),
                                      min_new_tokens=len(reference))]
            assert tokens == reference
    finally:
        engine.shutdown()


def test_four_concurrent_streams_each_get_their_solo_text(architecture, smollm2_tokenizer):
    _, model, references, _ = architecture
    assert concurrent_streams(model, smollm2_tokenizer) == references


def test_a_prompt_read_in_chunks_beside_a_stream_is_read_as_in_one_pass(architecture,
                                                                       smollm2_tokenizer):
    _, model, references, _ = architecture
    runner = runner_for(model)
    tokens = chunked_beside_a_stream(runner, smollm2_tokenizer, PROMPTS[2], running=PROMPTS[0])
    assert tokens == references[2]
    assert runner.tokens_held == 0  # (every row released)


def test_a_request_joining_a_running_batch_gets_its_solo_text(architecture, smollm2_tokenizer):
    _, model, references, _ = architecture
    tokens, joined_while_running = late_joiner(model, smollm2_tokenizer)
    assert joined_while_running
    assert tokens == references[-1]


def test_prompts_that_begin_as_earlier_ones_did_start_from_their_keys_and_values(
        architecture, smollm2_tokenizer):
    _, model, references, (follow_ups, follow_up_references) = architecture
    first, turn, question, reused, running = prompts_that_begin_alike(model, smollm2_tokenizer,
                                                                      follow_ups)
    assert running
    assert [first, turn, question] == [references[0], *follow_up_references]
    first_prompt = len(smollm2_tokenizer(PROMPTS[0])["input_ids"])
    # the turn took the first stream's row (all it fed: its prompt, its reply but the
    # last token), and the question copied the words it shares with the turn
    assert reused == (first_prompt + len(references[0]) - 1) + first_prompt


def test_int8_weights_load_and_stream(architecture, smollm2_tokenizer):
    name, _, _, _ = architecture
    model = build(name, vocab_size=len(smollm2_tokenizer), dtype=torch.float32)
    assert quantize_after_load(model, "int8", on_gpu=False) > 0
    engine = engine_for(model, smollm2_tokenizer)
    try:
        assert engine.runner.path == "attention"
        steps = list(engine.generate([PROMPTS[0]], max_new_tokens=6, min_new_tokens=6))
    finally:
        engine.shutdown()
    assert len(steps) == 6 and all(s.generations[0].error is None for s in steps)
