"""``benchmarks.linear_products`` on the tiny model: it finds every linear layer's shape and
times both products at each row count asked for."""

from __future__ import annotations

import math

from benchmarks.linear_products import compare, linear_shapes, main
from conftest import build_tiny_llama
from djl_stream.runtime.packed_linear import pack_linear_layers


def test_every_linear_layer_is_counted_by_its_shape():
    fresh, packed = build_tiny_llama(100), build_tiny_llama(100)
    pack_linear_layers(packed)  # (a runner packs its model's layers where it can)
    shapes = linear_shapes(fresh)
    assert linear_shapes(packed) == shapes
    # 2 layers of q, k, v, o, gate, up, down, and the LM head
    assert sum(shapes.values()) == 2 * 7 + 1
    assert shapes[(64, 64)] == 4  # q and o of each layer (k and v are 2 heads of 16 wide)


def test_both_products_are_timed_at_each_row_count():
    results = compare(linear_shapes(build_tiny_llama(64)), [1, 3], repetitions=2)
    assert [r["rows"] for r in results] == [1, 3]
    for result in results:
        assert result["plain"] > 0 and (result["packed"] > 0 or math.isnan(result["packed"]))


def test_the_command_prints_a_line_per_row_count(tiny_model_dir, capsys):
    assert main(["--model-dir", str(tiny_model_dir), "--rows", "1,2", "--repetitions", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("15 linear layers")
    assert [line.split(" rows:")[0].strip() for line in lines[1:]] == ["1", "2"]
