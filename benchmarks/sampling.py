"""``python -m benchmarks.sampling``: what choosing the next token costs a decode step,
greedy against sampling, with the parameters clients send.

Each way decodes the same prompts (``--rows`` of the benchmark's prompts, chat-rendered,
``--tokens`` new tokens each, end-of-sequence ignored) as one request through
``StreamingUtils.get_stream_generator("Accelerate")``, the scheduler the server runs, and
keeps the median gap between two consecutive steps after the first few; the ways take
turns, ``--repetitions`` times, so that a busy machine slows each alike:

- ``greedy``: no processor, one batched argmax;
- ``min_new_tokens``: greedy with end-of-sequence barred until the last token;
- ``sampling``: ``do_sample`` with no warper (OpenAI's defaults: temperature 1, top_p 1);
- ``temperature + top_p``: ``temperature=0.7, top_p=0.9``, what chat clients often send.

Example::

    python -m benchmarks.sampling --model-dir model --rows 1,16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

from djl_stream import StreamingUtils

from .inprocess import LoadedModel
from .settings import PROMPTS

#: What each way adds to a greedy request's parameters.
WAYS: Dict[str, dict] = {
    "greedy": {},
    "min_new_tokens": {"min_new_tokens": None},  # set to the request's token count
    "sampling": {"do_sample": True, "manual_seed": 1},
    "temperature + top_p": {"do_sample": True, "temperature": 0.7, "top_p": 0.9,
                            "manual_seed": 1},
}
#: Steps left out at the start of each generation (the prefill and the first steps).
SKIPPED = 4


def step_gap(lm: LoadedModel, texts: List[str], tokens: int, parameters: dict) -> float:
    """Median seconds between two consecutive steps of one request of ``texts``."""
    generator = StreamingUtils.get_stream_generator("Accelerate")
    arrivals = []
    for _ in generator(lm.model, lm.tokenizer, texts, max_new_tokens=tokens,
                       ignore_eos="min_new_tokens" not in parameters, **parameters):
        arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])][SKIPPED:]
    return statistics.median(gaps)


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sampling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rows", default="1,16", help="prompts in the request (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per prompt")
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    args = parser.parse_args(argv)
    lm = LoadedModel.load(args.model_dir, device=args.device)
    rows_list = [int(r) for r in args.rows.split(",")]
    texts = [lm.prompt(PROMPTS[i % len(PROMPTS)]).text for i in range(max(rows_list))]
    gaps: Dict[tuple, List[float]] = {}
    for _ in range(args.repetitions):
        for rows in rows_list:
            for name, parameters in WAYS.items():
                parameters = {k: (args.tokens if v is None else v) for k, v in parameters.items()}
                gaps.setdefault((name, rows), []).append(
                    step_gap(lm, texts[:rows], args.tokens, parameters))
    print(f"\n{args.model_dir} on {lm.device}: time of a decode step (median gap between "
          f"steps, median of {args.repetitions} rounds of {args.tokens} tokens)\n")
    print("| rows | " + " | ".join(WAYS) + " |")
    print("|---|" + "---|" * len(WAYS))
    for rows in rows_list:
        base = statistics.median(gaps[("greedy", rows)])
        cells = [f"{statistics.median(gaps[(name, rows)]) * 1e3:.1f} ms"
                 + ("" if name == "greedy" else
                    f" ({statistics.median(gaps[(name, rows)]) / base:.2f}x)")
                 for name in WAYS]
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
