"""The compiled decode step: built in a process of its own while the eager forward serves,
checked against an eager step before it runs one, exact where it runs, cached by what
decides its code."""

from __future__ import annotations

import logging

import pytest
import torch

from architectures import build
from djl_stream.runtime import decode_program
from djl_stream.runtime.decode_program import CacheGeometry, ProgramBuilder, program_key
from djl_stream.runtime.file_lock import exclusive_lock
from djl_stream.runtime.int8 import quantize_weights_only
from djl_stream.runtime.runner import Feed, RunnerSettings, load_runner

from conftest import build_tiny_llama

SETTINGS = RunnerSettings(max_rows=6, max_positions=96)
#: The geometry the tiny model directory's server has (its default row cap, its longest
#: prompt plus its most new tokens): the Llama programs here are the one its server test
#: loads, compiled once for the session.
SERVER_SETTINGS = RunnerSettings(max_rows=32, max_positions=64 + 256)


@pytest.fixture(scope="module")
def programs():
    """The session's cache (conftest points DJL_STREAM_CACHE_DIR at it)."""
    return decode_program.cache_root()


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
    over each whole sequence, and whether the compiled program ran the last step."""
    handles = [runner.reserve() for _ in prompts]
    sequences = {h: list(p) for h, p in zip(handles, prompts)}
    runner.run([Feed(h, p) for h, p in sequences.items()])
    worst = 0.0
    for step in range(steps):
        active = handles if step < steps // 2 else handles[:1]
        token = 7 + step
        logits = runner.run([Feed(h, [token]) for h in active])
        for row, handle in enumerate(active):
            sequences[handle].append(token)
            expected = logits_alone(reference, sequences[handle])
            worst = max(worst, float((expected - logits[row]).abs().max()))
    for handle in handles:
        runner.release(handle)
    return worst, runner.program is not None


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2", "mixtral"])
def test_the_compiled_step_takes_over_and_computes_the_model_s_logits(name, programs, caplog):
    model, settings = tiny(name)
    reference, _ = tiny(name)  # the same weights, never adopted
    runner = load_runner(model, settings)
    estimate = decode_program.last_compile_seconds(programs)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        builder = runner.compile_decode_step(root=programs)
        before, compiled_before = decode_and_compare(runner, reference, [[3, 4, 5]], 2)
        assert builder.result(timeout=600) is not None, builder.error
        worst, compiled = decode_and_compare(
            runner, reference, [[3, 4, 5, 6, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18]], 8)
    assert compiled, caplog.text
    assert worst < 1e-4 and before < 1e-4
    assert "decode steps now run the compiled program" in caplog.text
    # the load log follows the compiling process's stages, with the last compile's time as
    # the estimate where there was one
    assert "compiling process: exported the decode step" in caplog.text
    assert "compiling process: compiled the decode step" in caplog.text
    assert ("the last compile here took" in caplog.text) == (estimate is not None)
    assert decode_program.last_compile_seconds(programs) > 0


def test_an_int8_weight_only_model_s_compiled_step_computes_its_logits(programs, caplog):
    # one row reads the int8 weights in a fused reduction, several rows through floats:
    # decode_and_compare decodes three rows, then one
    def one_layer_qwen2():  # one layer: both products of each weight are compiled
        from transformers import AutoModelForCausalLM, Qwen2Config

        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        assert quantize_weights_only(model) > 0
        return model

    model, reference = one_layer_qwen2(), one_layer_qwen2()
    runner = load_runner(model, SETTINGS)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        assert runner.compile_decode_step(root=programs).result(timeout=900) is not None
        worst, compiled = decode_and_compare(
            runner, reference, [[3, 4, 5, 6, 8], [9, 10], [11, 12, 13, 14, 15]], 8)
    assert compiled, caplog.text
    assert worst < 1e-4


def test_a_second_start_loads_the_cached_program_without_compiling(programs, caplog):
    model, settings = tiny("llama", seed=5)  # other weights, the same shapes
    runner = load_runner(model, settings)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        builder = runner.compile_decode_step(root=programs)
        assert builder.result(timeout=600) is not None, builder.error
        worst, compiled = decode_and_compare(runner, tiny("llama", seed=5)[0],
                                             [[3, 4, 5, 6], [7, 8]], 4)
    assert compiled and worst < 1e-4
    assert "compiling the decode step" not in caplog.text


def test_a_program_that_disagrees_with_the_eager_step_is_never_used(programs, monkeypatch,
                                                                    caplog):
    real_call = decode_program.DecodeProgram.__call__
    monkeypatch.setattr(decode_program.DecodeProgram, "__call__",
                        lambda self, *args: real_call(self, *args) + 1.0)
    model, settings = tiny("llama")
    runner = load_runner(model, settings)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        runner.compile_decode_step(root=programs).result(timeout=600)
        worst, compiled = decode_and_compare(runner, tiny("llama")[0], [[3, 4, 5], [6, 7]], 4)
    assert not compiled and worst < 1e-6
    assert "differ from the eager step's" in caplog.text


def test_a_start_that_finds_another_process_compiling_says_it_waits(tmp_path, caplog):
    model = build("gpt_neox", dtype=torch.float32)
    runner = load_runner(model, SETTINGS)
    builder = ProgramBuilder(model, runner.geometry(), root=tmp_path)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        with exclusive_lock(builder.folder.with_suffix(".lock")):
            builder.start()
            assert builder.result(timeout=2) is None  # (still waiting for the lock)
            assert "another process is compiling" in caplog.text
        builder.stop()  # (the lock was given up without a program: it would compile now)
        builder.result(timeout=600)


def test_the_cache_key_comes_from_shapes_and_versions_never_from_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    first, second = build("qwen2", dtype=torch.float32), build("qwen2", dtype=torch.float32, seed=9)
    geometry = load_runner(first, SETTINGS).geometry()
    assert program_key(first, geometry) == program_key(second, geometry)
    second.save_pretrained(tmp_path)  # (loaded from a folder, its config says more)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert program_key(loaded, geometry) == program_key(first, geometry)
    wider = CacheGeometry(geometry.rows, geometry.columns * 2, geometry.layers,
                          geometry.layer_windows, geometry.dtype)
    assert program_key(first, wider) != program_key(first, geometry)
    assert program_key(build("qwen2", dtype=torch.float64), geometry) != program_key(first,
                                                                                      geometry)


def test_a_server_answers_at_once_and_switches_to_the_program_when_it_is_ready(
        tmp_path, tiny_model_dir):
    import shutil
    import time

    from server_process import ServerProcess

    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    properties = directory / "serving.properties"
    properties.write_text(properties.read_text().replace("option.compile=false",
                                                         "option.compile=true"))
    body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 12,
                                                              "min_new_tokens": 12}}
    server = ServerProcess(directory)
    try:
        server.wait_ready()
        eager = server.http.post("/invocations", json=body)
        assert eager.status_code == 200
        deadline = time.monotonic() + 600
        while "decode steps now run the compiled program" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            assert "no compiled decode step" not in server.logs(), server.logs()
            server.http.post("/invocations", json=body)  # (a decode step checks the program)
            time.sleep(0.5)
        compiled = server.http.post("/invocations", json=body)
        assert compiled.text == eager.text
        assert "getting the compiled decode step" in server.logs()
    finally:
        server.stop()
