"""``python -m benchmarks.row_padding``: a decode step's products at each row count, and
the eager decode step with and without its products padded to 16 rows.

First, for each weight shape of the model's decode step, one product's fastest call (of
``--repetitions``) at 1 to 16, 24 and 32 rows: where the CPU's GEMM leaves its few-row
kernel, and what padding saves (:mod:`djl_stream.generation.row_padding`). Then the
whole eager step (:func:`djl_stream.generation.llama_decode._decode_logits`, random inputs
over 150 cached columns) at each of ``--rows``, with the products the load's trial padded
and with none padded, taking turns (the median of ``--steps`` each), and how far apart
their logits are.

Example::

    python -m benchmarks.row_padding --model-dir model --rows 9,12,15,16
    python -m benchmarks.row_padding --model-dir model --rows 16 --shapes 11008x4096,32000x4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch

from djl_stream.generation import llama_decode
from djl_stream.generation.row_padding import PADDED_ROWS, RowPaddedLinear, fastest_call

from .inprocess import LoadedModel

PRODUCT_ROWS = list(range(1, PADDED_ROWS + 1)) + [24, 32]
CACHED_COLUMNS = 150


def _unpadded(layer):
    return layer.layer if isinstance(layer, RowPaddedLinear) else layer


def product_table(step, repetitions: int, extra_shapes: List[tuple] = ()) -> List[str]:
    """Markdown rows: per weight shape of the step (and per ``(out, in)`` of
    ``extra_shapes``, random weights in the step's dtype), the fastest product at each of
    PRODUCT_ROWS."""
    dtype = step.embedding.dtype
    layers = {}
    for layer in step.products():
        plain = _unpadded(layer)
        layers.setdefault((plain.out_features, plain.in_features), plain)
    for out_features, in_features in extra_shapes:
        layers[(out_features, in_features)] = torch.nn.Linear(
            in_features, out_features, bias=False).to(dtype)
    lines = ["| weight | " + " | ".join(map(str, PRODUCT_ROWS)) + " |",
             "|---|" + "---|" * len(PRODUCT_ROWS)]
    for shape, layer in layers.items():
        cells = [f"{fastest_call(layer, rows, dtype, repetitions) * 1e3:.2f}"
                 for rows in PRODUCT_ROWS]
        lines.append(f"| {shape[0]} x {shape[1]} | " + " | ".join(cells) + " |")
    return lines


def step_table(step, rows_list: List[int], steps: int) -> List[str]:
    """Markdown rows: the eager step at each row count, padded as loaded and unpadded."""
    g = step.geometry
    plain_layers = [{name: _unpadded(value) for name, value in layer.items()}
                    for layer in step.layers]
    plain_head = _unpadded(step.lm_head)
    generator = torch.Generator().manual_seed(0)
    dtype = step.embedding.dtype

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)
    lines = ["| rows | padded as loaded | none padded | padded / none | largest logit difference |",
             "|---|---|---|---|---|"]
    for rows in rows_list:
        angle = random(rows, 1, 1, g.head_dim)
        inputs = (random(rows, step.embedding.shape[1]), angle.cos(), angle.sin(),
                  torch.zeros(rows, 1, 1, CACHED_COLUMNS, dtype=dtype))
        capacity = CACHED_COLUMNS + 8
        keys = [random(rows, g.kv_heads, capacity, g.head_dim) for _ in step.layers]
        values = [random(rows, g.kv_heads, capacity, g.head_dim) for _ in step.layers]
        column = torch.tensor([CACHED_COLUMNS - 1])
        ways = {"padded": (step.layers, step.lm_head), "none": (plain_layers, plain_head)}
        times: Dict[str, List[float]] = {name: [] for name in ways}
        logits = {}
        with torch.inference_mode():
            for _ in range(steps):
                for name, (layers, head) in ways.items():
                    started = time.perf_counter()
                    logits[name] = llama_decode._decode_logits(
                        g, layers, step.final_norm, head, *inputs, keys, values, column, 0)
                    times[name].append(time.perf_counter() - started)
        padded, none = (statistics.median(times[name]) for name in ways)
        difference = float((logits["padded"] - logits["none"]).abs().max())
        lines.append(f"| {rows} | {padded * 1e3:.1f} ms | {none * 1e3:.1f} ms | "
                     f"{padded / none:.2f} | {difference:.1e} |")
    return lines


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.row_padding",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rows", default="8,9,10,11,12,13,14,15,16",
                        help="rows of the whole steps (default: %(default)s)")
    parser.add_argument("--repetitions", type=int, default=7, help="calls per product timing")
    parser.add_argument("--steps", type=int, default=12, help="steps per way and row count")
    parser.add_argument("--shapes", default="",
                        help="more weight shapes OUTxIN to time products of, random weights "
                             "(a 7B Llama's: 11008x4096,32000x4096)")
    args = parser.parse_args(argv)
    extra = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",") if shape]
    loaded = LoadedModel.load(args.model_dir, device="cpu", decode_step="eager")
    step = llama_decode.step_of(loaded.model)
    if step is None:
        raise SystemExit("this model has no djl-stream decode step (see the load's log)")
    print("One product's fastest call (ms) by rows:\n")
    print("\n".join(product_table(step, args.repetitions, extra)))
    print("\nThe eager decode step (median):\n")
    print("\n".join(step_table(step, [int(r) for r in args.rows.split(",")], args.steps)))


if __name__ == "__main__":
    main()
