"""Linear layers whose weights the model's own code reads keep their ``nn.Linear``: int8
weights and oneDNN's reordered ones serve the layer's product and nothing else.

A tiny Mamba stands for every model that reads them: its mixer multiplies by
``dt_proj.weight`` itself, and it casts its last hidden states to ``lm_head.weight.dtype``
(int8 there would turn them into small whole numbers, an error nowhere). The
architectures of the generality suite read no linear weight beyond its layer's product,
and lose no replacement to the rule."""

from __future__ import annotations

import logging

import pytest
import torch

from architectures import ARCHITECTURES, build
from djl_stream.runtime import linear_layers, packed_linear
from djl_stream.runtime.decode_program import ProgramBuilder, structural_twin
from djl_stream.runtime.int8 import Int8WeightOnlyLinear
from djl_stream.runtime.linear_layers import linear_layers_read_elsewhere
from djl_stream.runtime.packed_linear import PackedLinear
from djl_stream.runtime.quantization import quantize_after_load
from djl_stream.runtime.runner import load_runner
from generality import PROMPTS, engine_for

READ_BY_THE_MODEL = ["backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj",
                     "lm_head"]


def tiny_mamba(vocab_size: int = 256):
    from transformers import AutoModelForCausalLM, MambaConfig

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                         bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def logits(model, vocab_size: int) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 11).view(1, -1) % vocab_size).logits


def streams(model, tokenizer, new_tokens: int = 5):
    engine = engine_for(model, tokenizer)
    try:
        steps = list(engine.generate([PROMPTS[0]], max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens))
    finally:
        engine.shutdown()
    return [step.generations[0].error for step in steps]


def test_a_weight_the_model_multiplies_by_itself_is_found():
    assert linear_layers_read_elsewhere(tiny_mamba()) == READ_BY_THE_MODEL


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_no_layer_of_the_suite_s_architectures_is_read_beyond_its_product(architecture):
    assert linear_layers_read_elsewhere(build(architecture, dtype=torch.float32)) == []


def test_int8_leaves_the_weights_the_model_reads_in_float_and_streams(smollm2_tokenizer,
                                                                       caplog):
    model = tiny_mamba(len(smollm2_tokenizer))
    expected = logits(model, len(smollm2_tokenizer))
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        quantized = quantize_after_load(model, "int8", on_gpu=False)
    assert "3 linear layers keep their float weights instead of int8" in caplog.text
    layers = dict(model.named_modules())
    assert all(type(layers[name]) is torch.nn.Linear for name in READ_BY_THE_MODEL)
    assert quantized == sum(isinstance(m, Int8WeightOnlyLinear) for m in model.modules()) > 0
    got = logits(model, len(smollm2_tokenizer))
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    assert streams(model, smollm2_tokenizer) == [None] * 5


def test_weights_reordered_for_onednn_leave_the_weights_the_model_reads(smollm2_tokenizer,
                                                                        monkeypatch):
    if packed_linear.packing_unavailable() is not None:
        pytest.skip(packed_linear.packing_unavailable())
    # (the float weights let go, as where both copies would not fit: a packed layer whose
    # weight the mixer read would hand it None)
    monkeypatch.setattr(packed_linear, "available_memory", lambda: 0)
    model = tiny_mamba(len(smollm2_tokenizer))
    expected = logits(model, len(smollm2_tokenizer))
    load_runner(model)
    layers = dict(model.named_modules())
    assert all(type(layers[name]) is torch.nn.Linear for name in READ_BY_THE_MODEL)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    torch.testing.assert_close(logits(model, len(smollm2_tokenizer)), expected)
    assert streams(model, smollm2_tokenizer) == [None] * 5  # (a second runner: probed again)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_compiling_process_builds_the_layers_the_served_model_left_plain(quantize,
                                                                          monkeypatch):
    left = "model.layers.1.mlp.down_proj"  # (as if the model's code read its weight)
    monkeypatch.setattr(linear_layers, "linear_layers_read_elsewhere",
                        lambda model: [left] if left in dict(model.named_modules()) else [])
    model = build("llama", dtype=torch.float32)
    quantize_after_load(model, quantize, on_gpu=False)
    runner = load_runner(model)
    builder = ProgramBuilder(model, runner.geometry())
    assert builder.plain_layers == [left]
    twin = structural_twin(model.config.to_dict(), "float32", builder.quantize, {},
                           builder.packed, builder.float_weights, builder.plain_layers)
    assert ({name: type(m) for name, m in twin.named_modules()}
            == {name: type(m) for name, m in model.named_modules()})
    assert type(dict(twin.named_modules())[left]) is torch.nn.Linear
