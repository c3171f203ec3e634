"""The products a compiled decode step multiplies through (:mod:`djl_stream.runtime.
linear_layers`): the streamed and the blocked reduction compute the product, a row's result
never depends on the rows beside it, and the rules that choose between them."""

from __future__ import annotations

import threading

import pytest
import torch

from djl_stream.runtime.decode_program import CODE_SETTINGS
from djl_stream.runtime.linear_layers import (blocked_product, features_in_a_block,
                                              products_stream, streamed_product, streamed_rows,
                                              streaming_products)


def _int8_weight(out_features, in_features, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8,
                         generator=generator)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 9])
@pytest.mark.parametrize("out_features", [16, 6, 7])  # blocks of 8, of 2, of 1 feature
@pytest.mark.parametrize("features", [8, 4, 1])
def test_the_blocked_product_is_the_product_for_any_rows_features_and_block(
        count, out_features, features):
    weight = _int8_weight(out_features, 48)
    rows = torch.randn(count, 48, generator=torch.Generator().manual_seed(1))
    expected = rows @ weight.float().T
    got = blocked_product(rows, weight, features)
    assert got.shape == (count, out_features)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_compiled_the_blocked_product_sums_as_the_streamed_one_whatever_the_batch():
    # the streamed program serves one row, the blocked one several: a row must get the same
    # product from either, alone or beside others, or a request's text would depend on how
    # many others run beside it
    weight = _int8_weight(40, 96)
    streamed = torch.compile(streamed_product, options=CODE_SETTINGS, dynamic=True)
    blocked = torch.compile(blocked_product, options=CODE_SETTINGS, dynamic=True)
    rows = torch.randn(7, 96, generator=torch.Generator().manual_seed(2))
    try:
        with torch.inference_mode():
            alone = streamed(rows[:1], weight)
            for count in (2, 5, 7):
                together = blocked(rows[:count], weight)
                torch.testing.assert_close(together, streamed(rows[:count], weight),
                                           rtol=1e-6, atol=1e-5)
                torch.testing.assert_close(together[:1], alone, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(together, rows @ weight.float().T, rtol=1e-5,
                                       atol=1e-4)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("registers", [16, 32])
def test_a_block_s_sums_and_weights_fit_in_the_vector_registers_beside_a_row(registers):
    features = features_in_a_block(registers)
    assert 2 * features + 1 <= registers - 2
    assert 2 * (2 * features) + 1 > registers - 2  # (and no twice as large block would)


def test_an_exported_blocked_product_keeps_its_row_count_dynamic():
    # the program of every row count is exported with the rows as a dynamic size from 1:
    # a product that split or broadcast them would have export fix them
    class Product(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(_int8_weight(40, 96), requires_grad=False)

        def forward(self, rows):
            return blocked_product(rows, self.weight)

    rows = torch.export.Dim("rows", min=1, max=17)
    exported = torch.export.export(Product(), (torch.randn(2, 96),),
                                   dynamic_shapes=({0: rows},), strict=False)
    weight = _int8_weight(40, 96).float()
    for count in (1, 2, 17):
        x = torch.randn(count, 96)
        torch.testing.assert_close(exported.module()(x), x @ weight.T, rtol=1e-4, atol=1e-3)


def test_fewer_rows_stream_through_narrower_weights():
    assert streamed_rows(torch.float32) == 4
    assert streamed_rows(torch.float16) == streamed_rows(torch.bfloat16) == 2
    assert streamed_rows(torch.int8) == 1


def test_streaming_products_holds_for_its_block_and_its_thread_only():
    seen = []
    with streaming_products():
        with streaming_products():
            assert products_stream()
        assert products_stream()  # (an inner block does not end the outer one)
        other = threading.Thread(target=lambda: seen.append(products_stream()))
        other.start()
        other.join()
    assert not products_stream()
    assert seen == [False]
