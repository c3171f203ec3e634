"""Row and column surgery on a transformers ``DynamicCache``.

Continuous batching needs three operations transformers does not combine for us: drop the
rows of finished requests, drop the leading columns that have become padding for every
remaining row, and line up two caches of different lengths (left padding) so they can be
concatenated along the batch. Each works in place on the layers' ``keys`` / ``values``
tensors, shaped ``(batch, heads, seq, head_dim)``.

transformers 4.56 moved a ``DynamicCache``'s tensors from two lists (``key_cache``,
``value_cache``) into layer objects (``cache.layers[i].keys``); the djl-serving images
carry 4.45 and 4.51, so both layouts are handled, told apart by the ``layers`` attribute.
"""

from __future__ import annotations

from typing import List, Sequence

import torch


class _ListLayer:
    """Layer ``index`` of a cache that keeps ``key_cache``/``value_cache`` lists
    (transformers < 4.56), with the ``keys``/``values`` of the later layer objects."""

    __slots__ = ("_cache", "_index")

    def __init__(self, cache, index: int) -> None:
        self._cache = cache
        self._index = index

    @property
    def keys(self) -> torch.Tensor:
        return self._cache.key_cache[self._index]

    @keys.setter
    def keys(self, tensor: torch.Tensor) -> None:
        self._cache.key_cache[self._index] = tensor

    @property
    def values(self) -> torch.Tensor:
        return self._cache.value_cache[self._index]

    @values.setter
    def values(self, tensor: torch.Tensor) -> None:
        self._cache.value_cache[self._index] = tensor


def _all_layers(cache) -> List:
    if hasattr(cache, "layers"):
        return list(cache.layers)
    return [_ListLayer(cache, i) for i in range(len(cache.key_cache))]


def layers(cache) -> List:
    """Each layer of ``cache`` written so far, as an object with ``keys`` and ``values``
    (the layer itself from 4.56 on, a view of the two lists before)."""
    return [layer for layer in _all_layers(cache) if getattr(layer, "keys", None) is not None
            and layer.keys.numel() > 0]


def select_rows(cache, indices: torch.Tensor) -> None:
    """Keep only the batch rows in ``indices`` (a 1-D long tensor), in that order."""
    for layer in layers(cache):
        idx = indices.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)


def copy_rows(cache, indices: torch.Tensor):
    """A new ``DynamicCache`` holding a copy of the batch rows in ``indices``; ``cache`` is
    left as it was."""
    from transformers import DynamicCache

    copy = DynamicCache()
    for index, layer in enumerate(layers(cache)):
        idx = indices.to(layer.keys.device)
        copy.update(layer.keys.index_select(0, idx), layer.values.index_select(0, idx), index)
    return copy


def truncate(cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (layers that hold no more are
    left alone)."""
    for layer in layers(cache):
        if layer.keys.shape[2] > length:
            layer.keys = layer.keys[:, :, :length, :]
            layer.values = layer.values[:, :, :length, :]


def trim_left(cache, columns: int) -> None:
    """Drop the first ``columns`` positions of every row (padding no row attends to)."""
    if columns <= 0:
        return
    for layer in layers(cache):
        layer.keys = layer.keys[:, :, columns:, :]
        layer.values = layer.values[:, :, columns:, :]


def pad_left(cache, columns: int) -> None:
    """Prepend ``columns`` zero positions to every row; the attention mask hides them."""
    if columns <= 0:
        return
    for layer in layers(cache):
        layer.keys = _zero_pad(layer.keys, columns)
        layer.values = _zero_pad(layer.values, columns)


def _zero_pad(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    batch, heads, _, dim = tensor.shape
    zeros = tensor.new_zeros((batch, heads, columns, dim))
    return torch.cat([zeros, tensor], dim=2)


def concatenate_rows(caches: Sequence) -> object:
    """Stack caches of equal length along the batch; returns the first, extended in place."""
    first = caches[0]
    if len(caches) == 1:
        return first
    per_cache = [_all_layers(c) for c in caches]
    for layer_index, layer in enumerate(per_cache[0]):
        parts = [c[layer_index] for c in per_cache]
        layer.keys = torch.cat([p.keys for p in parts], dim=0)
        layer.values = torch.cat([p.values for p in parts], dim=0)
    return first


def seq_length(cache) -> int:
    """Number of positions held per row (0 for a cache never written)."""
    written = layers(cache)
    return written[0].keys.shape[2] if written else 0


def num_rows(cache) -> int:
    written = layers(cache)
    return written[0].keys.shape[0] if written else 0

