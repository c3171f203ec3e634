"""``benchmarks.linear_products`` on the tiny model: it finds every linear layer's shape and
times each way of multiplying at each row count asked for."""

from __future__ import annotations

import math

import torch

from benchmarks.linear_products import compare, linear_shapes, main, step_products
from conftest import build_tiny_llama
from djl_stream.runtime.packed_linear import pack_linear_layers, packing_unavailable


def test_every_linear_layer_is_counted_by_its_shape():
    fresh, packed = build_tiny_llama(100), build_tiny_llama(100)
    pack_linear_layers(packed)  # (a runner packs its model's layers where it can)
    shapes = linear_shapes(fresh)
    assert linear_shapes(packed) == shapes
    # 2 layers of q, k, v, o, gate, up, down, and the LM head
    assert sum(shapes.values()) == 2 * 7 + 1
    assert shapes[(64, 64)] == 4  # q and o of each layer (k and v are 2 heads of 16 wide)


def test_every_way_is_timed_at_each_row_count():
    results = compare(linear_shapes(build_tiny_llama(64)), [1, 3], repetitions=2)
    assert [r["rows"] for r in results] == [1, 3]
    for result in results:
        assert result["plain"] > 0 and result["streamed"] > 0
        assert result["oneDNN"] > 0 or (math.isnan(result["oneDNN"])
                                         and packing_unavailable() is not None)


def test_the_streamed_way_computes_the_products_of_the_plain_one():
    inputs = {16: torch.randn(3, 16), 40: torch.randn(3, 40)}
    ways = step_products({(24, 16): 2, (16, 40): 1})
    with torch.inference_mode():
        plain = ways["plain"](inputs)
        streamed = ways["streamed"](inputs)
    torch.testing.assert_close(streamed, torch.stack([p.sum() for p in plain]),
                               rtol=1e-4, atol=1e-4)


def test_the_command_prints_a_line_per_row_count(tiny_model_dir, capsys):
    assert main(["--model-dir", str(tiny_model_dir), "--rows", "1,2", "--repetitions", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("15 linear layers")
    assert all("streamed" in line and line.count("*") == 1 for line in lines[1:])
    assert [line.split(" rows:")[0].strip() for line in lines[1:]] == ["1", "2"]
