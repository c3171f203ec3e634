"""``python -m benchmarks.compiled_weights``: one stream through the eager step and through
the compiled one-row step reading the model's weights (the default on a CPU) and with its
own copy of them (``option.compiled_weights``), side by side.

Each server is started alone in turn (``python -m djl_stream serve``, so that each has
the machine and its caches to itself, as in use), streams one warm-up request and then
``--requests`` greedy requests of ``--new-tokens`` tokens one after another; the servers
take turns ``--rounds`` times, so that a machine that slows down slows each alike. A
compiled server's first start on a machine compiles its program (a minute or two) before
``/ping`` answers; that wait is not timed.

Example::

    python -m benchmarks.compiled_weights --model-dir model
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List

from .http_load import ServerProcess, request_body, stream_once
from .settings import PROMPTS

#: The servers compared: their properties beside the model directory's own.
SERVERS = {
    "eager": {"decode_step": "eager"},
    "compiled, own copy": {"compiled_weights": "copy"},
    "compiled, shared (the default)": {},
}


def one_server(model_dir: str, options: Dict[str, str], requests: int,
               new_tokens: int) -> dict:
    """Inter-token gaps' medians and times to first token (ms) of ``requests`` streams
    one after another, and the server's resident memory after them (MB)."""
    itl: List[float] = []
    ttft: List[float] = []
    with ServerProcess(model_dir, name="compiled-weights",
                       workdir=Path(tempfile.mkdtemp(prefix="compiled-weights-")),
                       options=options) as server:
        stream_once(server.url, request_body(PROMPTS[0], 16))
        for i in range(requests):
            timing = stream_once(server.url, request_body(PROMPTS[i % len(PROMPTS)], new_tokens))
            if timing.error:
                raise SystemExit(f"{options}: {timing.error}\n{server.log_tail()}")
            itl.append(statistics.median(timing.inter_token) * 1e3)
            ttft.append(timing.ttft * 1e3)
        memory = server.memory()
    return {"itl": itl, "ttft": ttft, "rss": memory.rss / 1e6 if memory else float("nan")}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled_weights",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3, help="streams per server per round")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    seen: Dict[str, dict] = {name: {"itl": [], "ttft": [], "rss": []} for name in SERVERS}
    for _ in range(args.rounds):
        for name, options in SERVERS.items():
            result = one_server(args.model_dir, options, args.requests, args.new_tokens)
            for key in ("itl", "ttft"):
                seen[name][key] += result[key]
            seen[name]["rss"].append(result["rss"])
            print(f"{name}: {result}", flush=True)
    base = statistics.median(seen["eager"]["itl"])
    print(f"\n{args.model_dir}: one stream, {args.rounds} rounds of {args.requests} requests of "
          f"{args.new_tokens} tokens per server (medians)\n")
    print("| server | time per token (ITL p50) | vs eager | TTFT | RSS after |")
    print("|---|---|---|---|---|")
    for name, values in seen.items():
        itl = statistics.median(values["itl"])
        print(f"| {name} | {itl:.1f} ms | {base / itl:.2f}x | "
              f"{statistics.median(values['ttft']):.0f} ms | {max(values['rss']):.0f} MB |")


if __name__ == "__main__":
    main()
