"""Bursts of requests run at load on a GPU, so that the kernels a burst of clients launches
are loaded before the server says it is ready.

CUDA loads a kernel's module at the kernel's first launch (``CUDA_MODULE_LOADING=LAZY``:
PyTorch sets it where the environment does not, and it is CUDA's default on Linux since
12.2), on the launching thread, and a pass of the scheduler meets new
kernels whenever its shapes change: a new number of rows in an eager decode step (cuBLAS
picks its kernels by shape), prompts of several lengths read together (left padding puts a
mask in attention), a prompt read beside running rows (a mixed pass), a new row bucket's
CUDA-graph capture. Measured on an H100 (2026-11-28, ``python -m benchmarks.cycle_trace``,
random weights of SmolLM2-135M's shapes): a first burst of 4 clients waited 2.7 s for its
last first token, its mixed pass taking 1,869 ms and its first 3- and 4-row steps 723 and
533 ms, all of it the scheduler thread's own CPU time, against 192, 97 and 34 ms in the
next burst alike; a first 64-client burst's "1 prompt beside 31 rows" pass took 1,128 ms
against 142 the next time. With ``CUDA_MODULE_LOADING=EAGER`` (every module loaded when
CUDA starts) those first passes took what the later ones take, so they were first
launches; but that setting held 5.6 GB of host memory after the load against 1.7 GB.

So the load runs, through the engine's own stream generator, what such bursts do: for each
size in :func:`burst_sizes`, one prompt alone, the rest of the burst read beside its row,
then one late prompt beside them all, which streams :data:`NEW_TOKENS` tokens beside the
others (enough for the bucket's CUDA graph to be captured,
:data:`~djl_stream.generation.cuda_graphs.CAPTURE_AFTER`), with prompts of several
lengths. On a CPU nothing is run: there is no lazy module loading, and the compiled
programs are loaded or compiled at load already.

Example::

    generate = StreamingUtils.get_stream_generator("Accelerate")
    seconds = warm_up_bursts(generate, model, tokenizer, burst_sizes(device, 32))
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, List, Sequence, Tuple

import torch

#: The burst sizes tried, each with one late prompt after it: their rows cover the row
#: buckets of CUDA graphs (a burst of 3 plus its late prompt is a bucket of 4) and the odd
#: row counts between them that eager steps run before a capture.
BURSTS = (1, 3, 7, 15, 31, 63, 127, 255)
#: New tokens per request: a few decode steps beside each row count, so that a graph is
#: captured for each bucket the burst passes through.
NEW_TOKENS = 8
#: New tokens the burst's earlier requests take: more than the late one, so that they
#: still decode when it joins them (a small model's steps can be quicker than the
#: hand-over of Python's lock to the thread that submits the next request).
HELD_TOKENS = 32
#: Prompt lengths, in words, given to a burst's prompts in turn: several lengths read
#: together, as clients' prompts are.
PROMPT_WORDS = (3, 17, 41, 9, 77, 26)


def burst_sizes(device: torch.device, max_batch_size: int) -> Tuple[int, ...]:
    """The burst sizes a load on ``device`` runs: none on a CPU; on a GPU each of
    :data:`BURSTS` whose late prompt still fits in ``max_batch_size`` rows.

    >>> burst_sizes(torch.device("cuda", 0), 32), burst_sizes(torch.device("cpu"), 32)
    ((1, 3, 7, 15, 31), ())
    >>> burst_sizes(torch.device("cuda", 0), 1)
    ()
    """
    if device.type != "cuda":
        return ()
    return tuple(size for size in BURSTS if size + 1 <= max_batch_size)


def warm_up_prompts(count: int, offset: int = 0) -> List[str]:
    """``count`` prompts of :data:`PROMPT_WORDS` lengths in turn, starting at ``offset``.

    >>> [len(p.split()) for p in warm_up_prompts(3, offset=1)]
    [17, 41, 9]
    """
    return [" ".join(["hello"] * PROMPT_WORDS[(offset + i) % len(PROMPT_WORDS)])
            for i in range(count)]


def warm_up_bursts(generate: Callable[..., Iterator[Any]], model: Any, tokenizer: Any,
                   sizes: Sequence[int], new_tokens: int = NEW_TOKENS) -> float:
    """Run a burst of each size in ``sizes`` through ``generate`` (an engine's stream
    generator, on the model's running scheduler) as clients would send it; the seconds it
    took. Every stream is read to its end, so that no row is left in the batch; a failure
    is raised (a model that cannot serve a burst should not be declared ready)."""
    began = time.perf_counter()
    for size in sizes:
        _one_burst(generate, model, tokenizer, size, new_tokens)
    return time.perf_counter() - began


def _one_burst(generate, model, tokenizer, size: int, new_tokens: int) -> None:
    streams: List[Iterator[Any]] = []
    with contextlib.ExitStack() as stack:  # closes them all should a stream fail
        def submit(prompts: List[str], tokens: int) -> None:
            stream = stack.enter_context(contextlib.closing(
                generate(model, tokenizer, prompts, max_new_tokens=tokens, ignore_eos=True)))
            next(stream)  # its first tokens: its prompts are in the running batch
            streams.append(stream)

        submit(warm_up_prompts(1), HELD_TOKENS)  # the burst's first prompt, read alone
        if size > 1:
            submit(warm_up_prompts(size - 1, offset=1), HELD_TOKENS)  # the rest, beside it
        submit(warm_up_prompts(1, offset=size), new_tokens)  # beside them all
        for stream in reversed(streams):  # the late one first, then the others
            for _ in stream:
                pass
