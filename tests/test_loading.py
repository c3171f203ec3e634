"""Loading weights from the properties: dtype choice, a missing model, an unreachable hub id."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from djl_stream.runtime.loading import ModelLoadError, load_model_and_tokenizer, placement, torch_dtype
from djl_stream.serving.properties import ModelProperties


@pytest.mark.parametrize("dtype, expected", [("fp32", torch.float32), ("fp16", torch.float16),
                                              ("bf16", torch.bfloat16), ("auto", torch.float32)])
def test_dtype_on_cpu(dtype, expected):
    assert torch_dtype(ModelProperties(dtype=dtype), on_gpu=False) is expected


def test_cpu_placement_needs_no_device_map():
    if torch.cuda.is_available():
        pytest.fail("this test documents the CPU path; run it on a CPU machine")
    assert placement(ModelProperties(tensor_parallel_degree=4)) == {}


def test_loads_the_tiny_model_directory_in_the_requested_dtype(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(
        ModelProperties(model_dir=str(tiny_model_dir), dtype="bf16"))
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert tokenizer.eos_token == "<|im_end|>"


def test_a_directory_without_weights_says_what_to_do(tmp_path):
    with pytest.raises(ModelLoadError, match="option.model_id"):
        load_model_and_tokenizer(ModelProperties(model_dir=str(tmp_path)))


def test_an_unreachable_hub_id_fails_with_a_clear_message(tmp_path):
    # No hub is reachable from here; HF_HUB_OFFLINE=1 makes that certain and fast (it is
    # read when huggingface_hub is imported, hence a fresh interpreter).
    code = (
        "from djl_stream.runtime.loading import load_model_and_tokenizer\n"
        "from djl_stream.serving.properties import ModelProperties\n"
        f"load_model_and_tokenizer(ModelProperties(model_dir={str(tmp_path)!r}, "
        "model_id='no-such-org/no-such-model'))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("djl_stream.runtime.loading.ModelLoadError")
    assert "no-such-org/no-such-model" in last_line
    assert "hub" in last_line


def test_the_model_loads_in_a_thread_that_ends_with_the_load(tiny_model_dir, monkeypatch):
    # The OpenMP thread pool loading gives its thread must not outlive the load: beside
    # the scheduler's, it throttles the forward passes' OpenMP workers
    # (loading.in_passing_thread says how much).
    import threading

    from djl_stream.runtime import loading

    seen = []
    load = loading._load_model_and_tokenizer

    def recording(*args, **kwargs):
        seen.append(threading.current_thread())
        return load(*args, **kwargs)

    monkeypatch.setattr(loading, "_load_model_and_tokenizer", recording)
    model, _ = loading.load_model_and_tokenizer(
        ModelProperties.from_init_properties({"model_dir": str(tiny_model_dir)}))
    (thread,) = seen
    assert thread is not threading.current_thread() and not thread.is_alive()
    assert model is not None
