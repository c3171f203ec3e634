"""What the compiled decode step's tests share: tiny models and their runners' settings,
and the check that a compiled step takes over from the eager one with the model's logits."""

from __future__ import annotations

import logging

import torch

from architectures import build
from conftest import build_tiny_llama
from djl_stream.runtime import decode_program
from djl_stream.runtime.runner import Feed, RunnerSettings, load_runner, rows_of_a_streaming_program

SETTINGS = RunnerSettings(max_rows=6, max_positions=96)
#: The geometry the tiny model directory's server has (its default row cap, its longest
#: prompt plus its most new tokens): the Llama programs here are the one its server test
#: loads, compiled once for the session.
SERVER_SETTINGS = RunnerSettings(max_rows=32, max_positions=64 + 256)


def tiny(name, seed=0):
    """``name``'s tiny model, and the settings of its runner: for Llama, the tiny model
    directory's model and its server's geometry."""
    if name == "llama":
        return build_tiny_llama(49152, seed=seed), SERVER_SETTINGS
    return build(name, dtype=torch.float32, seed=seed), SETTINGS


def logits_alone(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def decode_and_compare(runner, reference, prompts, steps):
    """Prefill ``prompts`` on ``runner``, decode ``steps`` steps (the later ones with the
    first row alone), and return the largest logit difference from ``reference``'s forward
    over each whole sequence, and the compiled programs in use by then (each by the most rows
    it serves; empty where the eager step still ran them all). Every other step feeds its
    rows in the reverse of their cache rows' order: each feed still gets its own logits."""
    handles = [runner.reserve() for _ in prompts]
    sequences = {h: list(p) for h, p in zip(handles, prompts)}
    runner.run([Feed(h, p) for h, p in sequences.items()])
    worst = 0.0
    for step in range(steps):
        active = handles if step < steps // 2 else handles[:1]
        active = active[::-1] if step % 2 else active
        token = 7 + step
        logits = runner.run([Feed(h, [token]) for h in active])
        for row, handle in enumerate(active):
            sequences[handle].append(token)
            expected = logits_alone(reference, sequences[handle])
            worst = max(worst, float((expected - logits[row]).abs().max()))
    for handle in handles:
        runner.release(handle)
    return worst, runner.programs_in_use


def check_the_compiled_step_takes_over(name, programs, caplog):
    """``name``'s tiny model serves with its eager step while its programs compile, then
    with them (five rows on the program of every row count, then one on the program of few
    rows where the model streams its weights), each step within 1e-4 of the model's own
    forward; the load log follows the compiles."""
    model, settings = tiny(name)
    reference, _ = tiny(name)  # the same weights, never adopted
    runner = load_runner(model, settings)
    estimate = decode_program.last_compile_seconds(programs)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        builder = runner.compile_decode_step(root=programs)
        before, compiled_before = decode_and_compare(runner, reference, [[3, 4, 5]], 2)
        assert builder.result(timeout=600) is not None, builder.error
        worst, compiled = decode_and_compare(
            runner, reference, [[3, 4, 5, 6, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18],
                                [19, 20, 21], [22, 23, 24, 25]], 8)
    few_rows = rows_of_a_streaming_program(model)
    expected = [None, few_rows] if few_rows else [None]
    assert sorted(compiled, key=str) == sorted(expected, key=str), caplog.text
    assert worst < 1e-4 and before < 1e-4
    assert "decode steps now run the compiled program" in caplog.text
    # the load log follows the compiling process's stages, with the last compile's time as
    # the estimate where there was one
    assert "compiling process: exported the decode step" in caplog.text
    assert "compiling process: compiled the decode step" in caplog.text
    first = next(line for line in caplog.text.splitlines()
                 if "compiling the decode step" in line and "in the background" in line)
    assert ("the last compile here took" in first) == (estimate is not None)
    assert decode_program.last_compile_seconds(programs) is not None  # (recorded for the next)
