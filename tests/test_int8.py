"""int8 linear layers on a CPU: weight-only (``option.quantize=int8``,
:class:`Int8WeightOnlyLinear`) and with int8 activations too (``option.quantize=w8a8``,
:class:`Int8Linear`, on PyTorch's own integer product): the arithmetic they do, that a row's
result never depends on its batch mates, which layers a model gets, and loading and
generating through them."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import build_tiny_llama, greedy_in_one_batch
from djl_stream.generation.engines.accelerate import AccelerateEngine, AccelerateSettings
from djl_stream.runtime.decode_program import CODE_SETTINGS
from djl_stream.runtime.int8 import (Int8Linear, Int8WeightOnlyLinear, int8_matmul_unavailable,
                                     quantize_linear_layers, quantize_rows,
                                     quantize_weights_only, word_product)
from djl_stream.runtime.linear_layers import streaming_products
from djl_stream.runtime.loading import load_model_and_tokenizer
from djl_stream.runtime.runner import RunnerSettings, load_runner
from djl_stream.serving.properties import ModelProperties

needs_int_mm = pytest.mark.skipif(int8_matmul_unavailable() is not None,
                                  reason=f"no int8 product here: {int8_matmul_unavailable()}")

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived",
           "1, 2, 3,"]
#: Both kinds of layer, with the function that puts them in a model.
KINDS = [pytest.param(Int8WeightOnlyLinear, quantize_weights_only, id="int8"),
         pytest.param(Int8Linear, quantize_linear_layers, id="w8a8", marks=needs_int_mm)]


@needs_int_mm
@pytest.mark.parametrize("leading", [(1,), (6,), (3, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_an_int8_layer_multiplies_the_rounded_weight_by_the_rounded_rows(bias, leading):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=bias)
    quantized = Int8Linear.from_linear(layer)
    x = torch.randn(*leading, 96, generator=generator)
    with torch.inference_mode():
        out = quantized(x)
        assert out.shape == (*leading, 40) and out.dtype == torch.float32
        # exactly: weight and each input row rounded to int8 with a scale of their own
        weight_q, weight_scale = quantize_rows(layer.weight)
        rows_q, row_scale = quantize_rows(x.reshape(-1, 96))
        expected = ((rows_q.double() @ weight_q.double().t())
                    * row_scale.double()[:, None] * weight_scale.double())
        if bias:
            expected += layer.bias.double()
        torch.testing.assert_close(out.reshape(-1, 40).double(), expected, rtol=1e-6, atol=1e-6)
        # and that is close to the float32 layer, not equal to it
        reference = layer(x)
        error = float((out - reference).abs().max() / reference.abs().max())
        assert 0 < error < 0.03
    assert quantized.weight.dtype == torch.int8 and quantized.weight.shape == (40, 96)
    assert quantized(torch.randn(2, 0, 96)).shape == (2, 0, 40)  # no rows: no error


@pytest.mark.parametrize("leading", [(1,), (6,), (3, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_weight_only_layer_multiplies_the_rounded_weight_by_the_rows_as_they_are(
        bias, leading):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=bias)
    quantized = Int8WeightOnlyLinear.from_linear(layer)
    x = torch.randn(*leading, 96, generator=generator)
    with torch.inference_mode():
        out = quantized(x)
        assert out.shape == (*leading, 40) and out.dtype == torch.float32
        # the weight rounded to int8 with one scale per row; the activations untouched
        weight_q, weight_scale = quantize_rows(layer.weight)
        expected = x.reshape(-1, 96).double() @ (weight_q.double()
                                                 * weight_scale.double()[:, None]).t()
        if bias:
            expected += layer.bias.double()
        torch.testing.assert_close(out.reshape(-1, 40).double(), expected, rtol=1e-5, atol=1e-5)
        # close to the float32 layer (closer than w8a8 may be), not equal to it
        reference = layer(x)
        error = float((out - reference).abs().max() / reference.abs().max())
        assert 0 < error < 0.02
    assert quantized.weight.dtype == torch.int8 and quantized.weight.shape == (40, 96)
    assert quantized.weight_scale.shape == (40,)
    assert quantized(torch.randn(2, 0, 96)).shape == (2, 0, 40)


@pytest.mark.parametrize("count", [0, 1, 3, 17])
@pytest.mark.parametrize("out_features, width", [(1, 4), (5, 12), (40, 96)])
def test_the_word_product_is_the_product_for_any_rows_and_width(count, out_features, width):
    generator = torch.Generator().manual_seed(count)
    weight = torch.randint(-128, 128, (out_features, width), dtype=torch.int8,
                           generator=generator)  # (-128 too: every byte's sign extended)
    # rows of small whole numbers: every product and sum is exact, in any order
    rows = torch.randint(-8, 8, (count, width), generator=generator).float()
    got = word_product(rows, weight)
    assert got.shape == (count, out_features)
    assert torch.equal(got, rows @ weight.float().T)


@pytest.mark.parametrize("capability, reads_int8_vectors", [("AVX512", True), ("AVX2", False)])
def test_a_compiled_int8_layer_reads_its_weights_as_the_cpu_s_vector_code_loads_them(
        capability, reads_int8_vectors, monkeypatch):
    # Whatever this CPU is, each rule's product compiles and computes the layer's eager
    # result, one row alone as it does beside others; where the rule says int8 vectors are
    # not loaded directly, the compiled code loads none (it reads float words instead).
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    torch.manual_seed(4)
    layer = Int8WeightOnlyLinear.from_linear(torch.nn.Linear(96, 40))
    rows = torch.randn(5, 96)
    with torch.inference_mode():
        expected = layer(rows)
        for streamed in (True, False):
            torch._dynamo.reset()
            compiled = torch.compile(layer, dynamic=True, options=CODE_SETTINGS)
            with streaming_products() if streamed else contextlib.nullcontext():
                together, code = run_and_get_code(compiled, rows)
                alone = compiled(rows[:1])
            torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(alone, together[:1], rtol=1e-6, atol=1e-6)
            assert ("Vectorized<int8_t>" in "".join(code)) == reads_int8_vectors
    torch._dynamo.reset()


@pytest.mark.parametrize("kind, _", KINDS)
def test_a_layer_keeps_the_input_s_precision(kind, _):
    layer = torch.nn.Linear(32, 8)
    quantized = kind.from_linear(layer)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        out = quantized(x.double())
        assert out.dtype == torch.float64
        torch.testing.assert_close(out.float(), quantized(x), rtol=1e-5, atol=1e-5)


@needs_int_mm
def test_a_row_s_result_does_not_depend_on_its_batch_mates():
    torch.manual_seed(1)
    quantized = Int8Linear.from_linear(torch.nn.Linear(256, 64, bias=False))
    rows = torch.randn(9, 256)
    rows[4] *= 50  # a batch mate with far larger values: a per-tensor scale would shift
    with torch.inference_mode():
        together = quantized(rows)
        for i in range(len(rows)):
            assert torch.equal(quantized(rows[i:i + 1])[0], together[i])


def test_a_weight_that_is_not_a_plain_float_cpu_matrix_is_left_alone():
    layer = torch.nn.Linear(16, 8)
    integer = torch.nn.Linear(16, 8)
    integer.weight = torch.nn.Parameter(torch.zeros(8, 16, dtype=torch.int32), requires_grad=False)
    assert Int8WeightOnlyLinear.from_linear(integer) is None
    model = torch.nn.Sequential(layer, integer)
    assert quantize_weights_only(model) == 1
    assert type(model[0]) is Int8WeightOnlyLinear and model[1] is integer


@pytest.mark.parametrize("kind, quantize", KINDS)
def test_every_linear_of_the_tiny_llama_becomes_int8_and_the_tied_head_is_a_copy(
        smollm2_tokenizer, kind, quantize):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    embedding = model.get_input_embeddings().weight.detach().clone()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert quantize(model) == linears == 2 * 7 + 1
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert all(type(m) is kind for name, m in model.named_modules()
               if name.endswith(("_proj", "lm_head")))
    # the input embedding keeps its float32 rows; the head's int8 weight is a copy of them
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert model.lm_head.weight.dtype == torch.int8
    assert model.lm_head.weight.duplicates_a_weight
    assert not model.model.layers[0].mlp.up_proj.weight.duplicates_a_weight
    assert quantize(model) == 0  # nothing left to quantize


@needs_int_mm
def test_batching_does_not_change_a_request_s_w8a8_text(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    quantize_linear_layers(model)
    runner = load_runner(model, RunnerSettings(max_rows=4, max_positions=64))
    together = greedy_in_one_batch(runner, smollm2_tokenizer, PROMPTS)
    alone = [greedy_in_one_batch(runner, smollm2_tokenizer, [p])[0] for p in PROMPTS]
    assert together == alone


@pytest.mark.parametrize("kind, quantize", KINDS)
def test_a_quantized_tiny_model_streams_through_an_accelerate_engine(
        smollm2_tokenizer, kind, quantize):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    float32 = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    assert quantize(model) == 15
    ids = torch.tensor([smollm2_tokenizer(PROMPTS[0])["input_ids"]])
    with torch.inference_mode():
        ours, theirs = model(ids).logits[0, -1], float32(ids).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    assert not torch.equal(ours, theirs)  # it did quantize
    engine = AccelerateEngine(model, smollm2_tokenizer, AccelerateSettings(
        max_batch_size=4, max_input_length=64, max_new_tokens=16))
    try:
        # the int8 layers keep the model on the fast path (the probe at load agreed)
        assert engine.runner.path == "attention"
        steps = list(engine.generate(PROMPTS, max_new_tokens=6, ignore_eos=True))
    finally:
        engine.shutdown()
    assert len(steps) == 6 and all(len(step) == len(PROMPTS) for step in steps)
    texts = ["".join(step[i] for step in steps) for i in range(len(PROMPTS))]
    assert all(texts), texts
    # each prompt's text is the model's own greedy continuation
    runner = load_runner(model, RunnerSettings(max_rows=4, max_positions=64))
    expected = greedy_in_one_batch(runner, smollm2_tokenizer, PROMPTS, new_tokens=6)
    assert texts == [smollm2_tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]


def load(directory, **options):
    return load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(directory), **options}))


@needs_int_mm
def test_option_quantize_w8a8_loads_int8_layers_that_batch_without_changing_text(
        tiny_model_dir, monkeypatch):
    from djl_stream.runtime import quantization

    # (a CPU with int8 dot products, whatever this one is: without them w8a8 serves int8,
    # see test_quantization)
    monkeypatch.setattr(quantization, "lacks_int8_dot_products", lambda: False)
    model, tokenizer = load(tiny_model_dir, quantize="w8a8")
    assert all(isinstance(m, Int8Linear) for name, m in model.named_modules()
               if name.endswith(("_proj", "lm_head")))
    float32, _ = load(tiny_model_dir)
    with torch.inference_mode():
        ids = torch.tensor([[1, 400, 401, 402, 403]])
        ours, theirs = model(ids).logits[0, -1], float32(ids).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    assert not torch.equal(ours, theirs)  # it did quantize
    runner = load_runner(model, RunnerSettings(max_rows=4, max_positions=64))
    assert runner.path == "attention"
    together = greedy_in_one_batch(runner, tokenizer, PROMPTS)
    assert together == [greedy_in_one_batch(runner, tokenizer, [p])[0] for p in PROMPTS]
