"""Attention over djl-stream's KV cache, plugged into transformers' ``AttentionInterface``.

transformers' models call their attention through a registry keyed by
``config._attn_implementation``: the model's own code computes the projections, the
rotary embeddings, the norms and everything else, then hands the attention function the
new tokens' queries, keys and values, with keyword arguments of its own (``scaling``,
``sliding_window``, ``softcap``, ``s_aux``). The function registered here
(:func:`attend`) reads the :class:`AttentionLayout` of the pass its thread runs
(:func:`forward_with_layout`; not a keyword argument of the forward, which some models'
layers do not hand down), writes the new keys and values into the rows of the
:class:`~djl_stream.runtime.kv_cache.KVCache` at their positions, and attends each token to
its own row. One forward pass then carries any mix of sequences: the running rows' decode
tokens and the prompt chunks of new ones, flattened into one sequence of ``T`` tokens
(batch size 1), as the transformers backends of text-generation-inference and vLLM feed
them.

The layout has two parts:

* a **block**: tokens ``[0, n)`` are one token each of the consecutive cache rows
  ``[block_start, block_start + n)``, a running batch's decode step. Their attention is
  one batched call over a view of those rows, masked per row to its own positions (and
  window);
* **chunks**: each a run of tokens of one row (a prompt, or part of one), attended with a
  causal mask over that row's columns.

Grouped-query heads are read in place: the query heads that share a key/value head are
laid side by side as extra query positions of that head, so no key or value is copied.

Where the model is called without a layout (``model.generate()`` on the same model, say),
the function hands the call to the implementation the model had before, so the model
object keeps working for other uses.

Example::

    name = use_attention(model)         # the model's attention now reads AttentionLayout
    forward_with_layout(model, layout, input_ids=..., position_ids=...,
                        attention_mask=NO_MASK, use_cache=False)
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

#: Registered name prefix: ``djl_stream:<the implementation it hands other calls to>``.
NAME_PREFIX = "djl_stream:"


@dataclasses.dataclass
class AttentionLayout:
    """Where each token of one forward pass writes and reads the KV cache.

    ``rows`` and ``positions`` (``(T,)``, on the model's device) say where token ``t``'s
    keys and values go: column ``positions[t]`` of cache row ``rows[t]``. Tokens
    ``[0, block_rows)`` are the block (see the module docstring): row ``block_start + t``
    each, attending to ``block_span`` columns at most, through ``block_masks`` (one
    ``(block_rows, 1, 1, block_span)`` boolean mask per sliding window the model uses,
    ``None`` for full attention). ``chunks`` are ``(first token, end token, row, first
    position)``. ``keys`` and ``values`` are the cache's buffers, one per layer, and
    ``layer_windows`` each layer's sliding window (``None``: full attention), as the model
    applies it: the window its code passes its attention, or the one its config sets for
    the masks of a model that applies it there.
    """

    rows: torch.Tensor
    positions: torch.Tensor
    keys: List[torch.Tensor]
    values: List[torch.Tensor]
    layer_windows: Sequence[Optional[int]] = ()
    block_start: int = 0
    block_rows: int = 0
    block_masks: Dict[Optional[int], torch.Tensor] = dataclasses.field(default_factory=dict)
    chunks: Sequence[Tuple[int, int, int, int]] = ()
    #: asked at each layer: ``True`` stops the pass there (:class:`PassAbandoned`)
    abandon: Optional[Callable[[], bool]] = None
    #: layers that read this layout in its pass: fewer than the model's layers means some
    #: layer's attention did not run through the registered function
    attended: int = 0
    _derived: Dict[tuple, torch.Tensor] = dataclasses.field(default_factory=dict)

    def slots(self, heads: int, columns: int) -> torch.Tensor:
        """Where each token's key (or value) vectors go in a layer's buffer seen as one row
        of vectors per (row, head, column): ``(tokens × heads,)``, token-major. One
        ``index_copy_`` over that view writes every token's heads; computed once per
        buffer geometry and pass."""
        key = ("slots", heads, columns)
        slots = self._derived.get(key)
        if slots is None:
            head = torch.arange(heads, device=self.rows.device).view(1, -1)
            slots = ((self.rows.view(-1, 1) * heads + head) * columns
                     + self.positions.view(-1, 1)).reshape(-1)
            self._derived[key] = slots
        return slots

    def chunk_mask(self, index: int, window: Optional[int], groups: int) -> torch.Tensor:
        """The causal mask of chunk ``index`` for its ``groups`` query heads per key/value
        head laid side by side: ``(1, 1, groups × tokens, columns)``."""
        key = (index, window, groups)
        mask = self._derived.get(key)
        if mask is None:
            first, end, _, start = self.chunks[index]
            queries = torch.arange(start, start + end - first,
                                   device=self.positions.device).view(-1, 1)
            mask = causal_mask(queries, start + end - first, window)
            mask = mask.repeat(groups, 1).unsqueeze(0).unsqueeze(0)
            self._derived[key] = mask
        return mask


def causal_mask(positions: torch.Tensor, columns: int, window: Optional[int]) -> torch.Tensor:
    """``(len(positions), columns)``: whether a query at each position sees each column,
    itself included, and within ``window`` positions where a window is given (transformers'
    rule: a key ``k`` is seen from ``q`` when ``q - window < k <= q``).

    >>> causal_mask(torch.tensor([[2], [3]]), 4, window=2).int().tolist()
    [[0, 1, 1, 0], [0, 0, 1, 1]]
    """
    columns = torch.arange(columns, device=positions.device).view(1, -1)
    seen = columns <= positions
    if window:
        seen = seen & (columns > positions - window)
    return seen


def block_mask(positions: torch.Tensor, span: int, window: Optional[int]) -> torch.Tensor:
    """The block's mask for one window: ``(rows, 1, 1, span)``, row ``i`` seeing its own
    columns up to ``positions[i]``."""
    return causal_mask(positions.view(-1, 1), span, window).unsqueeze(1).unsqueeze(1)


def _scaled_attention(query, key, value, mask, scale, softcap, sinks=None):
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    # Logit soft-capping (Gemma 2) is applied to the scores before the mask and softmax,
    # and a sink (gpt-oss) is one more logit per head in the softmax's denominator with no
    # value behind it, neither of which SDPA does: the same arithmetic written out.
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    exact = torch.promote_types(scores.dtype, torch.float32)  # (half precision sums in float)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=exact)
    else:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=exact)[..., :-1]
    return torch.matmul(weights.to(value.dtype), value)


class PassAbandoned(Exception):
    """A forward pass stopped between two layers because nobody wants its result any more
    (every request it reads for left): what it wrote past a cache's end is never read."""


def attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           layout: AttentionLayout, *, scaling: Optional[float] = None,
           sliding_window: Optional[int] = None, softcap: Optional[float] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Write ``key``/``value`` (``(1, kv_heads, T, dim)``) into the cache at the layout's
    places and attend ``query`` (``(1, heads, T, dim)``) to each token's row; returns
    ``(1, T, heads, value_dim)``, the shape transformers' attention functions return.
    ``sinks`` (``(heads,)``, the ``s_aux`` of gpt-oss-style models) are attention sinks:
    one logit per head that takes part in the softmax and adds no value."""
    if layout.abandon is not None and layout.abandon():
        raise PassAbandoned("every request of this pass was cancelled")
    layer = module.layer_idx
    layout.attended += 1
    keys, values = layout.keys[layer], layout.values[layer]
    if layout.layer_windows:
        sliding_window = layout.layer_windows[layer]
    _, heads, tokens, dim = query.shape
    kv_heads, key_dim, value_dim = key.shape[1], key.shape[3], value.shape[3]
    groups = heads // kv_heads
    head_sinks = None if sinks is None else sinks.reshape(kv_heads, groups, 1)
    slots = layout.slots(kv_heads, keys.shape[2])
    keys.view(-1, key_dim).index_copy_(0, slots, key[0].transpose(0, 1)
                                       .reshape(-1, key_dim).to(keys.dtype))
    values.view(-1, value_dim).index_copy_(0, slots, value[0].transpose(0, 1)
                                           .reshape(-1, value_dim).to(values.dtype))
    out = query.new_empty(tokens, heads, value_dim)
    n = layout.block_rows
    if n:
        mask = layout.block_masks[sliding_window]
        span = mask.shape[-1]
        rows = slice(layout.block_start, layout.block_start + n)
        queries = query[0, :, :n].transpose(0, 1).reshape(n, kv_heads, groups, dim)
        attended = _scaled_attention(queries, keys[rows, :, :span], values[rows, :, :span],
                                     mask, scaling, softcap, head_sinks)
        out[:n] = attended.reshape(n, heads, value_dim)
    for index, (first, end, row, start) in enumerate(layout.chunks):
        count = end - first
        span = start + count
        queries = query[0, :, first:end].reshape(1, kv_heads, groups * count, dim)
        attended = _scaled_attention(queries, keys[row:row + 1, :, :span],
                                     values[row:row + 1, :, :span],
                                     layout.chunk_mask(index, sliding_window, groups),
                                     scaling, softcap,
                                     None if sinks is None else
                                     head_sinks.repeat_interleave(count, dim=1).unsqueeze(0))
        out[first:end] = attended.view(heads, count, value_dim).transpose(0, 1)
    return out.unsqueeze(0)


#: The layout of the forward pass this thread runs (:func:`forward_with_layout`).
_THIS_THREAD = threading.local()


def forward_with_layout(model: torch.nn.Module, layout: "AttentionLayout", **kwargs):
    """``model(**kwargs)`` with ``layout`` read by its attention: held by this thread for
    the call, not passed as an argument, since some models' decoder layers (StableLM's)
    call their attention with arguments of their own only. Other threads' calls of the
    same model (``generate()``, say) see no layout."""
    previous = getattr(_THIS_THREAD, "layout", None)
    _THIS_THREAD.layout = layout
    try:
        return model(**kwargs)
    finally:
        _THIS_THREAD.layout = previous


def _attention_handing_off(fallback: Callable) -> Callable:
    """The function registered for one fallback: :func:`attend` within a thread's
    :func:`forward_with_layout`, ``fallback`` (the model's implementation before)
    otherwise."""

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                  scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                  softcap: Optional[float] = None, **kwargs):
        layout = getattr(_THIS_THREAD, "layout", None)
        if layout is None:
            if sliding_window is not None:
                kwargs["sliding_window"] = sliding_window
            if softcap is not None:
                kwargs["softcap"] = softcap
            return fallback(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=scaling, **kwargs)
        for name in ("sinks", "position_bias"):
            if kwargs.get(name) is not None:
                raise NotImplementedError(f"attention with {name} is not supported")
        return attend(module, query, key, value, layout, scaling=scaling,
                      sliding_window=sliding_window, softcap=softcap,
                      sinks=kwargs.get("s_aux")), None

    return attention


def _fallback_for(model, implementation: str) -> Callable:
    """The function ``implementation`` names for ``model``'s attention: the registry's,
    or for ``eager`` the model's own (each modeling file defines one)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation != "eager" and implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    own = getattr(sys.modules.get(type(model).__module__), "eager_attention_forward", None)
    return own or ALL_ATTENTION_FUNCTIONS["sdpa"]


def interface_available() -> Optional[str]:
    """``None`` where this transformers has the attention registry the runtime plugs into,
    else why not."""
    try:
        from transformers import AttentionInterface  # noqa: F401
    except ImportError:
        import transformers

        return (f"transformers {transformers.__version__} has no AttentionInterface "
                "(4.51 or newer has)")
    return None


def use_attention(model) -> str:
    """Have ``model``'s attention read :class:`AttentionLayout`\\ s: register the function
    for the model's present implementation and switch the model to it. Returns the name
    (``djl_stream:sdpa``, say). Calls without a layout behave as before."""
    from transformers import AttentionInterface

    present = model.config._attn_implementation or "eager"
    if present.startswith(NAME_PREFIX):
        return present
    name = NAME_PREFIX + present
    AttentionInterface.register(name, _attention_handing_off(_fallback_for(model, present)))
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # older releases build masks per model, by their own rules
        pass
    else:
        if present in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[present])
    model.config._attn_implementation = name
    return name


def restore_attention(model) -> None:
    """Undo :func:`use_attention` (a model that does not take the runtime's path)."""
    present = model.config._attn_implementation or ""
    if present.startswith(NAME_PREFIX):
        model.config._attn_implementation = present[len(NAME_PREFIX):]
