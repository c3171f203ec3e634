"""The compiled decode step: built in a process of its own while the eager forward serves,
checked against an eager step before it runs one, exact where it runs, cached by what
decides its code."""

from __future__ import annotations

import logging

import pytest

import torch

from architectures import build
from compiled_steps import SETTINGS, check_the_compiled_step_takes_over, decode_and_compare, tiny
from djl_stream.runtime import decode_program
from djl_stream.runtime.decode_program import CacheGeometry, ProgramBuilder, program_key
from djl_stream.runtime.file_lock import exclusive_lock
from djl_stream.runtime.runner import load_runner

pytestmark = pytest.mark.compiles


def test_the_compiled_step_takes_over_and_computes_the_model_s_logits(programs, caplog):
    check_the_compiled_step_takes_over("llama", programs, caplog)


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

    def wrong(self, input_ids, position_ids, rows, masks, keys, values):
        logits = real_call(self, input_ids, position_ids, rows, masks, keys, values)
        for layer in values:  # (and wrong values where the step's go: later steps read them)
            layer[rows, :, position_ids[0]] += 1.0
        return logits + 1.0

    monkeypatch.setattr(decode_program.DecodeProgram, "__call__", wrong)
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
    load_runner(second, SETTINGS)  # (a key is read off the model a runner serves)
    assert program_key(first, geometry) == program_key(second, geometry)
    second.save_pretrained(tmp_path)  # (loaded from a folder, its config says more)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    load_runner(loaded, SETTINGS)
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


def test_a_compiling_process_whose_parent_died_before_it_looked_exits(tmp_path):
    # A server killed while its compiler is still importing torch has handed the compiler to
    # another process before the compiler asks who its parent is: the id the server gave
    # it, not the one it finds, says whom to outlive. (sh stands for the server here: it
    # names itself, starts the compiler's watch and exits at once.)
    import os
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "pid"
    script = (f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
              "from djl_stream.runtime.decode_program import _end_with_the_parent; "
              "_end_with_the_parent(); import time; time.sleep(600)")
    subprocess.run(["sh", "-c", f'{decode_program.PARENT_VARIABLE}=$$ "$1" -c "$2" & exit 0',
                    "sh", sys.executable, script], check=True)

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the compiler never started"
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    try:
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(pid), "the compiler outlived the process that started it"
    finally:
        if running(pid):
            os.kill(pid, 9)
