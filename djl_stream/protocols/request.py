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

@dataclasses.dataclass(frozen=True)
class SamplingParameters:
    """Validated generation parameters.

    As in transformers' ``generate()``, sampling happens only when ``do_sample`` is true:
    ``temperature``, ``top_k``, ``top_p`` and ``typical_p`` are accepted on their own but
    change nothing while decoding stays greedy. ``top_k=0`` switches top-k off;
    ``manual_seed`` makes sampling repeatable.

    >>> SamplingParameters(max_new_tokens=16, do_sample=True, stop=("\\n\\n",)).as_kwargs()["stop"]
    ['\\n\\n']
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = False
    manual_seed: int | None = None
    stop: tuple[str, ...] = ()

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for a stream generator (``**parameters``).

        ``stop`` becomes a list; ``manual_seed`` is left out when unset.
        """
        kwargs = dataclasses.asdict(self)
        kwargs["stop"] = list(self.stop)
        if self.manual_seed is None:
            del kwargs["manual_seed"]
        return kwargs


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One parsed request.

    ``prompts`` has one entry per sequence to generate; for a chat request it is the one
    prompt the chat template rendered, and ``messages`` keeps what the client sent.
    ``batched`` is true when ``inputs`` was a list, so a non-streaming answer is a list too.
    ``stream`` is ``None`` when the client left it to the server's default.
    """

    prompts: tuple[str, ...]
    parameters: SamplingParameters
    stream: bool | None = None
    batched: bool = False
    messages: tuple[dict[str, str], ...] | None = None


