"""``python -m benchmarks.quantization``: each ``option.quantize`` method's decode step and how
closely its greedy text follows float32's, in-process, side by side; bfloat16 weights
(``option.dtype=bf16``) too, the other way to read fewer bytes a step.

Every method loads the model directory the way the server does
(:func:`~djl_stream.runtime.loading.load_model_and_tokenizer`) onto a runner of its own,
then:

* **decode step**: the median time of a one-row decode step through
  :func:`~djl_stream.generation.batch.generate_token`, over ``--steps`` steps
  (:func:`benchmarks.decode_step.decode_steps`), the methods taking turns for
  ``--repetitions`` rounds;
* **greedy agreement**: each benchmark prompt decoded greedily for ``--tokens`` tokens;
  how many tokens match float32's before the first difference, and, with float32's tokens
  fed back (teacher forcing), the share of positions where the method's top token is
  float32's: the first says when texts part, the second how often the two disagree.

The table is printed and written into ``BENCHMARKS.md``'s quantization section (which
``make bench`` keeps; ``--output ''`` writes nothing). ``make bench-quantization`` runs it.

Example::

    python -m benchmarks.quantization --model-dir model --methods none,int8,bitsandbytes4
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from djl_stream.generation.batch import CausalLMBatch, generate_token
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.runtime.loading import load_model_and_tokenizer
from djl_stream.runtime.quantization import lacks_int8_dot_products
from djl_stream.runtime.runner import ModelRunner, RunnerSettings, load_runner
from djl_stream.serving.properties import ModelProperties, djl_init_properties

from .decode_step import decode_steps
from .inprocess import LoadedModel
from .machine import describe
from .sections import write_section
from .settings import PROMPTS


#: Methods that are a dtype (``option.dtype``) rather than an ``option.quantize`` value.
DTYPES = ("bf16",)
#: A method's suffix whose decode steps run the compiled program (``option.compile``,
#: ``w8a8+compiled``); the others run the eager forward.
COMPILED = "+compiled"


def _load(model_dir: str, method: str) -> ModelRunner:
    init = djl_init_properties(model_dir)
    compiled = method.endswith(COMPILED)
    method = method[:-len(COMPILED)] if compiled else method
    if method in DTYPES:
        init["dtype"] = method
    elif method != "none":
        init["quantize"] = method
    model = load_model_and_tokenizer(ModelProperties.from_init_properties(init))[0]
    runner = load_runner(model, RunnerSettings(max_rows=2))
    if compiled:
        builder = runner.compile_decode_step()
        if builder is None or builder.result() is None:
            raise SystemExit(f"{method}: no compiled decode step "
                             f"({builder.error if builder else 'not on this device or path'})")
    return runner


def _row_name(method: str, unset: str = "float32", w8a8_serves_int8: bool = False) -> str:
    """
    >>> _row_name("w8a8", "bfloat16", w8a8_serves_int8=True)
    '`w8a8` (`int8` serves for it here), eager decode step'
    """
    compiled = method.endswith(COMPILED)
    method = method[:-len(COMPILED)] if compiled else method
    name = (f"unset ({unset})" if method == "none"
            else f"unset, `option.dtype={method}`" if method in DTYPES else f"`{method}`")
    if method == "w8a8" and w8a8_serves_int8:  # (djl_stream.runtime.quantization says why)
        name += " (`int8` serves for it here)"
    return name + (", compiled decode step" if compiled else ", eager decode step")


def _sequence(ids: Sequence[int], tokenizer, tokens: int) -> GenerationSequence:
    return GenerationSequence(0, list(ids), tokenizer, max_new_tokens=tokens,
                              eos_token_ids=set(), ignore_eos=True)


def greedy_ids(runner: ModelRunner, tokenizer, ids: Sequence[int], tokens: int) -> List[int]:
    seq = _sequence(ids, tokenizer, tokens)
    batch = CausalLMBatch.from_sequences(runner, [seq])
    while batch is not None:
        _, batch = generate_token(runner, batch)
    return seq.generated_ids


def teacher_forced_agreement(model, prompt: Sequence[int], reference: Sequence[int]) -> float:
    """Share of positions where ``model``'s top token, fed ``reference``'s tokens so far,
    is ``reference``'s next token."""
    ids = torch.tensor([list(prompt) + list(reference[:-1])], device=model.device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1:]
    chosen = logits.argmax(-1).tolist()
    return sum(a == b for a, b in zip(chosen, reference)) / len(reference)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantization",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--methods", default="none,bf16,int8,w8a8,bitsandbytes4,bitsandbytes8,"
                                              "none+compiled,int8+compiled,w8a8+compiled",
                        help="option.quantize values, 'none' (float32) and 'bf16' "
                             "(option.dtype=bf16); '+compiled': decode steps through the "
                             "compiled program")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--output", default="BENCHMARKS.md",
                        help="file whose quantization section gets the table ('' for none)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda: each method loads on the GPU, as the server "
                             "loads it there (unset: half precision)")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",")]
    lm = LoadedModel.load(args.model_dir, device=args.device)
    prompts = [list(lm.prompt(p).ids) for p in PROMPTS]
    tokenizer = lm.tokenizer
    del lm
    runners: Dict[str, ModelRunner] = {m: _load(args.model_dir, m) for m in methods}
    reference = [greedy_ids(runners["none"], tokenizer, p, args.tokens) for p in prompts]
    steps: Dict[str, List[float]] = {m: [] for m in methods}
    for _ in range(args.repetitions):
        for method, runner in runners.items():
            steps[method].append(decode_steps(runner, tokenizer, [prompts[0]], args.steps)[0])
    base = statistics.median(steps["none"])
    unset = str(next(runners["none"].model.parameters()).dtype).replace("torch.", "")
    lines = [f"{torch.get_num_threads()} threads; {args.tokens} greedy tokens on each of "
             f"{len(prompts)} prompts; decode step: median of {args.steps} one-row steps, "
             f"median of {args.repetitions} rounds taken in turns", "",
             f"| weights | decode step | × {unset}'s speed | tokens before the first "
             f"difference | top token = {unset}'s (teacher-forced) |",
             "|---|---|---|---|---|"]
    for method, runner in runners.items():
        step = statistics.median(steps[method])
        firsts, shares = [], []
        for prompt, ref in zip(prompts, reference):
            ids = greedy_ids(runner, tokenizer, prompt, args.tokens)
            firsts.append(next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref)))
            shares.append(teacher_forced_agreement(runner.model, prompt, ref))
        lines.append(f"| {_row_name(method, unset, args.device == 'cuda' or lacks_int8_dot_products())} | {step * 1e3:.1f} ms | {base / step:.2f}x | "
                     f"{', '.join(map(str, firsts))} of {args.tokens} | "
                     f"{statistics.mean(shares) * 100:.1f} % |")
    print("\n".join(lines))
    if args.output:
        machine = describe()
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        command = " ".join(["python -m benchmarks.quantization", *(argv or [])])
        write_section(Path(args.output), "quantization", "\n".join([
            "## Quantized weights (`option.quantize`) and bfloat16 against float32", "",
            f"Measured on {now} with `{command}` (what `make bench-quantization` runs), on "
            f"{machine.get('cpu')} (GPU: {machine.get('gpu')}), in one process, each method "
            "loaded the way the server loads it. The greedy-text columns compare each "
            "method's tokens with float32's: how many agree before the first difference, "
            "and with float32's tokens fed back (teacher forcing) how often the top token "
            "is float32's. The teacher-forced column runs the model's forward (a prefill), "
            "so it is the same with and without the compiled decode step, which runs "
            "decode steps only; the first column decodes through it. "
            "bitsandbytes is made for CUDA: on a CPU it runs its CPU "
            "kernels." + ("" if args.device == "cpu" else
                          f" Run on the GPU ({args.device}): unset means {unset} there."),
            "", *lines, ""]))
        print(f"wrote the quantization section of {args.output}")


if __name__ == "__main__":
    main()
