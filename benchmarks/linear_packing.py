"""``python -m benchmarks.linear_packing``: the matrix products of one decode step, with
``nn.Linear`` and with oneDNN's prepacked weights, side by side.

Every linear layer of the model is run once on ``rows`` rows of input, in model order,
with no other operation between them: what a decode step of that many rows spends in its
matrix products, and the rate at which they read the weights. Each way is timed in turns
(``--repetitions`` rounds, the median kept) so that a busy machine slows both alike.

Example::

    python -m benchmarks.linear_packing --model-dir model --rows 1,4,16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List

import torch

from djl_stream.generation.packed_linear import (PackedLinear, pack_linear_layers,
                                                 packing_unavailable)

from .inprocess import LoadedModel


def _time(run: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.linear_packing",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rows", default="1,4,16", help="input rows (default: %(default)s)")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="step chains per timing")
    args = parser.parse_args(argv)
    if packing_unavailable():
        raise SystemExit(f"cannot prepack here: {packing_unavailable()}")
    loaded = LoadedModel.load(args.model_dir, device="cpu")
    # LoadedModel loads as the server does, which packs where a trial finds packing pays
    # (option.prepack_weights unset); packed here either way: the packed layers are the
    # model's, the plain ones are rebuilt from the same weights (unpacked here).
    pack_linear_layers(loaded.model)
    packed = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    if not packed:
        raise SystemExit("no layer could be packed")
    plain = [torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
             for m in packed]
    with torch.no_grad():
        for linear, module in zip(plain, packed):
            linear.weight.copy_(torch.ops.mkldnn._linear_pointwise(
                torch.eye(module.in_features), module.weight, None, "none", [], "").t())
            if module.bias is not None:
                linear.bias.copy_(module.bias)
    weight_bytes = sum(m.weight.numel() * 4 for m in packed)
    print(f"{len(packed)} linear layers, {weight_bytes / 1e6:.0f} MB of float32 weights, "
          f"{torch.get_num_threads()} threads")
    print("| rows | nn.Linear | prepacked | speed-up |")
    print("|---|---|---|---|")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            inputs = {width: torch.randn(rows, width) for width in {m.in_features for m in packed}}
            ways = {
                "plain": lambda: [layer(inputs[layer.in_features]) for layer in plain],
                "packed": lambda: [layer(inputs[layer.in_features]) for layer in packed],
            }
            times = {name: [] for name in ways}
            for name, run in ways.items():
                run()  # warm up
            for _ in range(args.repetitions):
                for name, run in ways.items():
                    times[name].append(_time(run, args.calls))
            plain_s, packed_s = (statistics.median(times[n]) for n in ("plain", "packed"))
            print(f"| {rows} | {plain_s * 1e3:.1f} ms ({weight_bytes / plain_s / 1e9:.1f} GB/s) "
                  f"| {packed_s * 1e3:.1f} ms ({weight_bytes / packed_s / 1e9:.1f} GB/s) "
                  f"| {plain_s / packed_s:.2f}x |")


if __name__ == "__main__":
    main()
