"""The request every protocol parses into: what to generate, and how to answer.

A protocol (djl's schema, OpenAI's, TGI's) validates its own body and produces one
:class:`GenerationRequest`; everything after that (length checks, the engine, the stream)
is the same for all of them.

    >>> params = SamplingParameters(max_new_tokens=16)
    >>> GenerationRequest(prompts=("Hi",), parameters=params).batched
    False
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: Parameters a stream generator is given only when they differ from their default, so
#: that an engine written before they existed (a custom one) is not handed unknown ones.
OPTIONAL_PARAMETERS = {"manual_seed": None, "min_new_tokens": 0, "ignore_eos": False,
                       "logprobs": False, "top_logprobs": 0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "logit_bias": (), "grammar": None}


@dataclasses.dataclass(frozen=True)
class SamplingParameters:
    """Validated generation parameters.

    As in transformers' ``generate()``, sampling happens only when ``do_sample`` is true:
    ``temperature``, ``top_k``, ``top_p`` and ``typical_p`` are accepted on their own but
    change nothing while decoding stays greedy. ``top_k=0`` switches top-k off;
    ``manual_seed`` makes sampling repeatable. ``min_new_tokens`` keeps the end-of-sequence
    token from being chosen before that many tokens; ``ignore_eos`` lets generation run on
    past it to ``max_new_tokens`` (both for benchmarks of fixed lengths). ``logprobs`` asks
    for each chosen token's log-probability, ``top_logprobs`` for that many most likely
    alternatives too. ``presence_penalty``, ``frequency_penalty`` (OpenAI's, -2 to 2) and
    ``logit_bias`` (``(token id, bias)`` pairs) shape the logits in both modes;
    ``manual_seed`` may also give one seed per prompt (OpenAI's ``n`` seeded choices).
    ``grammar`` keeps the answer to a JSON schema, a regex or a Lark grammar
    (:mod:`djl_stream.generation.grammar`).

    >>> SamplingParameters(max_new_tokens=16, do_sample=True, stop=("\\n\\n",)).as_kwargs()["stop"]
    ['\\n\\n']
    >>> "ignore_eos" in SamplingParameters(max_new_tokens=16).as_kwargs()
    False
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: tuple[str, str] | None = None
    do_sample: bool = False
    manual_seed: int | tuple[int, ...] | None = None
    stop: tuple[str, ...] = ()
    min_new_tokens: int = 0
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a stream generator (``**parameters``).

        ``stop`` becomes a list; the parameters of :data:`OPTIONAL_PARAMETERS` are left out
        while they have their default value.
        """
        kwargs = dataclasses.asdict(self)
        kwargs["stop"] = list(self.stop)
        for name, default in OPTIONAL_PARAMETERS.items():
            if kwargs[name] == default:
                del kwargs[name]
        return kwargs


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One parsed request.

    ``prompts`` has one entry per sequence to generate; for a chat request it is the one
    prompt the chat template rendered, and ``messages`` keeps what the client sent.
    ``batched`` is true when ``inputs`` was a list, so a non-streaming answer is a list too.
    ``stream`` is ``None`` when the client left it to the server's default.
    ``answer`` holds what only the protocol needs to write its answer (OpenAI's ``n`` and
    ``stream_options``, TGI's ``details``, ``return_full_text`` and the original inputs...);
    the service passes it through untouched. ``prompt_ids``, when the client sent token ids
    (OpenAI's completions take them), holds each prompt's ids; ``prompts`` then holds empty
    strings, one per sequence.
    """

    prompts: tuple[str, ...]
    parameters: SamplingParameters
    stream: bool | None = None
    batched: bool = False
    messages: tuple[dict[str, str], ...] | None = None
    answer: Any = None
    prompt_ids: tuple[tuple[int, ...], ...] | None = None


