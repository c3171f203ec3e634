"""The compiled decode step of architectures other than Llama, and of int8 weights: each
compiles a program of its own (tens of seconds), so they are a file of their own, which
``make test`` can run beside the others."""

from __future__ import annotations

import logging

import pytest
import torch

from compiled_steps import SETTINGS, check_the_compiled_step_takes_over, decode_and_compare
from djl_stream.runtime import packed_linear
from djl_stream.runtime.int8 import quantize_weights_only
from djl_stream.runtime.linear_layers import streamed_rows
from djl_stream.runtime.runner import load_runner

pytestmark = pytest.mark.compiles


@pytest.mark.parametrize("name", ["gemma2", "gpt2", "gpt_oss"])
def test_the_compiled_step_takes_over_and_computes_the_model_s_logits(name, programs, caplog,
                                                                      monkeypatch):
    # The program of every row count only: the one of few rows differs from it in its
    # linear layers alone, which know nothing of the architecture (test_decode_program
    # compiles both for Llama, and int8 below both its own). Each compile costs tens of
    # seconds of make test, so each architecture here brings what no other does to a
    # program: soft-capping and alternating windows, a fused projection of its own (no
    # nn.Linear) and learned positions, sinks and experts. StableLM's layers, which drop
    # the forward's keyword arguments, need no program of their own: every export reads
    # the layout as they do, from the pass's thread.
    monkeypatch.setattr(packed_linear, "available_memory", lambda: 0)
    check_the_compiled_step_takes_over(name, programs, caplog)


def test_an_int8_weight_only_model_s_compiled_step_computes_its_logits(programs, caplog):
    # one row streams the int8 weights, several rows multiply them in blocks (two programs
    # of their own): decode_and_compare decodes three rows, then one
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
    assert sorted(compiled, key=str) == sorted([None, streamed_rows(torch.int8)], key=str), \
        caplog.text
    assert worst < 1e-4
