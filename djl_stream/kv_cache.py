"""Row and column surgery on a transformers ``DynamicCache``.

Continuous batching needs three operations transformers does not combine for us: drop the
rows of finished requests, drop the leading columns that have become padding for every
remaining row, and line up two caches of different lengths (left padding) so they can be
concatenated along the batch. Each works in place on the layers' ``keys`` / ``values``
tensors, shaped ``(batch, heads, seq, head_dim)``.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _layers(cache):
    """Each layer's object holding ``keys`` and ``values`` (transformers >= 4.56)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None
            and layer.keys.numel() > 0]


def select_rows(cache, indices: torch.Tensor) -> None:
    """Keep only the batch rows in ``indices`` (a 1-D long tensor), in that order."""
    for layer in _layers(cache):
        idx = indices.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)


def trim_left(cache, columns: int) -> None:
    """Drop the first ``columns`` positions of every row (padding no row attends to)."""
    if columns <= 0:
        return
    for layer in _layers(cache):
        layer.keys = layer.keys[:, :, columns:, :]
        layer.values = layer.values[:, :, columns:, :]


def pad_left(cache, columns: int) -> None:
    """Prepend ``columns`` zero positions to every row; the attention mask hides them."""
    if columns <= 0:
        return
    for layer in _layers(cache):
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
    for layer_index, layer in enumerate(first.layers):
        parts = [c.layers[layer_index] for c in caches]
        layer.keys = torch.cat([p.keys for p in parts], dim=0)
        layer.values = torch.cat([p.values for p in parts], dim=0)
    return first


def seq_length(cache) -> int:
    """Number of positions held per row (0 for a cache never written)."""
    layers = _layers(cache)
    return layers[0].keys.shape[2] if layers else 0


def num_rows(cache) -> int:
    layers = _layers(cache)
    return layers[0].keys.shape[0] if layers else 0

