"""``python -m benchmarks.linear_products``: what a decode step's matrix products cost on this
CPU through PyTorch's default product and through oneDNN with its weights prepacked, at
several row counts.

A decode step's time on a CPU is mostly its linear layers: each weight is read once for
all the running rows. With one row the product is bound by reading the weights; with many
it is bound by arithmetic, and there the kernel and the weights' layout decide. This
times each distinct linear shape of the model (counted as often as the model has it) with
``torch.nn.functional.linear`` on the plain weight, and with oneDNN's linear on a weight
reordered for that row count (``torch.ops.mkldnn``: the private operators that
djl-stream's packed linear layers call), and prints each row count's total per step. The
weights are random: only their shapes matter. Each shape is timed with its weight hot in
the CPU's caches, so one row's figures flatter both ways (a real step reads its weights
from memory); with many rows the products are bound by arithmetic, as in a real step.

Example::

    python -m benchmarks.linear_products --model-dir model --rows 1,4,16
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from djl_stream.runtime.packed_linear import PackedLinear


def linear_shapes(model: torch.nn.Module) -> Dict[Tuple[int, int], int]:
    """``{(out_features, in_features): how many}`` of the model's linear layers."""
    shapes: Dict[Tuple[int, int], int] = collections.Counter()
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedLinear)):
            shapes[(module.out_features, module.in_features)] += 1
    return dict(shapes)


def seconds_per_call(call: Callable[[], object], repetitions: int) -> float:
    for _ in range(max(2, repetitions // 10)):
        call()
    started = time.perf_counter()
    for _ in range(repetitions):
        call()
    return (time.perf_counter() - started) / repetitions


def packed_product(weight: torch.Tensor, rows: int) -> Optional[Callable]:
    """oneDNN's linear over ``weight`` reordered for ``rows`` rows, or ``None`` where this
    build of PyTorch has no such operator."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return None


def compare(shapes: Dict[Tuple[int, int], int], rows: Sequence[int],
            repetitions: int) -> List[dict]:
    """Per row count: seconds of one step's products, plain and packed."""
    results = []
    for n in rows:
        plain = packed = 0.0
        for (out_features, in_features), count in shapes.items():
            weight = torch.randn(out_features, in_features)
            x = torch.randn(n, in_features)
            plain += count * seconds_per_call(
                lambda: torch.nn.functional.linear(x, weight), repetitions)
            product = packed_product(weight, n)
            packed += (count * seconds_per_call(lambda: product(x), repetitions)
                       if product else float("nan"))
        results.append({"rows": n, "plain": plain, "packed": packed})
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(prog="python -m benchmarks.linear_products",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--repetitions", type=int, default=50)
    args = parser.parse_args(argv)
    config = AutoConfig.from_pretrained(args.model_dir)
    with torch.device("meta"):  # (the shapes only)
        model = AutoModelForCausalLM.from_config(config)
    shapes = linear_shapes(model)
    rows = [int(n) for n in args.rows.split(",")]
    print(f"{sum(shapes.values())} linear layers, {torch.get_num_threads()} threads")
    for result in compare(shapes, rows, args.repetitions):
        print(f"{result['rows']:>3} rows: plain {result['plain'] * 1e3:.1f} ms, oneDNN "
              f"prepacked {result['packed'] * 1e3:.1f} ms a step "
              f"({result['plain'] / result['packed']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
