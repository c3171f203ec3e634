"""``option.quantize=int8`` on a CPU: djl-stream's int8 weight-only layers and the product
the compiled programs run over them (the programs themselves: test_compiled_decode)."""

from __future__ import annotations

import pytest
import torch

from djl_stream.generation import int8_weights
from djl_stream.generation.int8_linear import quantize_rows
from djl_stream.generation.int8_weights import (Int8WeightOnlyLinear, Int8WeightProduct,
                                                interleaved_columns, quantize_weights_only)


@pytest.fixture()
def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(36, 20)


@pytest.fixture(params=[torch.int32, torch.float32])
def words_of(request, monkeypatch):
    """Both types of words the programs may read (AVX-512's and AVX2's), whatever this
    CPU's."""
    monkeypatch.setattr(int8_weights, "words_dtype", lambda: request.param)
    return request.param


def test_the_weight_is_the_rows_int8_with_its_columns_interleaved(linear):
    layer = Int8WeightOnlyLinear.from_linear(linear)
    expected, scale = quantize_rows(linear.weight.detach())
    assert layer.weight.dtype == torch.int8 and layer.weight.shape == (20, 36)
    torch.testing.assert_close(layer.weight_scale, scale)
    # stored column 4j + k holds column 9k + j (36 columns: 9 words a row)
    assert torch.equal(layer.weight, expected[:, interleaved_columns(36)])
    assert interleaved_columns(36)[:5].tolist() == [0, 9, 18, 27, 1]
    # the words the programs read are the same bytes, not a copy
    assert layer.words.dtype == int8_weights.words_dtype() and layer.words.shape == (20, 9)
    assert layer.words.data_ptr() == layer.weight.data_ptr()


@pytest.mark.parametrize("bits,expected", [(512, torch.int32), (256, torch.float32)])
def test_the_words_are_int32_where_inductor_vectorizes_with_avx512(monkeypatch, bits,
                                                                     expected):
    from torch._inductor import cpu_vec_isa

    class Isa:
        def bit_width(self):
            return bits

        def __bool__(self):
            return True

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", Isa)
    int8_weights.words_dtype.cache_clear()
    try:
        assert int8_weights.words_dtype() == expected
        layer = Int8WeightOnlyLinear.from_linear(torch.nn.Linear(36, 20))
        assert layer.words.dtype == expected
    finally:
        int8_weights.words_dtype.cache_clear()


@pytest.mark.parametrize("shape", [(3, 36), (2, 5, 36), (36,)])
def test_the_eager_forward_is_nn_linear_s_within_int8_rounding(linear, shape):
    layer = Int8WeightOnlyLinear.from_linear(linear)
    x = torch.randn(*shape)
    expected = linear(x).detach()
    out = layer(x)
    assert out.shape == expected.shape
    assert (out - expected).abs().max() / expected.abs().max() < 0.02
    # exactly the dequantized weight's product: the rounding is the weight's alone
    dequantized = quantize_rows(linear.weight.detach())
    exact = x @ (dequantized[0].float() * dequantized[1][:, None]).t() + linear.bias.detach()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_programs_product_is_the_eager_forward_s_in_rows_by_outputs_layout(linear, rows,
                                                                             words_of):
    layer = Int8WeightOnlyLinear.from_linear(linear)
    assert Int8WeightProduct(layer).words.dtype == words_of
    x = torch.randn(rows, 36)
    product = Int8WeightProduct(layer)(x)
    assert product.shape == (rows, 20) and product.stride() == (20, 1)
    torch.testing.assert_close(product, layer(x), rtol=1e-5, atol=1e-5)
    # it reads the layer's own bytes and scales (a program sharing the weights is given them)
    state = Int8WeightProduct(layer).state_dict(keep_vars=True)
    assert state["words"].data_ptr() == layer.weight.data_ptr()
    assert state["weight_scale"] is layer.weight_scale


def test_the_product_compiled_by_inductor_gives_the_same_sums_with_a_loop_tail(words_of):
    # 36 columns are 9 words a row: Inductor's vector loop of 8 and a scalar tail
    torch.manual_seed(1)
    layer = Int8WeightOnlyLinear.from_linear(torch.nn.Linear(36, 20, bias=False))
    product = Int8WeightProduct(layer)
    compiled = torch.compile(product, dynamic=False)
    x = torch.randn(2, 36)
    torch.testing.assert_close(compiled(x), product(x), rtol=1e-5, atol=1e-5)


def test_only_float_layers_of_a_width_made_of_whole_words_are_quantized():
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    assert quantize_weights_only(model) == 1
    assert type(model[0]) is Int8WeightOnlyLinear and type(model[2]) is torch.nn.Linear
    assert Int8WeightOnlyLinear.from_linear(torch.nn.Linear(6, 2)) is None
