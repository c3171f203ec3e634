"""``python -m benchmarks.loading_thread``: decode steps in the scheduler's thread with the
model loaded in the calling thread (as djl-serving's Python worker calls ``handle`` to
load) against loaded in a thread that ends with the load (what
:func:`~djl_stream.runtime.loading.load_model_and_tokenizer` does: see
:func:`~djl_stream.runtime.loading.in_passing_thread`).

Each way runs in a process of its own (an OpenMP thread pool is process state), the ways
taking turns; in each, ``--clients`` prompts decode ``--tokens`` greedy tokens together
through the :class:`~djl_stream.generation.scheduler.Scheduler`, twice. Reported: the
aggregate tokens/s and the median time of a decode step of all the rows.

Example::

    python -m benchmarks.loading_thread --model-dir model --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import List

WAYS = {"calling": "loaded in the calling thread (which lives on)",
        "passing": "loaded in a passing thread (load_model_and_tokenizer)"}


def run_child(way: str, model_dir: str, clients: int, tokens: int) -> dict:
    """One process's figures: load ``way``, decode, return tokens/s and step medians."""
    from djl_stream.generation import batch as batch_module
    from djl_stream.runtime import loading
    from djl_stream.generation import scheduler as scheduler_module
    from djl_stream.generation.sequence import GenerationSequence
    from djl_stream.serving.properties import ModelProperties

    from .inprocess import djl_init_properties
    from .settings import PROMPTS

    props = ModelProperties.from_init_properties(djl_init_properties(model_dir))
    load = loading.load_model_and_tokenizer if way == "passing" else \
        loading._load_model_and_tokenizer  # the same load, in this thread
    model, tokenizer = load(props)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for i in range(clients)]
    full_steps: List[float] = []
    generate = batch_module.generate_token

    def timed(model_, batch, *args, **kwargs):
        started = time.perf_counter()
        result = generate(model_, batch, *args, **kwargs)
        if len(batch) == clients and batch.columns_to_feed == 1:
            full_steps.append(time.perf_counter() - started)
        return result

    scheduler_module.generate_token = timed  # the scheduler's own name for it
    rates = []
    for _ in range(2):
        scheduler = scheduler_module.Scheduler(model, pad_token_id=tokenizer.pad_token_id or 0,
                                               device="cpu", max_batch_size=max(32, clients))
        sequences = [GenerationSequence(i, ids, tokenizer, max_new_tokens=tokens,
                                        eos_token_ids=set(), ignore_eos=True)
                     for i, ids in enumerate(prompts)]
        started = time.perf_counter()
        for _ in scheduler.submit(sequences):
            pass
        rates.append(clients * tokens / (time.perf_counter() - started))
        scheduler.shutdown()
    return {"tokens_per_s": statistics.median(rates), "step_ms": statistics.median(full_steps) * 1e3}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loading_thread",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=sorted(WAYS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, args.model_dir, args.clients, args.tokens)))
        return
    figures = {way: [] for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.loading_thread", "--child", way,
                 "--model-dir", args.model_dir, "--clients", str(args.clients),
                 "--tokens", str(args.tokens)],
                check=True, capture_output=True, text=True).stdout
            figures[way].append(json.loads(out.strip().splitlines()[-1]))
    print(f"\n{args.model_dir}: {args.clients} prompts x {args.tokens} greedy tokens through "
          f"the scheduler, {args.rounds} processes a way, taking turns\n")
    print(f"| model | aggregate tokens/s | decode step of {args.clients} rows (median) |")
    print("|---|---|---|")
    for way, description in WAYS.items():
        rates = ", ".join(f"{f['tokens_per_s']:.0f}" for f in figures[way])
        steps = ", ".join(f"{f['step_ms']:.1f} ms" for f in figures[way])
        print(f"| {description} | {rates} | {steps} |")


if __name__ == "__main__":
    main()
