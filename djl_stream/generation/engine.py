"""An engine: what turns prompts into streamed text for one loaded model.

An :class:`Engine` owns everything that generates for its model (its scheduler, its
runtime, its configuration) and says what it can do in :class:`EngineCapabilities`, so
that a protocol asks ``engine.capabilities.scores`` rather than which engine it is.
:meth:`Engine.generate` is the one way in: the prompts of one request and its
parameters, back one :class:`~djl_stream.generation.step.Step` per decode step.

djl-serving's own way in, a stateless *stream generator* ``fn(model, tokenizer, inputs,
**parameters)`` looked up with ``StreamingUtils.get_stream_generator(name)``, stays as an
adapter (:mod:`djl_stream.generation.streaming_utils`); a stream generator a user
registered becomes an engine through :class:`FunctionEngine`.

Example::

    >>> def echo(model, tokenizer, inputs, **parameters):
    ...     yield list(inputs)
    >>> engine = FunctionEngine("Echo", echo, model=None, tokenizer=None)
    >>> next(iter(engine.generate(["hi"]))), engine.capabilities.scores
    (['hi'], False)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, List


@dataclasses.dataclass(frozen=True)
class EngineCapabilities:
    """What an engine does beyond streaming text.

    ``scores``: each step's :class:`~djl_stream.generation.step.Generation` carries the
    token, its log-probabilities when asked, and why a sequence finished. ``seeds``: it
    takes ``manual_seed`` for reproducible sampling. ``continuous_batching``: requests
    join and leave a running batch between two decode steps. ``token_prompts``: its
    ``generate`` takes prompts as token id lists as well as text. ``grammars``: it takes a
    ``grammar`` parameter and keeps each answer to it
    (:mod:`~djl_stream.generation.grammar`).
    """

    scores: bool = False
    seeds: bool = False
    continuous_batching: bool = False
    token_prompts: bool = False
    grammars: bool = False


class Engine:
    """One model's generation; see the module docstring. Subclasses set ``name`` and
    ``capabilities`` and implement :meth:`generate`."""

    name: str = ""
    capabilities: EngineCapabilities = EngineCapabilities()

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def generate(self, inputs: List[str], **parameters: Any) -> Iterator[List[str]]:
        """Stream the continuation of each prompt in ``inputs``: one list per decode step
        with each prompt's new text. Closing the iterator (a client that left) stops
        the generation."""
        raise NotImplementedError

    def stream_generator(self, model: Any, tokenizer: Any, inputs: List[str],
                         **parameters: Any) -> Iterator[List[str]]:
        """:meth:`generate` in the shape of djl-serving's stream generators (the model and
        tokenizer arguments are this engine's own)."""
        return self.generate(inputs, **parameters)

    def warm_up(self) -> None:
        """Run what the first request would otherwise pay for (nothing by default)."""

    def shutdown(self) -> None:
        """Stop generating; requests in flight end with an error (nothing by default)."""


class FunctionEngine(Engine):
    """A djl-style stream generator function as an engine (no capabilities beyond text)."""

    def __init__(self, name: str, function: Callable[..., Iterator[List[str]]], *,
                 model: Any, tokenizer: Any) -> None:
        super().__init__(model, tokenizer)
        self.name = name
        self._function = function

    def generate(self, inputs: List[str], **parameters: Any) -> Iterator[List[str]]:
        return self._function(self.model, self.tokenizer, inputs, **parameters)
