"""``python -m benchmarks.decode_step``: a decode step through the model's forward and
through djl-stream's Llama decode step (``option.decode_step``), side by side.

Each way decodes the same prompts (1, 4 and 16 rows of the benchmark's prompts, left-padded
in one batch, greedy, end-of-sequence ignored) through
:func:`~djl_stream.generation.batch.generate_token`, as the scheduler runs it; the median
time of a step is kept over ``--steps`` steps, the ways taking turns row count by row
count so that a busy machine slows each alike. The greedy tokens of every row are
compared with the forward's. ``--compiled`` adds the one-row step compiled ahead of time
by AOTInductor (``option.decode_step=compiled``: compiling takes a minute or two on a small
CPU the first time, then the program comes from the cache; the load time is reported).
``--device cuda`` runs them on a GPU (in the model directory's dtype, half precision by
default there), where the third way is the step replayed from CUDA graphs (what
``option.decode_step=auto`` does on a GPU), with the time its graphs took to capture.

Example::

    python -m benchmarks.decode_step --model-dir model --rows 1,4,16
    python -m benchmarks.decode_step --model-dir model --device cuda --rows 1,4,16,64
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Sequence

from djl_stream.generation import llama_decode
from djl_stream.generation.batch import CausalLMBatch, generate_token
from djl_stream.generation.sequence import GenerationSequence

from .inprocess import LoadedModel
from .settings import PROMPTS


def decode_steps(model, tokenizer, prompts: Sequence[Sequence[int]], steps: int):
    """Median seconds of a decode step of ``prompts`` in one left-padded batch (the first
    two steps left out), and each row's greedy tokens."""
    sequences = [GenerationSequence(i, list(ids), tokenizer, max_new_tokens=steps + 2,
                                    eos_token_ids=set(), ignore_eos=True)
                 for i, ids in enumerate(prompts)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch = CausalLMBatch.from_sequences(sequences, pad_token_id=pad, device=model.device)
    _, batch = generate_token(model, batch)  # prefill
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _, batch = generate_token(model, batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]), [seq.generated_ids for seq in sequences]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--rows", default="1,4,16", help="batch rows (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per row count")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--compiled", action="store_true",
                        help="also the one-row step compiled by AOTInductor (option.decode_step=compiled)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    return parser


def main(argv: List[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    loaded = LoadedModel.load(args.model_dir, device=args.device, decode_step="eager")
    reason = llama_decode.unsupported_reason(loaded.model)
    if reason:
        raise SystemExit(f"djl-stream's Llama decode step cannot run this model: {reason}")
    ways: Dict[str, tuple] = {"model's forward": (loaded, None)}
    llama_decode.detach(loaded.model)
    ways["djl-stream's step"] = (loaded, llama_decode.LlamaDecodeStep(loaded.model))
    graphs = None
    if loaded.device.type == "cuda":
        from djl_stream.generation.cuda_graphs import CudaGraphSteps

        replayed = llama_decode.LlamaDecodeStep(loaded.model)
        replayed.graphs = graphs = CudaGraphSteps(replayed)
        ways["djl-stream's step, CUDA graphs"] = (loaded, replayed)
    if args.compiled:
        # the one-row program is compiled from the plain weights, before packing: a model
        # of its own, loaded as the server loads it with option.decode_step=compiled
        started = time.perf_counter()
        compiled = LoadedModel.load(args.model_dir, device="cpu", decode_step="compiled")
        step = llama_decode.step_of(compiled.model)
        if step is None or not step.compiled:
            raise SystemExit("compiling the one-row step failed (see the log)")
        print(f"loaded in {time.perf_counter() - started:.0f} s, the one-row program "
              + ("from the cache" if step.one_row.from_cache else "compiled")
              + f" ({step.one_row.path})")
        ways["djl-stream's step, compiled"] = (compiled, step)
    rows_list = [int(r) for r in args.rows.split(",")]
    medians: Dict[tuple, List[float]] = {}
    tokens: Dict[tuple, list] = {}
    for _ in range(args.repetitions):
        for rows in rows_list:
            for name, (way, step) in ways.items():
                llama_decode.detach(way.model)
                if step is not None:
                    llama_decode.install(way.model, step)
                prompts = [way.prompt(PROMPTS[i % len(PROMPTS)]).ids for i in range(rows)]
                seconds, ids = decode_steps(way.model, way.tokenizer, prompts, args.steps)
                medians.setdefault((name, rows), []).append(seconds)
                tokens[(name, rows)] = ids
    print(f"\n{args.model_dir} on {loaded.device} ({str(loaded.dtype).replace('torch.', '')}): "
          f"decode step (median of {args.repetitions} medians of {args.steps} steps), greedy "
          f"tokens against the forward's\n")
    if graphs is not None:
        from djl_stream.generation.cuda_graphs import describe

        print(f"CUDA graphs: {describe(graphs.stats)}\n")
    print("| rows | " + " | ".join(ways) + " |")
    print("|---|" + "---|" * len(ways))
    for rows in rows_list:
        base = statistics.median(medians[("model's forward", rows)])
        cells = []
        for name in ways:
            ms = statistics.median(medians[(name, rows)]) * 1e3
            same = tokens[(name, rows)] == tokens[("model's forward", rows)]
            cells.append(f"{ms:.1f} ms" + ("" if name == "model's forward" else
                                           f" ({base * 1e3 / ms:.2f}x, "
                                           f"{'same tokens' if same else 'tokens differ'})"))
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
