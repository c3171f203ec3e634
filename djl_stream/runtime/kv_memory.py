"""How much memory a request's KV cache takes, and how many cache positions one request
may hold by default.

Each prompt of a request holds a row of the KV cache, one position per token: its prompt's,
then one per new token, so a request holds the sum of its prompts' lengths plus
``max_new_tokens`` per prompt by its last step. Each position costs, per layer, one key and
one value vector per key/value head.

    >>> from transformers import LlamaConfig
    >>> config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
    ...                      num_key_value_heads=3)   # SmolLM2-135M's shape
    >>> kv_bytes_per_position(config, element_size=4)   # fp32
    46080
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional, Sequence

logger = logging.getLogger(__name__)


def kv_positions(prompt_lengths: Sequence[int], max_new_tokens: int) -> int:
    """KV-cache positions a request of prompts of ``prompt_lengths`` holds by its last step.

    >>> kv_positions([4096, 100], 2048)
    8292
    """
    return sum(prompt_lengths) + len(prompt_lengths) * max_new_tokens


class AttentionShape(NamedTuple):
    """What a transformers config says of a decoder's attention."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(config) -> Optional[AttentionShape]:
    """The attention shape ``config`` gives (key/value heads default to the query heads,
    as before grouped-query attention; the head size to the width over the heads), or
    ``None`` where it does not say the layer count, head count or width.

    >>> from transformers import LlamaConfig
    >>> attention_shape(LlamaConfig(hidden_size=576, num_hidden_layers=30,
    ...                             num_attention_heads=9, num_key_value_heads=3))
    AttentionShape(layers=30, heads=9, kv_heads=3, head_dim=64)
    """
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (layers and heads and hidden):
        return None
    return AttentionShape(layers, heads, getattr(config, "num_key_value_heads", None) or heads,
                          getattr(config, "head_dim", None) or hidden // heads)


def kv_bytes_per_position(config, element_size: int) -> Optional[int]:
    """Bytes one cache position takes across all layers (keys and values), or ``None``
    where the config does not say its attention shape."""
    shape = attention_shape(config)
    if shape is None:
        return None
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * element_size


#: The share of the weights' size one request's KV cache may take by default: one request
#: alone never grows the process to twice its loaded size (the KV cache is written in
#: place, so a request's peak is its positions, with no copy beside them).
KV_SHARE_OF_WEIGHTS = 0.75


def default_max_request_kv_tokens(model, max_input_length: int,
                                  max_new_tokens_limit: int) -> Optional[int]:
    """The most KV-cache positions one request may hold when
    ``option.max_request_kv_tokens`` is not set: as many as fit in three quarters of the
    size of the model's weights (:data:`KV_SHARE_OF_WEIGHTS`), so that one request never
    grows the process to twice its loaded size,
    and at least one prompt of ``max_input_length`` with ``max_new_tokens_limit`` new
    tokens. ``None`` (no bound) for a model that does not say its weights or shape (the
    transformers-neuronx engine: its compiled shapes bound its cache).

    SmolLM2-135M in fp32 (538 MB of weights, 46,080 bytes a position) gets 8,757
    positions: one 4,096-token prompt with 2,048 new tokens fits, two of them do not.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> tiny = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64,
    ...     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    ...     num_key_value_heads=2))
    >>> default_max_request_kv_tokens(tiny, 64, 256)   # 3/4 of 808,192 bytes / 512 a position
    1183
    >>> default_max_request_kv_tokens(tiny, 4096, 2048)   # never below one long request
    6144
    """
    # (imported here: it imports torch, which model.py's import must not pull in)
    from djl_stream.runtime.packed_linear import packed_weight_count

    try:
        parameters = list(model.parameters())
    except (AttributeError, TypeError):
        return None
    if not parameters:
        return None
    element_size = parameters[0].element_size()
    per_position = kv_bytes_per_position(getattr(model, "config", None), element_size)
    if not per_position:
        return None
    # parameters() yields tied embeddings once; an int8 or packed copy of a tied weight
    # is not a weight of the model's; packed weights are not among the parameters
    weight_bytes = sum(parameter.numel() * parameter.element_size() for parameter in parameters
                       if not getattr(parameter, "duplicates_a_weight", False))
    copies = [module for module in model.modules()
              if getattr(module, "duplicates_a_weight", False)]
    weight_bytes += packed_weight_count(model, leaving_out=copies) * element_size
    return max(max_input_length + max_new_tokens_limit,
               int(KV_SHARE_OF_WEIGHTS * weight_bytes) // per_position)
