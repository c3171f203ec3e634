"""The generality checks: what every causal LM must get from djl-stream, on any architecture.

Each check takes a model (random weights are enough) and a tokenizer whose vocabulary fits
it, builds what it needs from djl-stream's public pieces, and returns the token ids to
compare, so that ``tests/test_architectures.py`` can run them over every architecture of
:mod:`architectures`, and anyone can run them over another one::

    from generality import solo_references, concurrent_streams
    references = solo_references(model, tokenizer, PROMPTS)   # before djl-stream touches it
    assert concurrent_streams(model, tokenizer, PROMPTS) == references

References come from ``model.generate()`` (greedy, a fixed number of tokens), computed
before a runner adopts the model.
"""

from __future__ import annotations

import threading
from typing import List, Sequence

import torch

from djl_stream.generation.batch import CausalLMBatch, generate_token, mixed_pass, prefill_chunk
from djl_stream.generation.engines.accelerate import (AccelerateEngine, AccelerateSettings,
                                                      build_sequences, encode_prompts)
from djl_stream.runtime.runner import ModelRunner, RunnerSettings, load_runner

#: Prompts longer than the tiny models' sliding window, of different lengths.
PROMPTS = (
    "The quick brown fox jumps over the lazy dog",
    "Colours of the rainbow: red, orange, yellow",
    "One two three four five six seven eight nine ten",
    "Once upon a time, in a land far away, there lived",
)
NEW_TOKENS = 12
SETTINGS = AccelerateSettings(max_batch_size=8, max_input_length=64, max_new_tokens=64,
                              prefill_stall_steps=0)


def solo_references(model, tokenizer, prompts: Sequence[str] = PROMPTS,
                    new_tokens: int = NEW_TOKENS) -> List[List[int]]:
    """Each prompt's greedy tokens from ``model.generate()``, alone."""
    return id_references(model, [tokenizer(prompt)["input_ids"] for prompt in prompts],
                         new_tokens)


def id_references(model, prompts: Sequence[Sequence[int]],
                  new_tokens: int = NEW_TOKENS) -> List[List[int]]:
    """Each prompt's (token ids) greedy tokens from ``model.generate()``, alone."""
    references = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0)
        references.append(out[0, ids.shape[1]:].tolist())
    return references


def _tokens(stream) -> List[int]:
    tokens = []
    for step in stream:
        generation = step.generations[0]
        if generation is not None and generation.error is None:
            tokens.append(generation.token_id)
    return tokens


def engine_for(model, tokenizer) -> AccelerateEngine:
    return AccelerateEngine(model, tokenizer, SETTINGS)


def concurrent_streams(model, tokenizer, prompts: Sequence[str] = PROMPTS,
                       new_tokens: int = NEW_TOKENS) -> List[List[int]]:
    """Each prompt's greedy tokens, the prompts submitted together from threads of their
    own to one engine (continuous batching)."""
    engine = engine_for(model, tokenizer)
    results: List[List[int]] = [[] for _ in prompts]
    start = threading.Barrier(len(prompts))

    def stream(index: int) -> None:
        start.wait()
        results[index] = _tokens(engine.generate([prompts[index]], max_new_tokens=new_tokens,
                                                 min_new_tokens=new_tokens))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        engine.shutdown()
    return results


#: New tokens the early requests of :func:`late_joiner` may take: many more than the late
#: one, so that they are still decoding when it ends.
EARLY_TOKENS = 100


def late_joiner(model, tokenizer, prompts: Sequence[str] = PROMPTS,
                new_tokens: int = NEW_TOKENS, after: int = 3):
    """The last prompt's greedy tokens when it arrives after the others have each produced
    ``after`` tokens, and whether they were all still decoding when it ended (it joined
    their running batch and left it before them)."""
    engine = engine_for(model, tokenizer)
    try:
        early = [engine.generate([p], max_new_tokens=EARLY_TOKENS, min_new_tokens=EARLY_TOKENS)
                 for p in prompts[:-1]]
        for stream in early:  # (each has its first steps before the late one is sent)
            for _ in range(after):
                next(stream)
        late = _tokens(engine.generate([prompts[-1]], max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens))
        running = all(len(stream.sequences[0].generated_ids) < EARLY_TOKENS for stream in early)
        for stream in early:
            stream.close()
    finally:
        engine.shutdown()
    return late, running


def follow_up_prompts(tokenizer, first_reply: Sequence[int],
                      prompts: Sequence[str] = PROMPTS) -> List[List[int]]:
    """Two prompts (token ids) that begin as ``prompts[0]`` does: a conversation's next
    turn (``prompts[0]``, its reply ``first_reply``, more words), and another question
    after the same words."""
    first = tokenizer(prompts[0])["input_ids"]
    return [first + list(first_reply) + tokenizer(" and then")["input_ids"],
            first + tokenizer(" " + prompts[2])["input_ids"]]


def prompts_that_begin_alike(model, tokenizer, follow_ups: Sequence[Sequence[int]],
                             prompts: Sequence[str] = PROMPTS, new_tokens: int = NEW_TOKENS,
                             after: int = 3):
    """The greedy tokens of ``prompts[0]``, then of the :func:`follow_up_prompts`: the
    conversation's turn once the first stream ended (its cache starts with the first
    one's columns), and while that turn decodes (it has produced ``after`` tokens), the
    other question (its cache copies the turn's columns). Returns the three token lists,
    the prompt positions the runner reused, and whether the turn was still decoding when
    the question ended."""
    engine = engine_for(model, tokenizer)
    try:
        first = _tokens(engine.generate([prompts[0]], max_new_tokens=new_tokens,
                                        min_new_tokens=new_tokens))
        turn_stream = engine.generate([list(follow_ups[0])], max_new_tokens=EARLY_TOKENS,
                                      min_new_tokens=EARLY_TOKENS)
        turn = [next(turn_stream).generations[0].token_id for _ in range(after)]
        question = _tokens(engine.generate([list(follow_ups[1])], max_new_tokens=new_tokens,
                                           min_new_tokens=new_tokens))
        running = len(turn_stream.sequences[0].generated_ids) < EARLY_TOKENS
        while len(turn) < new_tokens:
            turn.append(next(turn_stream).generations[0].token_id)
        turn_stream.close()
        reused = engine.runner.tokens_reused
    finally:
        engine.shutdown()
    return first, turn, question, reused, running


def chunked_beside_a_stream(runner: ModelRunner, tokenizer, prompt: str, running: str,
                            chunk: int = 3, new_tokens: int = NEW_TOKENS) -> List[int]:
    """``prompt``'s greedy tokens when its prompt is read ``chunk`` columns at a time in
    mixed passes beside a decoding ``running`` prompt (then a chunked prefill alone where
    the runner cannot mix)."""
    def batch_of(text: str, request_id: int) -> CausalLMBatch:
        sequences = build_sequences(runner.model, tokenizer, encode_prompts(tokenizer, [text]),
                                    max_new_tokens=new_tokens + 20, min_new_tokens=new_tokens + 20)
        sequences[0].request_id = request_id
        return CausalLMBatch.from_sequences(runner, sequences)

    _, stream = generate_token(runner, batch_of(running, 0))
    prefill = batch_of(prompt, 1)
    sequence = prefill.sequences[0]
    while not prefill.decoding:
        columns = min(chunk, prefill.columns_to_feed)
        if runner.mixes_passes:
            _, stream, _, prefill = mixed_pass(runner, stream, prefill, columns)
        elif columns < prefill.columns_to_feed:
            prefill = prefill_chunk(runner, prefill, columns)
        else:
            _, prefill = generate_token(runner, prefill)
    while len(sequence.generated_ids) < new_tokens:
        _, prefill = generate_token(runner, prefill)
    for batch in (stream, prefill):
        if batch is not None:
            batch.release()
    return sequence.generated_ids[:new_tokens]


def runner_for(model) -> ModelRunner:
    return load_runner(model, RunnerSettings(max_rows=8, max_positions=256))
