"""``python -m benchmarks.linear_products``: what a decode step's matrix products cost on this
CPU, at several row counts, through each of the products djl-stream's runtime can use.

A decode step's time on a CPU is mostly its linear layers: each weight is read once for
all the running rows. With one row the product is bound by reading the weights from
memory; with many it is bound by arithmetic, and there the kernel and the weights' layout
decide. This builds one random weight for every linear layer of the model (only their
shapes matter) and times all of them, one after the other as a step runs them, so that
the weights come from memory as in a real step:

* ``plain``: ``torch.nn.functional.linear`` on the float weights (PyTorch's BLAS);
* ``oneDNN``: oneDNN's product on weights reordered once for it (``PackedLinear``'s);
* ``streamed``: the compiler's reduction over the float weights
  (:func:`~djl_stream.runtime.linear_layers.streamed_product`), every product compiled
  into one function of the row count, with the compiler settings of the runtime's
  programs, as the compiled decode step of few rows runs them.

Each row count's ways take turns, repetition by repetition, so that a machine that slows
down slows each alike; the median of each is printed, and the fastest marked. The
runtime streams steps of up to :data:`~djl_stream.runtime.linear_layers.STREAMED_ROWS`
rows and multiplies larger ones through oneDNN: this shows whether that holds here.

Example::

    python -m benchmarks.linear_products --model-dir model --rows 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from djl_stream.runtime.decode_program import CODE_SETTINGS
from djl_stream.runtime.linear_layers import streamed_product
from djl_stream.runtime.packed_linear import PackedLinear, packing_unavailable

WAYS = ("plain", "oneDNN", "streamed")


def linear_shapes(model: torch.nn.Module) -> Dict[Tuple[int, int], int]:
    """``{(out_features, in_features): how many}`` of the model's linear layers."""
    shapes: Dict[Tuple[int, int], int] = collections.Counter()
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedLinear)):
            shapes[(module.out_features, module.in_features)] += 1
    return dict(shapes)


def _all_products(inputs: Dict[int, torch.Tensor], weights: Sequence[torch.Tensor]):
    # (each result summed so that the compiler keeps every product and returns little)
    return torch.stack([streamed_product(inputs[w.shape[1]], w).sum() for w in weights])


def step_products(shapes: Dict[Tuple[int, int], int]) -> Dict[str, Callable]:
    """For each way of :data:`WAYS` available here, a function of ``{in_features: rows}``
    that multiplies the rows by one weight per linear layer of ``shapes``."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=generator) * 0.02
               for (out_features, in_features), count in shapes.items() for _ in range(count)]
    ways: Dict[str, Callable] = {
        "plain": lambda inputs: [torch.nn.functional.linear(inputs[w.shape[1]], w)
                                 for w in weights],
    }
    if packing_unavailable() is None:
        packed = [PackedLinear.from_linear(_as_linear(w), index=i) for i, w in enumerate(weights)]
        ways["oneDNN"] = lambda inputs: [layer(inputs[layer.in_features]) for layer in packed]
    # (its code compiled as the runtime's programs are; its rows become dynamic at the
    # second count)
    compiled = torch.compile(_all_products, options=CODE_SETTINGS)
    ways["streamed"] = lambda inputs: compiled(inputs, weights)
    return ways


def _as_linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def compare(shapes: Dict[Tuple[int, int], int], rows: Sequence[int],
            repetitions: int) -> List[dict]:
    """Per row count: the median seconds of one step's products each way (``nan`` for a
    way this PyTorch lacks)."""
    ways = step_products(shapes)
    widths = sorted({in_features for _, in_features in shapes})
    results = []
    with torch.inference_mode():
        for n in rows:
            inputs = {width: torch.randn(n, width) for width in widths}
            for product in ways.values():  # (the first call compiles or warms up)
                product(inputs)
            times: Dict[str, List[float]] = {way: [] for way in ways}
            for _ in range(repetitions):
                for way, product in ways.items():
                    started = time.perf_counter()
                    product(inputs)
                    times[way].append(time.perf_counter() - started)
            results.append({"rows": n, **{way: statistics.median(times[way]) if way in times
                                          else float("nan") for way in WAYS}})
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    parser = argparse.ArgumentParser(prog="python -m benchmarks.linear_products",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repetitions", type=int, default=15)
    args = parser.parse_args(argv)
    config = AutoConfig.from_pretrained(args.model_dir)
    with torch.device("meta"):  # (the shapes only)
        model = AutoModelForCausalLM.from_config(config)
    shapes = linear_shapes(model)
    rows = [int(n) for n in args.rows.split(",")]
    print(f"{sum(shapes.values())} linear layers, {torch.get_num_threads()} threads; "
          "milliseconds a step, the fastest marked *")
    for result in compare(shapes, rows, args.repetitions):
        timed = {way: result[way] for way in WAYS if result[way] == result[way]}
        fastest = min(timed, key=timed.get)
        cells = ", ".join(f"{way} {seconds * 1e3:.1f}{'*' if way == fastest else ''}"
                          for way, seconds in timed.items())
        print(f"{result['rows']:>3} rows: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
