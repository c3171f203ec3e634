"""The "Accelerate" engine: transformers models on GPU or CPU (placed by accelerate).

The stream generator keeps one KV cache for all prompts (never re-running a prompt per
token), batches prompts of different lengths with left padding, and yields each decode
iteration's new text per prompt as soon as the step is done. Every caller's prompts run
on the model's one :class:`~djl_stream.generation.scheduler.Scheduler` (continuous batching).

Example::

    gen = StreamingUtils.get_stream_generator("Accelerate")
    for pieces in gen(model, tokenizer, ["The capital of France is"], max_new_tokens=8):
        print(pieces[0], end="", flush=True)
"""

from __future__ import annotations

from typing import Any, FrozenSet, List, Optional, Sequence

import torch

from djl_stream.generation.prefill_pacing import DEFAULT_PREFILL_STALL_STEPS
from djl_stream.generation.sampling import TokenChooser
from djl_stream.generation.scheduler import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LENGTH,
    DEFAULT_MAX_QUEUE,
    GenerationStream,
    Scheduler,
    scheduler_for,
)
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.generation.streaming_utils import register_engine

DEFAULT_MAX_NEW_TOKENS = 50
_CHOOSER_PARAMETERS = (
    "do_sample", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "manual_seed", "min_new_tokens", "logprobs", "top_logprobs",
)
_PARAMETERS = frozenset(_CHOOSER_PARAMETERS + ("max_new_tokens", "stop", "ignore_eos"))


def model_input_device(model) -> torch.device:
    """Where input tensors must go: the device of the input embeddings (with an
    accelerate ``device_map`` the model spans several devices)."""
    try:
        return model.get_input_embeddings().weight.device
    except AttributeError:
        return next(model.parameters()).device


def eos_token_ids(model, tokenizer) -> FrozenSet[int]:
    """Every id that ends a sequence: the generation config's (one or several, e.g.
    SmolLM2's ``<|im_end|>``) and the tokenizer's."""
    ids = set()
    config = getattr(model, "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if configured is None:
        configured = getattr(model.config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def pad_token_id(tokenizer, eos_ids: FrozenSet[int]) -> int:
    """Any id works for padding (the mask hides it); prefer the tokenizer's own."""
    if getattr(tokenizer, "pad_token_id", None) is not None:
        return int(tokenizer.pad_token_id)
    return min(eos_ids) if eos_ids else 0


def encode_prompts(tokenizer, prompts: Sequence[str]) -> List[List[int]]:
    """Token ids of each prompt, with the special tokens the model expects (e.g. BOS)."""
    return [list(ids) for ids in tokenizer(list(prompts))["input_ids"]]


def build_sequences(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    *,
    request_ids: Optional[Sequence[Any]] = None,
    **parameters: Any,
) -> List[GenerationSequence]:
    """One :class:`GenerationSequence` per prompt, all with the same ``parameters``.

    ``parameters`` are those of :func:`accelerate_stream_generator`; an unknown one, or a
    value the chooser cannot take (``top_logprobs`` above 20, a negative
    ``min_new_tokens``), raises ``ValueError`` before anything runs.
    """
    unknown = set(parameters) - _PARAMETERS
    if unknown:
        raise ValueError(
            f"unknown generation parameter(s) {sorted(unknown)}; known: {sorted(_PARAMETERS)}"
        )
    device = model_input_device(model)
    eos_ids = eos_token_ids(model, tokenizer)
    stop = parameters.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    chooser_kwargs = {k: v for k, v in parameters.items() if k in _CHOOSER_PARAMETERS and v is not None}
    max_new_tokens = parameters.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    request_ids = list(range(len(prompt_ids))) if request_ids is None else list(request_ids)
    return [
        GenerationSequence(
            request_id,
            ids,
            tokenizer,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids,
            stop=tuple(stop),
            chooser=TokenChooser(device=device, eos_token_ids=eos_ids, prompt_length=len(ids),
                                 **chooser_kwargs),
            ignore_eos=bool(parameters.get("ignore_eos")),
        )
        for request_id, ids in zip(request_ids, prompt_ids)
    ]


def start_scheduler(
    model,
    tokenizer,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_batch_prefill_tokens: Optional[int] = None,
    prefill_stall_steps: Optional[float] = DEFAULT_PREFILL_STALL_STEPS,
    max_input_length: int = DEFAULT_MAX_INPUT_LENGTH,
) -> Scheduler:
    """The model's continuous-batching scheduler, created with these limits on first use
    (``option.max_rolling_batch_size``, ``job_queue_size``,
    ``option.max_batch_prefill_tokens``, ``None`` for the device's default,
    ``option.prefill_stall_steps`` and ``option.max_input_length``)."""
    return scheduler_for(
        model,
        pad_token_id=pad_token_id(tokenizer, eos_token_ids(model, tokenizer)),
        device=model_input_device(model),
        max_batch_size=max_batch_size,
        max_queue=max_queue,
        max_batch_prefill_tokens=max_batch_prefill_tokens,
        prefill_stall_steps=prefill_stall_steps,
        max_input_length=max_input_length,
    )


@register_engine("Accelerate")
def accelerate_stream_generator(
    model, tokenizer, inputs: List[str], **parameters: Any
) -> GenerationStream:
    """Stream the continuation of every prompt in ``inputs``, one list per decode step.

    ``parameters``: ``max_new_tokens`` (default 50), ``do_sample``, ``temperature``,
    ``top_k``, ``top_p``, ``typical_p``, ``repetition_penalty``, ``manual_seed``, ``stop``,
    and, for benchmarks and clients that score tokens: ``min_new_tokens`` (no
    end-of-sequence id before that many new tokens; ``max_new_tokens`` still ends it),
    ``ignore_eos`` (end-of-sequence ids do not end it; they add no text), ``logprobs`` and
    ``top_logprobs`` (0 to 20; the model's own log-probabilities, see
    :func:`~djl_stream.generation.sampling.token_logprobs`).

    Each item is a :class:`~djl_stream.generation.step.Step`: a list with one entry per
    prompt, the text that step released for it (``""`` when it released none: an
    incomplete character, a possible stop string, or already done), whose
    ``generations`` hold the token, its log-probabilities when asked, whether it is a
    special token, and the finish reason::

        gen = StreamingUtils.get_stream_generator("Accelerate")
        step = next(gen(model, tokenizer, ["Hi"], max_new_tokens=4, top_logprobs=2))
        step.generations[0].top_logprobs    # ((13, -0.41...), (28, -2.3...))

    The prompts join the model's running batch (continuous batching), so concurrent
    callers share decode steps. Closing the returned iterator (a client that left) takes
    its rows out of the batch, and frees their cache, at the next step.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    sequences = build_sequences(model, tokenizer, encode_prompts(tokenizer, inputs), **parameters)
    return start_scheduler(model, tokenizer).submit(sequences)
