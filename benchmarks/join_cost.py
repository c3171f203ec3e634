"""``python -m benchmarks.join_cost``: what a newcomer's join to a running batch costs in
the KV cache, with the model's KV shape and random keys and values.

``--running-rows`` rows of ``--running-columns`` positions are decoding; a newcomer of
one row of ``--newcomer-columns`` positions has its cache written (its prefill's writes,
without the model) and joins them, with the rows and columns a CPU server reserves
(``--batch-size`` rows, ``--max-input-length`` columns on the left). ``--layout lent``
(what the scheduler does where the running cache has the room): the newcomer is written
into rows the running cache lends it (:meth:`~djl_stream.generation.kv_cache.PreallocatedCache.lease`)
and its join takes them over; ``--layout own``: it is written into a cache of its own,
and one cache takes in the other, the host chosen as continuous batching chooses it
(:func:`~djl_stream.generation.kv_cache.choose_host`).
Reported: the time of the newcomer's writes and of the join, and how much the process's
resident size grew over both. Each scenario runs in a process of its own, so that one's
freed memory does not hide the next one's growth.

Example::

    python -m benchmarks.join_cost --model-dir model --running-rows 15 \\
        --running-columns 500 --newcomer-columns 2000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import List

import torch

from djl_stream.generation.kv_cache import PreallocatedCache, choose_host
from djl_stream.generation.kv_memory import attention_shape


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _fill(cache: PreallocatedCache, shape, rows: int, columns: int) -> None:
    with torch.inference_mode():
        for layer in range(shape.layers):
            keys = torch.randn(rows, shape.kv_heads, columns, shape.head_dim)
            cache.update(keys, keys.neg(), layer)


def one_join(model_dir: str, running_rows: int, running_columns: int, newcomer_columns: int,
             batch_size: int, max_input_length: int, new_tokens: int,
             layout: str = "own") -> dict:
    """One scenario, in this process; see the module docstring."""
    from transformers import AutoConfig

    shape = attention_shape(AutoConfig.from_pretrained(model_dir))

    def reserving(rows: int, columns: int) -> PreallocatedCache:
        return PreallocatedCache(reserve_rows=batch_size, reserve_columns=columns + new_tokens,
                                 room_on_left=max_input_length)

    running = reserving(running_rows, running_columns)
    _fill(running, shape, running_rows, running_columns)
    before = _resident_mib()
    newcomer = (running.lease(1, newcomer_columns) if layout == "lent"
                else reserving(1, newcomer_columns))
    if newcomer is None:
        raise SystemExit("the running cache has no room to lend (--batch-size, "
                         "--max-input-length)")
    started = time.perf_counter()
    _fill(newcomer, shape, 1, newcomer_columns)
    written = time.perf_counter()
    caches = [running, newcomer]
    host = caches[choose_host(caches)]
    host.absorb([cache for cache in caches if cache is not host])
    joined = time.perf_counter()
    return {"layout": layout, "running_rows": running_rows, "running_columns": running_columns,
            "newcomer_columns": newcomer_columns,
            "host": "running" if host is running else "newcomer",
            "newcomer_writes_ms": round(1000 * (written - started), 1),
            "join_ms": round(1000 * (joined - written), 1),
            "resident_growth_mib": round(_resident_mib() - before)}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.join_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--running-rows", type=int, default=15)
    parser.add_argument("--running-columns", type=int, default=500)
    parser.add_argument("--newcomer-columns", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-input-length", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256,
                        help="columns reserved on the right for new tokens")
    parser.add_argument("--layout", choices=("lent", "own", "both"), default="both",
                        help="where the newcomer is written (see above); both: side by side")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = (args.model_dir, args.running_rows, args.running_columns, args.newcomer_columns,
                args.batch_size, args.max_input_length, args.new_tokens)
    if args.in_process:
        print(json.dumps(one_join(*settings, layout=args.layout)))
        return
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--in-process"]
    layouts = ("lent", "own") if args.layout == "both" else (args.layout,)
    for _ in range(args.trials):
        for layout in layouts:  # alternated, so that both see the same machine
            command = [sys.executable, "-m", "benchmarks.join_cost", "--in-process",
                       *given, "--layout", layout]
            print(subprocess.run(command, check=True, capture_output=True,
                                 text=True).stdout.strip())


if __name__ == "__main__":
    main()
