"""The registry of stream generators, under djl-serving's public name ``StreamingUtils``.

A stream generator is ``fn(model, tokenizer, inputs: List[str], **parameters)`` returning an
iterator that yields one ``List[str]`` per decode iteration: the new text of each prompt,
``""`` for a prompt that produced no text this time or is already done. Built-in engines are
imported only when asked for, so importing this module (and ``model.py``) stays cheap.

Example::

    >>> from djl_stream import StreamingUtils
    >>> @StreamingUtils.register("Echo")
    ... def echo(model, tokenizer, inputs, **parameters):
    ...     yield list(inputs)
    >>> next(StreamingUtils.get_stream_generator("Echo")(None, None, ["hi"]))
    ['hi']
    >>> "Accelerate" in StreamingUtils.engines()
    True
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Iterator, List, Union

StreamGenerator = Callable[..., Iterator[List[str]]]

#: Built-in engines, as "module:function" so that torch and friends load on first use.
_BUILTIN: Dict[str, str] = {
    "Accelerate": "djl_stream.generation.engines.accelerate:accelerate_stream_generator",
    "transformers-neuronx": "djl_stream.generation.engines.neuronx:neuronx_stream_generator",
}


class StreamingUtils:
    """Look up and register stream generators by engine name."""

    _engines: Dict[str, Union[str, StreamGenerator]] = dict(_BUILTIN)

    @classmethod
    def get_stream_generator(cls, engine: str) -> StreamGenerator:
        """The stream generator registered as ``engine``.

        Raises ``ValueError`` naming the registered engines when there is none.
        """
        try:
            target = cls._engines[engine]
        except KeyError:
            known = ", ".join(sorted(cls._engines))
            raise ValueError(
                f"unknown streaming engine {engine!r}; registered engines: {known}"
            ) from None
        if isinstance(target, str):
            module_name, _, attribute = target.partition(":")
            target = getattr(importlib.import_module(module_name), attribute)
        return target

    @classmethod
    def register(cls, engine: str) -> Callable[[StreamGenerator], StreamGenerator]:
        """Decorator registering a stream generator under ``engine`` (replacing any
        earlier one of that name)."""

        def decorator(fn: StreamGenerator) -> StreamGenerator:
            cls._engines[engine] = fn
            return fn

        return decorator

    @classmethod
    def engines(cls) -> List[str]:
        """Names of every registered engine, sorted."""
        return sorted(cls._engines)


register_engine = StreamingUtils.register
