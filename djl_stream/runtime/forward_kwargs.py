"""The keyword arguments a transformers causal LM's ``forward`` takes, across releases.

The djl-serving images carry transformers 4.45 and 4.51, the local server whatever is
newest, and the names of two arguments changed on the way:

* the KV cache is ``past_key_values`` up to 5.23 and ``cache`` from 5.24 (the old name
  still works there, with a deprecation warning, until 5.40); RWKV's recurrent state, its
  cache, has always been ``state``;
* asking for the last position's logits only is ``num_logits_to_keep`` before 4.50 and
  ``logits_to_keep`` after (models that predate it take neither).

Each model class's signature is read once.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                                      num_hidden_layers=1, num_attention_heads=2))
    >>> sorted(cache_kwarg(model, "the cache")) in (["cache"], ["past_key_values"])
    True
    >>> last_logits_only(model) in ({"logits_to_keep": 1}, {"num_logits_to_keep": 1})
    True
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, FrozenSet, Mapping, Optional

#: The cache's argument name, newest first (then RWKV's own).
CACHE_NAMES = ("cache", "past_key_values", "state")
#: The "logits of the last positions only" argument's name, newest first.
LOGITS_TO_KEEP_NAMES = ("logits_to_keep", "num_logits_to_keep")


def _parameters(model) -> FrozenSet[str]:
    """The names ``model.forward`` takes: its class's, read once per class."""
    return _forward_parameters(type(model)) if hasattr(type(model), "forward") else frozenset(
        inspect.signature(model.forward).parameters)


@functools.lru_cache(maxsize=None)
def _forward_parameters(cls) -> FrozenSet[str]:
    return frozenset(inspect.signature(cls.forward).parameters) - {"self"}


def cache_kwarg(model, cache) -> Dict[str, Any]:
    """``{name: cache}`` under the name ``model.forward`` takes its KV cache by
    (``past_key_values`` where it names neither: a model of its own, say)."""
    names = _parameters(model)
    return {next((name for name in CACHE_NAMES if name in names), "past_key_values"): cache}


def cache_in(kwargs: Mapping[str, Any]) -> Optional[Any]:
    """The KV cache among the keyword arguments of a forward call (as a forward
    pre-hook sees them), whichever name it came under; ``None`` when there is none."""
    for name in CACHE_NAMES:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def cache_of(outputs) -> Optional[Any]:
    """The KV cache a forward call returned, whichever name it came under."""
    for name in CACHE_NAMES:
        cache = getattr(outputs, name, None)
        if cache is not None:
            return cache
    return None


def logits_keyword(model) -> Optional[str]:
    """The name under which ``model.forward`` takes the positions to compute logits for
    (``logits_to_keep``, or ``num_logits_to_keep`` before transformers 4.50), or ``None``."""
    names = _parameters(model)
    return next((name for name in LOGITS_TO_KEEP_NAMES if name in names), None)


def last_logits_only(model) -> Dict[str, int]:
    """``{"logits_to_keep": 1}`` where the model's forward accepts it (older
    transformers named it ``num_logits_to_keep``), else nothing."""
    names = _parameters(model)
    return next(({name: 1} for name in LOGITS_TO_KEEP_NAMES if name in names), {})
