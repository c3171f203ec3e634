"""The "Accelerate" engine: transformers models on GPU or CPU (placed by accelerate).

An :class:`AccelerateEngine` runs every request of one model on one continuous-batching
:class:`~djl_stream.generation.scheduler.Scheduler`, whose forward passes a
:class:`~djl_stream.runtime.runner.ModelRunner` runs, and yields each decode step's new
text per prompt as soon as the step is done.

Example::

    engine = AccelerateEngine(model, tokenizer)
    for pieces in engine.generate(["The capital of France is"], max_new_tokens=8):
        print(pieces[0], end="", flush=True)
"""

from __future__ import annotations

import dataclasses
from typing import Any, FrozenSet, Iterator, List, Optional, Sequence

import torch

from djl_stream.generation.engine import Engine, EngineCapabilities
from djl_stream.generation.prefill_pacing import DEFAULT_PREFILL_STALL_STEPS
from djl_stream.generation.sampling import TokenChooser
from djl_stream.generation.scheduler import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LENGTH,
    DEFAULT_MAX_QUEUE,
    GenerationStream,
    Scheduler,
)
from djl_stream.generation.grammar import Grammars
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.generation.streaming_utils import register_engine
from djl_stream.runtime.runner import RunnerSettings, load_runner

DEFAULT_MAX_NEW_TOKENS = 50
_CHOOSER_PARAMETERS = (
    "do_sample", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias",
    "manual_seed", "min_new_tokens", "logprobs", "top_logprobs",
)
_PARAMETERS = frozenset(_CHOOSER_PARAMETERS + ("max_new_tokens", "stop", "ignore_eos",
                                               "grammar"))


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
    if "logit_bias" in chooser_kwargs:
        chooser_kwargs["logit_bias"] = dict(chooser_kwargs["logit_bias"])
    seeds = _seeds(chooser_kwargs.pop("manual_seed", None), len(prompt_ids))
    grammar = parameters.get("grammar")
    grammars = (Grammars(tokenizer, eos_ids, logits_width(model))
                if grammar is not None else None)
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
                                 manual_seed=seed, **chooser_kwargs,
                                 grammar=grammars.row(tuple(grammar)) if grammars else None),
            ignore_eos=bool(parameters.get("ignore_eos")),
        )
        for request_id, ids, seed in zip(request_ids, prompt_ids, seeds)
    ]


def logits_width(model) -> Optional[int]:
    """How many columns the model's logits have (its output embeddings' rows)."""
    try:
        return int(model.get_output_embeddings().weight.shape[0])
    except (AttributeError, TypeError):
        return getattr(model.config, "vocab_size", None)


def _seeds(manual_seed: Any, count: int) -> List[Optional[int]]:
    """Each sequence's seed: one seed for all (each prompt's draw then does not depend on
    its batch mates), or one per sequence (OpenAI's ``n`` choices of one seeded request,
    which must differ).

    >>> _seeds(7, 2), _seeds((7, 8), 2), _seeds(None, 1)
    ([7, 7], [7, 8], [None])
    """
    if manual_seed is None or isinstance(manual_seed, int):
        return [manual_seed] * count
    seeds = [int(seed) for seed in manual_seed]
    if len(seeds) != count:
        raise ValueError(f"manual_seed has {len(seeds)} seeds for {count} prompts")
    return seeds


@dataclasses.dataclass(frozen=True)
class AccelerateSettings:
    """The limits of an :class:`AccelerateEngine` (``option.max_rolling_batch_size``,
    ``job_queue_size``, ``option.max_batch_prefill_tokens`` with ``None`` for the device's
    default, ``option.prefill_stall_steps``, ``option.max_input_length`` and
    ``option.max_new_tokens_limit``), whether decode steps run a compiled program once it
    is ready (``option.compile``: see :mod:`djl_stream.runtime.decode_program`), whether
    prompts that begin alike share their keys and values (``option.enable_prefix_caching``:
    see :mod:`djl_stream.runtime.kv_cache`), and the name metrics give the model
    (``model_name``)."""

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch_prefill_tokens: Optional[int] = None
    prefill_stall_steps: Optional[float] = DEFAULT_PREFILL_STALL_STEPS
    max_input_length: int = DEFAULT_MAX_INPUT_LENGTH
    max_new_tokens: int = 2048
    compile: bool = False
    reuse_prefixes: bool = True
    model_name: str = ""


class AccelerateEngine(Engine):
    """transformers models on a GPU or CPU, every request on one continuous-batching
    :class:`~djl_stream.generation.scheduler.Scheduler` over the model's
    :class:`~djl_stream.runtime.runner.ModelRunner`.

    ``generate`` takes the parameters of :func:`build_sequences`; each item is a
    :class:`~djl_stream.generation.step.Step`::

        engine = AccelerateEngine(model, tokenizer)
        step = next(engine.generate(["Hi"], max_new_tokens=4, top_logprobs=2))
        step.generations[0].top_logprobs    # ((13, -0.41...), (28, -2.3...))
        engine.shutdown()
    """

    name = "Accelerate"
    capabilities = EngineCapabilities(scores=True, seeds=True, continuous_batching=True,
                                      token_prompts=True, grammars=True)

    def __init__(self, model, tokenizer, settings: AccelerateSettings = AccelerateSettings(),
                 **scheduler_options: Any) -> None:
        super().__init__(model, tokenizer)
        self.settings = settings
        positions = settings.max_input_length + settings.max_new_tokens
        limit = _position_limit(model)
        self.runner = load_runner(model, RunnerSettings(
            max_rows=settings.max_batch_size,
            max_positions=min(positions, limit) if limit else positions,
            reuse_prefixes=settings.reuse_prefixes))
        if settings.compile and self.runner.path == "attention":
            self.runner.compile_decode_step()
        self.scheduler = Scheduler(
            self.runner, max_batch_size=settings.max_batch_size, max_queue=settings.max_queue,
            max_batch_prefill_tokens=settings.max_batch_prefill_tokens,
            prefill_stall_steps=settings.prefill_stall_steps,
            max_input_length=settings.max_input_length, model_name=settings.model_name,
            **scheduler_options)

    def generate(self, inputs: List[str] | List[List[int]], **parameters: Any) -> GenerationStream:
        """Queue ``inputs`` (texts, or token id lists) as one request; see
        :func:`accelerate_stream_generator` for the parameters."""
        if isinstance(inputs, str):
            inputs = [inputs]
        ids = [list(prompt) if isinstance(prompt, (list, tuple)) else None for prompt in inputs]
        texts = [prompt for prompt in inputs if not isinstance(prompt, (list, tuple))]
        encoded = iter(encode_prompts(self.tokenizer, texts) if texts else [])
        sequences = build_sequences(self.model, self.tokenizer,
                                    [given if given is not None else next(encoded)
                                     for given in ids], **parameters)
        return self.submit(sequences)

    def submit(self, sequences: List[GenerationSequence]) -> GenerationStream:
        """Queue prepared sequences (:func:`build_sequences`) as one request."""
        return self.scheduler.submit(sequences)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.runner.close()


def _position_limit(model) -> Optional[int]:
    """The most positions the model's config says it takes, where it says."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class _OneCallStream(Iterator[List[str]]):
    """A stream that shuts its engine down once it ends or is closed."""

    def __init__(self, engine: AccelerateEngine, stream: GenerationStream) -> None:
        self._engine, self._stream = engine, stream

    def __iter__(self) -> "_OneCallStream":
        return self

    def __next__(self) -> List[str]:
        try:
            return next(self._stream)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._stream.close()
        self._engine.shutdown()

    @property
    def sequences(self) -> List[GenerationSequence]:
        return self._stream.sequences


@register_engine("Accelerate")
def accelerate_stream_generator(
    model, tokenizer, inputs: List[str], **parameters: Any
) -> Iterator[List[str]]:
    """djl-serving's stream generator: stream the continuation of every prompt in
    ``inputs``, one list per decode step, on an engine of its own for this call.

    ``parameters``: ``max_new_tokens`` (default 50), ``do_sample``, ``temperature``,
    ``top_k``, ``top_p``, ``typical_p``, ``repetition_penalty``, ``manual_seed``, ``stop``,
    and, for benchmarks and clients that score tokens: ``min_new_tokens`` (no
    end-of-sequence id before that many new tokens; ``max_new_tokens`` still ends it),
    ``ignore_eos`` (end-of-sequence ids do not end it; they add no text), ``logprobs`` and
    ``top_logprobs`` (0 to 20; the model's own log-probabilities, see
    :func:`~djl_stream.generation.sampling.token_logprobs`).

    A function holds no state between calls, so the prompts of one call are batched
    together and no more: for continuous batching across callers, keep one
    :class:`AccelerateEngine` and call its ``generate`` (the server does).
    """
    engine = AccelerateEngine(model, tokenizer)
    try:
        return _OneCallStream(engine, engine.generate(inputs, **parameters))
    except BaseException:
        engine.shutdown()
        raise
