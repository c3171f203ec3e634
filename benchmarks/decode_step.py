"""``python -m benchmarks.decode_step``: a decode step through djl-stream's runtime beside the
model's forward over a transformers ``DynamicCache``, at several row counts.

Each way decodes the same prompts (1, 4 and 16 rows of the benchmark's prompts, greedy,
end-of-sequence ignored). djl-stream's way runs :func:`~djl_stream.generation.batch.
generate_token` as the scheduler runs it; the forward's way feeds its rows left-padded in
one batch, as ``generate()`` batches them. The median time of a step is kept over
``--steps`` steps, the ways taking turns so that a busy machine slows each alike, and each
way's greedy tokens are compared with the other's.

Example::

    python -m benchmarks.decode_step --model-dir model --rows 1,4,16
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Sequence

import torch
from transformers import DynamicCache

from djl_stream.generation.batch import CausalLMBatch, generate_token
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.runtime.forward_kwargs import cache_kwarg, last_logits_only
from djl_stream.runtime.runner import ModelRunner, RunnerSettings, load_runner

from .inprocess import LoadedModel
from .settings import PROMPTS


def decode_steps(runner: ModelRunner, tokenizer, prompts: Sequence[Sequence[int]], steps: int):
    """Median seconds of a decode step of ``prompts`` in one batch on ``runner`` (the first
    two steps left out), and each row's greedy tokens."""
    sequences = [GenerationSequence(i, list(ids), tokenizer, max_new_tokens=steps + 2,
                                    eos_token_ids=set(), ignore_eos=True)
                 for i, ids in enumerate(prompts)]
    batch = CausalLMBatch.from_sequences(runner, sequences)
    _, batch = generate_token(runner, batch)  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _, batch = generate_token(runner, batch)
        times.append(time.perf_counter() - start)
    if batch is not None:
        batch.release()
    return statistics.median(times[2:]), [seq.generated_ids for seq in sequences]


def forward_steps(model, prompts: Sequence[Sequence[int]], steps: int):
    """The same through the model's forward: left-padded rows, a ``DynamicCache``."""
    width = max(len(p) for p in prompts)
    device = model.device
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    keep = last_logits_only(model)
    keep.update(cache_kwarg(model, DynamicCache()))
    times, tokens = [], []
    with torch.inference_mode():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    **keep)
        for _ in range(steps + 1):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token[:, 0].tolist())
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            start = time.perf_counter()
            out = model(input_ids=token, attention_mask=mask, position_ids=positions,
                        use_cache=True, **keep)
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]), [list(row) for row in zip(*tokens)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rows", default="1,4,16", help="batch rows (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per row count")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    return parser


def main(argv: List[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    loaded = LoadedModel.load(args.model_dir, device=args.device)
    rows_list = [int(r) for r in args.rows.split(",")]
    runner = load_runner(loaded.model, RunnerSettings(max_rows=max(rows_list)))
    medians: Dict[tuple, List[float]] = {}
    tokens: Dict[tuple, list] = {}
    for _ in range(args.repetitions):
        for rows in rows_list:
            prompts = [loaded.prompt(PROMPTS[i % len(PROMPTS)]).ids for i in range(rows)]
            for name in ("forward", "runtime"):
                if name == "forward":
                    seconds, ids = forward_steps(loaded.model, prompts, args.steps)
                else:
                    seconds, ids = decode_steps(runner, loaded.tokenizer, prompts, args.steps)
                medians.setdefault((name, rows), []).append(seconds)
                tokens[(name, rows)] = [row[:args.steps] for row in ids]
    print(f"\n{args.model_dir} on {loaded.device} ({str(loaded.dtype).replace('torch.', '')}), "
          f"djl-stream's path: {runner.path}: decode step (median of {args.repetitions} medians "
          f"of {args.steps} steps)\n")
    print("| rows | model's forward, DynamicCache | djl-stream's runtime | same tokens |")
    print("|---|---|---|---|")
    for rows in rows_list:
        base = statistics.median(medians[("forward", rows)]) * 1e3
        ours = statistics.median(medians[("runtime", rows)]) * 1e3
        same = tokens[("forward", rows)] == tokens[("runtime", rows)]
        print(f"| {rows} | {base:.1f} ms | {ours:.1f} ms ({base / ours:.2f}x) | "
              f"{'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
