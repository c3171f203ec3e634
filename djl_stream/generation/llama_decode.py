"""A decode step of Llama-architecture models written for this project's KV cache, run in
place of the model's forward (and, for one row, optionally compiled ahead of time).

transformers' forward is written for every use of a model (training, any cache, any
mask); a decode step of one column through it is several hundred operators dispatched
from Python, plus a causal mask built each step and a cache update per layer through the
cache's generic interface. :class:`LlamaDecodeStep` does only what a decode step over a
:class:`~djl_stream.generation.kv_cache.PreallocatedCache` needs, with the model's own
modules and weights: per layer, the RMSNorms, the projections, the model's own rotary
embedding module, one in-place write of the new column into the cache buffers (every
row's new column is the same buffer column: rows are left-padded to one length), attention
over the columns in use with the batch's padding mask, the gated MLP. Measured on the 2-core
CPU this project is measured on, SmolLM2-135M prepacked (``python -m benchmarks.decode_step
--compiled``): a step of one row took 34.4 ms instead of 38.2, of four 32.5 instead of
36.7, of sixteen 50.2 instead of 53.9, the same greedy tokens.

A prompt alone is prefilled by the model's forward. A prompt chunk read while a batch
decodes can share the step's forward pass (:meth:`LlamaDecodeStep.mixed_logits`, a mixed
pass): the projections and MLPs run once over the running rows' new column and the
chunk's columns together (the weights are read once), attention runs per batch over its
own cache, the chunk's with a causal mask. On a CPU a pass of SmolLM2 costs about
35 ms of reading weights whatever its width, which the chunk no longer pays.

It knows one architecture, ``LlamaForCausalLM`` (Llama 2 and 3, SmolLM2, TinyLlama and
others) without biases, on a CPU; :func:`unsupported_reason` says why another model keeps
its forward. On one CUDA GPU it runs too, and is replayed from CUDA graphs
(:mod:`~djl_stream.generation.cuda_graphs`, ``option.decode_step`` ``auto``).

On a CPU, ``option.decode_step`` ``auto`` (the default) or ``compiled`` adds a program
for the decode step of one row, compiled ahead of time by AOTInductor and kept on disk
(:mod:`~djl_stream.generation.compiled_decode`): one-row steps run it, and batches of
several rows and mixed passes run this eager step; with ``option.compiled_weights=shared``
(the default) a second program runs the steps of 7 to 16 rows, padded to 16. On a CPU whose GEMM reads
a large weight once per three rows below 16 (MKL), the eager step's products of 10 to 15
rows are padded to 16 (:mod:`~djl_stream.generation.row_padding`, tried at load).

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                                      num_hidden_layers=1, num_attention_heads=2))
    >>> unsupported_reason(model) is None
    True
    >>> step = LlamaDecodeStep(model)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import weakref
from typing import List, Optional

import torch
import torch.nn.functional as F

from djl_stream.generation.cuda_graphs import (CAPTURE_AFTER, ROW_BUCKETS, CudaGraphSteps,
                                               cuda_graphs_unavailable)
from djl_stream.generation.kv_cache import PreallocatedCache
from djl_stream.generation.row_padding import (PADDED_ROWS, padded_layer, padding_trial,
                                               with_zero_rows)

logger = logging.getLogger(__name__)

#: A batch of at least this fraction of a batch program's rows runs the program, padded up
#: to them (7 to 16 rows of 16); fewer rows run the eager step, whose cost falls with its
#: rows while the program's does not. Where the two cross depends on the CPU's GEMM: on
#: this project's 2-core Xeon (SmolLM2, float32, 32-step runs, the two alternated) the
#: eager step took 48.4-49.8 ms at 6 rows, 55.1-56.5 at 7 and 56.7-58.2 at 8 (MKL's
#: products jump from 6 rows to 7), the 16-row program 51.8-54.2 ms whatever the rows.
#: Until 2026-11-26 the program took more than half its rows (9 to 16); its padding rows
#: then made their KV-cache pages resident (see :func:`_decode_logits`), which they no
#: longer do.
BATCH_PROGRAM_FROM = 7 / 16
#: The fewest rows a batch program over ``option.quantize=w8a8``'s int8 layers runs: its
#: products cost a quarter of float32's bytes, so what the program removes (everything
#: between them) is most of a few-row step, and it beats the eager step from 2 rows. On
#: the Xeon (SmolLM2 in w8a8, 24-step runs, two rounds, the two in turns) the eager step
#: took 25.9-27.5 ms at 2 rows, 29.8 at 4, 33.9-34.6 at 6 and 32.5-34.8 at 8, the 16-row
#: program 19.4-22.4 ms at each of them.
INT8_BATCH_PROGRAM_FROM_ROWS = 2


def first_rows_of(program_rows: int, int8: bool = False) -> int:
    """The fewest rows a batch program of ``program_rows`` rows runs: over float32
    weights :data:`BATCH_PROGRAM_FROM` of them, over ``w8a8``'s int8 layers (``int8``)
    :data:`INT8_BATCH_PROGRAM_FROM_ROWS`.

    >>> first_rows_of(16), first_rows_of(4), first_rows_of(16, int8=True)
    (7, 2, 2)
    """
    if int8:
        return min(program_rows, INT8_BATCH_PROGRAM_FROM_ROWS)
    return max(1, math.ceil(program_rows * BATCH_PROGRAM_FROM))


#: The attribute under which :func:`attach` keeps a model's step.
_ATTRIBUTE = "_djl_stream_decode_step"
#: How far the step's logits may be from the model's forward on the probes of
#: :func:`attach`, relative to the largest logit, by the model's dtype (another summation
#: order: ~1e-6 seen in float32; in bfloat16 every layer's output is rounded to 8 bits of
#: mantissa, and 30 layers of it part by about 1e-2).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}


# -- which models ----------------------------------------------------------------------

def unsupported_reason(model) -> Optional[str]:
    """Why :class:`LlamaDecodeStep` cannot run ``model``'s decode steps, or ``None`` if it can.

    >>> unsupported_reason(torch.nn.Linear(2, 2))
    'not a Llama-architecture causal LM (Linear)'
    """
    from djl_stream.generation.int8_linear import Int8Linear
    from djl_stream.generation.int8_weights import Int8WeightOnlyLinear
    from djl_stream.generation.packed_linear import PackedLinear

    config = getattr(model, "config", None)
    if type(model).__name__ != "LlamaForCausalLM" or getattr(config, "model_type", None) != "llama":
        return f"not a Llama-architecture causal LM ({type(model).__name__})"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "the model has attention or MLP biases"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}, not silu"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if getattr(getattr(config, "quantization_config", None), "quant_method", None):
        return "quantized weights"
    linears = [m for layer in model.model.layers
               for m in _projections_of(layer).values()] + [model.lm_head]
    odd = [type(m).__name__ for m in linears
           if type(m) not in (torch.nn.Linear, PackedLinear, Int8Linear, Int8WeightOnlyLinear)]
    if odd:
        return f"linear layers of type {odd[0]}"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return "spread over several devices (device_map): the step reads every weight in place"
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        return f"on {device.type}, not a CPU or a CUDA GPU"
    return None


# -- the layers, shared by the eager step and the one-row program --------------------

@dataclasses.dataclass(frozen=True)
class Geometry:
    """What the step's arithmetic needs of a model's config: plain numbers, so that a
    compiled graph holds them as constants."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float

    @classmethod
    def of(cls, config) -> "Geometry":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=head_dim, eps=config.rms_norm_eps, scaling=head_dim ** -0.5)

    @property
    def grouped(self) -> bool:
        return self.kv_heads != self.heads


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as LlamaRMSNorm: in float32, then back to the weight's dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(weight.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _mlp(layer: dict, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """``hidden`` after ``layer``'s gated MLP (with its norm and residual)."""
    x = _norm(hidden, layer["mlp_norm"], eps)
    if "gate_up" in layer:  # fused (fuse_int8_projections): one product, then halves
        gate, up = layer["gate_up"](x).chunk(2, dim=-1)
    else:
        gate, up = layer["gate"](x), layer["up"](x)
    return hidden + layer["down"](F.silu(gate) * up)


def _qkv(layer: dict, x: torch.Tensor, g: "Geometry") -> tuple:
    """The query, key and value projections of ``x`` (``(tokens, hidden)``), each
    ``(tokens, its heads × head_dim)``: one fused product where
    :func:`fuse_int8_projections` fused them, else three."""
    if "qkv" in layer:
        kv = g.kv_heads * g.head_dim
        return layer["qkv"](x).split((g.heads * g.head_dim, kv, kv), dim=-1)
    return layer["q"](x), layer["k"](x), layer["v"](x)


def _decode_logits(geometry: Geometry, layers: List[dict], final_norm: torch.Tensor, lm_head,
                   hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor, keys: List[torch.Tensor], values: List[torch.Tensor],
                   column: torch.Tensor, start: int,
                   real: Optional[torch.Tensor] = None,
                   padding_to_last_column: bool = False) -> torch.Tensor:
    """Logits ``(rows, vocab)`` of a decode step from the embedded tokens ``hidden``
    ``(rows, hidden)``, their rotary ``cos``/``sin`` ``(rows, 1, 1, head_dim)`` and the
    additive ``mask`` ``(rows, 1, 1, columns)``. ``keys[i]``/``values[i]`` are layer
    ``i``'s cache buffers ``(row capacity, kv heads, column capacity, head_dim)``; the
    step writes buffer column ``column`` (a 1-element index tensor) of the first ``rows``
    rows and attends over the ``columns`` columns from ``start``.

    The buffers themselves are a graph's inputs, not views of them: a mutated view of an
    input would be copied back whole after every step.

    ``real`` (``(rows, 1, 1, 1)`` booleans, for a CUDA graph's rows padded up to a bucket:
    :mod:`~djl_stream.generation.cuda_graphs`) marks the rows whose column is written; the
    others write back what their slot holds there (a free slot, or one lent to a prompt
    being prefilled, is left as it was). With ``padding_to_last_column`` (the CPU's batch
    program) they do so at their buffers' last column rather than the step's: on a CPU the
    buffers are mapped lazily (:func:`~djl_stream.generation.kv_cache.zeroed_buffer`) and a
    page written, even with what it held, becomes resident; at the step's column a padding
    row's slot cost what a real row's does (a page per head, layer, keys and values every
    16 float32 columns of SmolLM2's), at the last column one page each, once."""
    rows, columns = hidden.shape[0], mask.shape[3]
    g = geometry
    # (enable_gqa only where heads are grouped: PyTorch < 2.5 has no such argument, and a
    # model without grouped heads runs there too)
    gqa = {"enable_gqa": True} if g.grouped else {}
    for layer, layer_keys, layer_values in zip(layers, keys, values):
        x = _norm(hidden, layer["attention_norm"], g.eps)
        q, k, v = _qkv(layer, x, g)
        q = q.view(rows, g.heads, 1, g.head_dim)
        k = k.view(rows, g.kv_heads, 1, g.head_dim)
        v = v.view(rows, g.kv_heads, 1, g.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if real is not None and padding_to_last_column:
            # (indexing the buffers themselves: a scatter into a view of them had the
            # compiled program copy them whole, every step)
            row_index = torch.arange(rows, device=column.device)
            targets = torch.where(real.view(rows), column, layer_keys.shape[2] - 1)
            k = torch.where(real, k, layer_keys[row_index, :, targets].unsqueeze(2))
            v = torch.where(real, v, layer_values[row_index, :, targets].unsqueeze(2))
            layer_keys[row_index, :, targets] = k.squeeze(2)
            layer_values[row_index, :, targets] = v.squeeze(2)
        else:
            if real is not None:
                k = torch.where(real, k, layer_keys[:rows].index_select(2, column))
                v = torch.where(real, v, layer_values[:rows].index_select(2, column))
            layer_keys[:rows].index_copy_(2, column, k)
            layer_values[:rows].index_copy_(2, column, v)
        attended = F.scaled_dot_product_attention(
            q, layer_keys[:rows].narrow(2, start, columns),
            layer_values[:rows].narrow(2, start, columns), attn_mask=mask, scale=g.scaling, **gqa)
        hidden = hidden + layer["o"](attended.reshape(rows, g.heads * g.head_dim))
        hidden = _mlp(layer, hidden, g.eps)
    return lm_head(_norm(hidden, final_norm, g.eps))


_PROJECTIONS = (("q", "self_attn", "q_proj"), ("k", "self_attn", "k_proj"),
                ("v", "self_attn", "v_proj"), ("o", "self_attn", "o_proj"),
                ("gate", "mlp", "gate_proj"), ("up", "mlp", "up_proj"),
                ("down", "mlp", "down_proj"))
#: Projections of one input that :func:`fuse_int8_projections` multiplies as one product:
#: the fused product's name, and the projections it holds, in its output's order.
_FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}
_PROJECTION_NAMES = frozenset([name for name, _, _ in _PROJECTIONS] + list(_FUSED))
#: Each decoder layer's fused products, by name (the layers themselves are transformers'
#: modules, left as they are: the model's forward still calls its own projections).
_FUSED_OF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _projections_of(layer) -> dict:
    """A decoder layer's projection modules by the names :func:`_decode_logits` reads:
    a fused product (:func:`fuse_int8_projections`) in place of the projections it holds."""
    projections = {name: getattr(getattr(layer, part), attribute)
                   for name, part, attribute in _PROJECTIONS}
    for name, product in _FUSED_OF.get(layer, {}).items():
        for part in _FUSED[name]:
            del projections[part]
        projections[name] = product
    return projections


def fuse_int8_projections(model) -> int:
    """Multiply each decoder layer's query, key and value projections as one product,
    and its gate and up projections as another, where they are ``w8a8``'s
    :class:`~djl_stream.generation.int8_linear.Int8Linear` layers
    (:func:`~djl_stream.generation.int8_linear.fuse`: the same arithmetic, fewer calls;
    the layers then read their rows of the fused weights, no memory added). The decode
    step, its mixed passes and the compiled programs read the fused products; the
    model's forward (a prompt's prefill) its own layers. Returns how many fused products
    there are (0 for a model the step does not run: nothing changes).

    Only int8: fusing float32 projections was measured to save nothing (docs/PERFORMANCE.md,
    "Targets missed, and why"), and a packed or padded layer has a layout of its own."""
    from djl_stream.generation.int8_linear import fuse

    if unsupported_reason(model):
        return 0
    count = 0
    for layer in model.model.layers:
        if layer in _FUSED_OF:
            continue
        projections = _projections_of(layer)
        fused = {}
        for name, parts in _FUSED.items():
            product = fuse([projections[part] for part in parts])
            if product is not None:
                fused[name] = product
        if fused:
            _FUSED_OF[layer] = fused
            count += len(fused)
    return count


def _norms_of(layer) -> tuple:
    """A decoder layer's two RMSNorm weights: before attention, before the MLP."""
    return layer.input_layernorm.weight, layer.post_attention_layernorm.weight


def _layer_dicts(projections: List[dict], norms: List[tuple]) -> List[dict]:
    """Per layer, its projections and its two norm weights (:func:`_norms_of`) by the
    names :func:`_decode_logits` reads."""
    return [dict(layer, attention_norm=attention, mlp_norm=mlp)
            for layer, (attention, mlp) in zip(projections, norms)]


# -- the step --------------------------------------------------------------------------

class LlamaDecodeStep:
    """One decode step of a Llama-architecture model over a
    :class:`~djl_stream.generation.kv_cache.PreallocatedCache`: see the module docstring.

    ``one_row`` (a :class:`~djl_stream.generation.compiled_decode.CompiledOneRow`) runs
    the steps of one-row batches; if it ever fails, it is dropped (logged) and the eager
    step runs them. ``batch_program`` (one from
    :func:`~djl_stream.generation.compiled_decode.compile_batch`, of ``rows`` rows) runs
    the steps of batches from :func:`first_rows_of` its rows up to all of them, padded up
    to them;
    if it ever fails, it is dropped alike. ``few_rows`` (from
    :func:`~djl_stream.generation.compiled_decode.compile_few_rows`) runs the steps of 2
    rows up to its ``rows`` at their own row count, where no batch program runs them;
    dropped alike where it fails.
    """

    def __init__(self, model, *, one_row=None, batch_program=None, few_rows=None):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        self.geometry = Geometry.of(model.config)
        decoder = model.model
        self.embedding = decoder.embed_tokens.weight
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.layers = _layer_dicts([_projections_of(layer) for layer in decoder.layers],
                                   [_norms_of(layer) for layer in decoder.layers])
        self.lm_head = model.lm_head
        from djl_stream.generation.int8_linear import Int8Linear

        #: Whether the step multiplies ``w8a8``'s int8 layers (its batch program then runs
        #: from fewer rows: :func:`first_rows_of`).
        self.multiplies_int8 = any(type(m) is Int8Linear for m in self.products())
        self.one_row = one_row
        self.batch_program = batch_program
        self.few_rows = few_rows
        #: Whether the last decode step's logits came from the compiled one-row program.
        self.last_step_compiled = False
        #: Whether the last decode step's logits came from the batch program.
        self.last_step_batch_program = False
        #: Whether the last decode step's logits came from the few-rows program.
        self.last_step_few_rows = False
        #: On a CUDA GPU, a :class:`~djl_stream.generation.cuda_graphs.CudaGraphSteps` that
        #: replays decode steps from CUDA graphs (:func:`attach` with ``cuda_graphs``).
        self.graphs = None
        #: Whether the last decode step's logits came from a replayed CUDA graph.
        self.last_step_replayed = False

    @property
    def compiled(self) -> bool:
        """Whether one-row steps run the compiled program."""
        return self.one_row is not None

    def products(self) -> list:
        """Every linear layer the step multiplies by: each layer's projections (fused
        products where :func:`fuse_int8_projections` fused them), then the LM head."""
        return [value for layer in self.layers for name, value in layer.items()
                if name in _PROJECTION_NAMES] + [self.lm_head]

    def pad_rows(self, trials) -> List[str]:
        """Run the products whose weight shape ``trials`` (from
        :func:`~djl_stream.generation.row_padding.padding_trial`) pads at some row counts
        through a :class:`~djl_stream.generation.row_padding.RowPaddedLinear`, in the
        eager step and its mixed passes (the compiled programs and CUDA graphs have their
        own shapes). Returns the trials that pad, described, for the log."""
        self.layers = [{name: padded_layer(value, trials) if name in _PROJECTION_NAMES
                        else value for name, value in layer.items()} for layer in self.layers]
        self.lm_head = padded_layer(self.lm_head, trials)
        return [str(trial) for trial in trials.values() if trial.padded]

    def _inputs(self, input_ids, position_ids, attention_mask):
        """The embedded tokens, their rotary cos/sin and the padding mask of a step."""
        rows = input_ids.shape[0]
        hidden = F.embedding(input_ids.view(rows), self.embedding)
        cos, sin = self.rotary(hidden, position_ids.view(rows, 1))
        mask = self._padding_mask(attention_mask, hidden.dtype)
        return hidden, cos.unsqueeze(1), sin.unsqueeze(1), mask  # cos, sin: (rows, 1, 1, dim)

    def _padding_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``(rows, 1, 1, columns)`` of a decode step, made once a step:
        a boolean one is turned into this by every layer's attention call (four more
        operators a layer)."""
        rows, columns = attention_mask.shape
        mask = torch.zeros((rows, 1, 1, columns), dtype=dtype, device=attention_mask.device)
        return mask.masked_fill_(attention_mask.view(rows, 1, 1, columns) == 0, float("-inf"))

    def _prompt_mask(self, attention_mask: torch.Tensor, cached: int, columns: int,
                     dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``(rows, 1, columns, cached + columns)`` of a prompt chunk:
        a column sees the real columns up to itself. A padding column sees itself too
        (nothing else would be left to it, and attention over nothing is NaN, which would
        reach the cache); real columns never see it."""
        seen = cached + columns
        column = torch.arange(seen, device=attention_mask.device)
        query = cached + torch.arange(columns, device=attention_mask.device)
        causal = column.view(1, seen) <= query.view(columns, 1)
        allowed = (attention_mask[:, :seen].bool().view(-1, 1, 1, seen) & causal) | (
            column.view(1, seen) == query.view(columns, 1))
        mask = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
        return mask.masked_fill_(~allowed, float("-inf"))

    def _mixed(self, decode, prefill, columns: int, finishing: bool):
        """One forward over ``decode``'s next column and ``columns`` prompt columns of
        ``prefill``: every projection and MLP runs once over the tokens of both (the
        weights are read once), attention runs per batch over its own cache. Returns the
        logits ``(rows, vocab)`` of ``decode`` and, when ``finishing``, of ``prefill``'s
        last column (else ``None``)."""
        rows, prompts = len(decode), len(prefill)
        tokens = prompts * columns
        decode_cache, prompt_cache = decode.past_key_values, prefill.past_key_values
        cached = prefill.cache_length
        d_keys, d_values, d_start, d_column = self._decode_buffers(decode)
        p_keys, p_values, p_start, p_column = prompt_cache.next_columns_buffers(
            prompts, columns, layers=len(self.layers), like=d_keys[0])
        seen = cached + columns
        ids = torch.cat([decode.input_ids.reshape(rows),
                         prefill.input_ids[:, :columns].reshape(tokens)])
        positions = torch.cat([decode.position_ids.reshape(rows),
                               prefill.position_ids[:, :columns].reshape(tokens)])
        hidden = F.embedding(ids, self.embedding)
        cos, sin = self.rotary(hidden, positions.view(1, -1))
        cos, sin = cos[0], sin[0]  # (tokens of both, head_dim)
        d_cos, d_sin = cos[:rows].view(rows, 1, 1, -1), sin[:rows].view(rows, 1, 1, -1)
        p_cos = cos[rows:].view(prompts, 1, columns, -1)
        p_sin = sin[rows:].view(prompts, 1, columns, -1)
        d_mask = self._padding_mask(decode.attention_mask, hidden.dtype)
        p_mask = self._prompt_mask(prefill.attention_mask, cached, columns, hidden.dtype)
        d_write = torch.tensor([d_column], device=d_keys[0].device)
        g = self.geometry
        gqa = {"enable_gqa": True} if g.grouped else {}
        width = g.heads * g.head_dim

        def heads_first(t, heads):  # the chunk's tokens of t, as (prompts, heads, columns, dim)
            return t[rows:].view(prompts, columns, heads, g.head_dim).transpose(1, 2)

        for index, layer in enumerate(self.layers):
            x = _norm(hidden, layer["attention_norm"], g.eps)
            q, k, v = _qkv(layer, x, g)
            # this step's column of the running rows
            qd = _rotate(q[:rows].view(rows, g.heads, 1, g.head_dim), d_cos, d_sin)
            kd = _rotate(k[:rows].view(rows, g.kv_heads, 1, g.head_dim), d_cos, d_sin)
            d_keys[index][:rows].index_copy_(2, d_write, kd)
            d_values[index][:rows].index_copy_(2, d_write, v[:rows].view(rows, g.kv_heads, 1, -1))
            d_out = F.scaled_dot_product_attention(
                qd, d_keys[index][:rows].narrow(2, d_start, d_mask.shape[3]),
                d_values[index][:rows].narrow(2, d_start, d_mask.shape[3]),
                attn_mask=d_mask, scale=g.scaling, **gqa)
            # the prompt chunk's columns
            qp = _rotate(heads_first(q, g.heads), p_cos, p_sin)
            kp = _rotate(heads_first(k, g.kv_heads), p_cos, p_sin)
            written = slice(p_column, p_column + columns)
            p_keys[index][:prompts, :, written] = kp
            p_values[index][:prompts, :, written] = heads_first(v, g.kv_heads)
            p_out = F.scaled_dot_product_attention(
                qp, p_keys[index][:prompts].narrow(2, p_start, seen),
                p_values[index][:prompts].narrow(2, p_start, seen),
                attn_mask=p_mask, scale=g.scaling, **gqa)
            attended = torch.cat([d_out.reshape(rows, width),
                                  p_out.transpose(1, 2).reshape(tokens, width)])
            hidden = _mlp(layer, hidden + layer["o"](attended), g.eps)
        decode_cache.next_columns_written()
        prompt_cache.next_columns_written(columns)
        last = hidden[:rows]
        if finishing:
            last = torch.cat([last, hidden[rows:].view(prompts, columns, -1)[:, -1]])
        logits = self.lm_head(_norm(last, self.final_norm, self.geometry.eps))
        return logits[:rows], (logits[rows:] if finishing else None)

    def mixed_logits(self, decode, prefill, columns: int):
        """Run ``decode``'s decode step and feed ``columns`` prompt columns of ``prefill``
        (a batch part-way through, or at the start of, its prefill) in one pass; see
        :meth:`_mixed`. Both caches gain their columns. Returns the logits of ``decode``'s
        rows and, when those were ``prefill``'s last prompt columns, of its rows' first
        tokens (else ``None``)."""
        if not (self.accepts(decode) and isinstance(prefill.past_key_values, PreallocatedCache)
                and 0 < columns <= prefill.columns_to_feed):
            raise ValueError("a mixed pass takes a batch at a decode step and 1 to "
                             f"{prefill.columns_to_feed} prompt columns, not {columns}")
        with torch.inference_mode():
            return self._mixed(decode, prefill, columns,
                               finishing=columns == prefill.columns_to_feed)

    def accepts(self, batch) -> bool:
        """Whether ``batch`` is at a decode step this step can run (prefilled, one column
        to feed, its cache a ``PreallocatedCache``)."""
        return (isinstance(batch.past_key_values, PreallocatedCache)
                and batch.columns_to_feed == 1 and batch.prefilled)

    def logits(self, batch) -> torch.Tensor:
        """Run ``batch``'s decode step: its cache gains the column, and the logits
        ``(rows, vocab)`` of the next token come back."""
        keys, values, start, column = self._decode_buffers(batch)
        with torch.inference_mode():
            logits = None
            if self.graphs is not None:
                logits = self._replayed_logits(batch, keys, values, start, column)
            self.last_step_replayed = logits is not None
            self.last_step_compiled = False
            self.last_step_batch_program = False
            self.last_step_few_rows = False
            if logits is None:
                inputs = self._inputs(batch.input_ids, batch.position_ids, batch.attention_mask)
                if self.one_row is not None and len(batch) == 1:
                    logits = self._one_row_logits(inputs, keys, values, column, start)
                self.last_step_compiled = logits is not None
                if logits is None and self._runs_batch_program(len(batch), keys):
                    logits = self._batch_program_logits(inputs, keys, values, column, start)
                    self.last_step_batch_program = logits is not None
                if logits is None and self._runs_few_rows(len(batch)):
                    logits = self._few_rows_logits(inputs, keys, values, column, start)
                    self.last_step_few_rows = logits is not None
            if logits is None:
                logits = _decode_logits(self.geometry, self.layers, self.final_norm, self.lm_head,
                                        *inputs, keys, values,
                                        torch.tensor([column], device=keys[0].device), start)
        batch.past_key_values.next_columns_written()
        return logits

    def _replayed_logits(self, batch, keys, values, start: int, column: int):
        """The logits of a step replayed from a CUDA graph, or ``None`` where none was
        (not captured yet) or capturing or replaying failed (the graphs are dropped then:
        the eager step writes the same column again)."""
        return self._unless_it_fails(
            "graphs", "replaying the decode step from a CUDA graph failed",
            "decode steps run eagerly from now on",
            lambda: self.graphs.logits(batch.input_ids, batch.position_ids,
                                       batch.attention_mask, keys, values, start, column))

    def _one_row_logits(self, inputs, keys, values, column: int, start: int):
        """The compiled program's logits of a one-row step, or ``None`` where it failed (it
        is dropped then: the eager step writes the same column again)."""
        return self._unless_it_fails(
            "one_row", "the compiled one-row decode step failed",
            "one-row steps run the eager step from now on",
            lambda: self.one_row.run(*_one_row_arguments(inputs, keys, values, column, start)))

    def _runs_batch_program(self, rows: int, keys) -> bool:
        """Whether a step of ``rows`` rows over the buffers ``keys`` runs the batch
        program: from :func:`first_rows_of` its rows (a step of fewer costs the eager step
        less than the program's of all of them), at most all, and buffers with a row for
        each."""
        program = self.batch_program
        return (program is not None and self.batch_program_from() <= rows <= program.rows
                and keys[0].shape[0] >= program.rows)

    def _runs_few_rows(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs the few-rows program (2 rows up to its
        ``rows``)."""
        return self.few_rows is not None and 2 <= rows <= self.few_rows.rows

    def _few_rows_logits(self, inputs, keys, values, column: int, start: int):
        """The few-rows program's logits of a step of ``inputs``' rows (each buffer's first
        that many rows: the batch's), or ``None`` where it failed (it is dropped then: the
        eager step writes the same column again)."""
        rows = inputs[0].shape[0]
        return self._unless_it_fails(
            "few_rows", "the compiled few-rows decode step failed",
            "steps of a few rows run the eager step from now on",
            lambda: self.few_rows.run(*inputs, [k[:rows] for k in keys],
                                      [v[:rows] for v in values], torch.tensor([column]),
                                      start))

    def batch_program_from(self) -> int:
        """The fewest rows the batch program runs (:func:`first_rows_of`); 0 without one."""
        program = self.batch_program
        return 0 if program is None else first_rows_of(program.rows, self.multiplies_int8)

    def _batch_program_logits(self, inputs, keys, values, column: int, start: int):
        """The batch program's logits of a step of ``inputs``' rows, padded up to its
        rows (zeros, which its padding rows read: their columns are left as they were),
        or ``None`` where it failed (it is dropped then: the eager step writes the same
        column again)."""
        size, rows = self.batch_program.rows, inputs[0].shape[0]
        real = torch.arange(size, device=inputs[0].device).view(size, 1, 1, 1) < rows
        logits = self._unless_it_fails(
            "batch_program", "the compiled batch decode step failed",
            "batch steps run the eager step from now on",
            lambda: self.batch_program.run(
                *(with_zero_rows(tensor, size) for tensor in inputs), [k[:size] for k in keys],
                [v[:size] for v in values], torch.tensor([column]), start, real))
        return None if logits is None else logits[:rows]

    def _unless_it_fails(self, attribute: str, failed: str, instead: str, run):
        """``run()``, or ``None`` where it raised: the way it ran (``attribute``) is then
        dropped, logged as ``failed`` and what runs ``instead``."""
        try:
            return run()
        except Exception as error:  # noqa: BLE001 - the eager step serves instead
            logger.warning("%s (%s: %s); %s", failed, type(error).__name__,
                           str(error).splitlines()[0] if str(error) else "", instead)
            setattr(self, attribute, None)
            return None

    @staticmethod
    def _decode_buffers(batch):
        """``batch``'s cache buffers with room for its decode step's column
        (:meth:`PreallocatedCache.next_columns_buffers`), its mask checked against them."""
        keys, values, start, column = batch.past_key_values.next_columns_buffers(len(batch))
        if batch.attention_mask.shape[1] != column + 1 - start:
            raise ValueError(f"a mask of {batch.attention_mask.shape[1]} columns for a cache "
                             f"of {column - start} and the new one")
        return keys, values, start, column


def step_of(model) -> Optional[LlamaDecodeStep]:
    """The step :func:`attach` gave ``model``, or ``None``."""
    return getattr(model, _ATTRIBUTE, None)


def replays_graphs(model) -> bool:
    """Whether ``model``'s decode steps are replayed from CUDA graphs."""
    step = step_of(model)
    return step is not None and step.graphs is not None


def last_step_ran_apart(model) -> bool:
    """Whether ``model``'s last decode step ran a way that a pass reading a prompt beside
    the running batch (a mixed pass, always eager) cannot come near: a replayed CUDA graph
    (SmolLM2's shapes: 3.3 ms on an H200 against 18 ms for the eager step). Such a step's
    time says little of what a mixed pass costs, so the prefill pacer leaves it out
    (:meth:`~djl_stream.generation.prefill_pacing.PrefillPacer.decode_step`).

    The CPU's compiled programs are counted: their steps are what the running streams
    wait between tokens, and the eager step a mixed pass runs is not far off (SmolLM2 on
    the 2-core Xeon: 23-25 ms a one-row step against 28). Left out, as they were until
    the programs became the default, one stream decoding alone left the pacer with no
    step, so no bound: a 4,000-token prompt arriving beside it was read in mixed passes of
    110-137 ms, 4.4-5.5 of the stream's 25 ms steps, against the reliability target of 4
    (RELIABILITY.md). Prompts arriving together (a burst) are read with the idle budget
    either way."""
    step = step_of(model)
    return step is not None and step.last_step_replayed


def attach(model, tokenizer, *, one_row=None, batch_program=None, few_rows=None,
           cuda_graphs: bool = False) -> Optional[LlamaDecodeStep]:
    """Build ``model``'s :class:`LlamaDecodeStep` (on a CPU, with its products of 10 to 15
    rows padded to 16 where a trial finds that faster: :func:`_pad_rows`), check it
    against the model's forward on probe batches of 1 and 3 rows and on a mixed pass, and
    attach it, so that
    :func:`~djl_stream.generation.batch.generate_token` uses it for decode steps.

    With ``one_row`` (a :class:`~djl_stream.generation.compiled_decode.CompiledOneRow`,
    compiled before the model's layers were packed), one-row steps run it once it agrees
    with the forward on the one-row probe; where it does not, the eager step runs them
    (logged). With ``batch_program`` (from
    :func:`~djl_stream.generation.compiled_decode.compile_batch`), batches from
    :func:`first_rows_of` its rows run it once it agrees with the forward on a probe of
    that many rows;
    where it does not, they run the eager step (logged). With ``few_rows`` (from
    :func:`~djl_stream.generation.compiled_decode.compile_few_rows`), the steps of 2 rows
    up to its ``rows`` that no batch program runs run it once it agrees with the forward
    on probes of 2 and 3 rows (else the eager step, logged). With ``cuda_graphs`` (a model on
    one CUDA GPU), decode steps are replayed
    from CUDA graphs (:mod:`~djl_stream.generation.cuda_graphs`) once those agree with the
    forward on the probes of 1 and 3 rows; where they do not, the eager step runs (logged).

    Returns the step, or ``None`` (logged) where the model is not supported or the step's
    logits differ from the forward's.
    """
    reason = unsupported_reason(model)
    if reason:
        logger.info("decode steps run the model's forward: %s", reason)
        return None
    try:
        step = LlamaDecodeStep(model)
        if step.embedding.device.type == "cpu":
            _pad_rows(step)
        # the eager step first, one row included: it takes over one-row steps wherever
        # the program fails
        if not all(_agrees(step, model, tokenizer, rows) for rows in (1, 3)):
            logger.warning("the Llama decode step differs from the model's forward on a "
                           "probe; decode steps run the model's forward")
            return None
        if not _mixed_agrees(step, model, tokenizer):
            logger.warning("the Llama decode step's mixed pass differs from the model's "
                           "forward on a probe; decode steps run the model's forward")
            return None
        if one_row is not None:
            step.one_row = _checked_one_row(step, model, tokenizer, one_row)
        if batch_program is not None:
            step.batch_program = _checked_batch_program(step, model, tokenizer, batch_program)
        if few_rows is not None:
            step.few_rows = _checked_few_rows(step, model, tokenizer, few_rows)
        if cuda_graphs:
            step.graphs = _checked_graphs(step, model, tokenizer)
    except Exception as error:  # noqa: BLE001 - serving goes on without the step
        logger.warning("building the Llama decode step failed (%s: %s); decode steps run the "
                       "model's forward", type(error).__name__,
                       str(error).splitlines()[0] if str(error) else "")
        return None
    install(model, step)
    if step.graphs is not None:
        logger.info("decode steps are replayed from CUDA graphs (batches padded to %s rows); "
                    "mixed passes run djl-stream's Llama decode step",
                    ", ".join(map(str, ROW_BUCKETS)))
    elif step.compiled or step.batch_program is not None or step.few_rows is not None:
        ran = (["one-row"] if step.compiled else []) + (
            [f"2- to {step.few_rows.rows}-row"] if step.few_rows is not None else []) + (
            [f"{step.batch_program_from()}- to {step.batch_program.rows}-row"]
            if step.batch_program is not None else [])
        logger.info("%s decode steps run the compiled program%s; other steps run "
                    "djl-stream's Llama decode step",
                    " and ".join([", ".join(ran[:-1]), ran[-1]] if len(ran) > 1 else ran),
                    "s" if len(ran) > 1 else "")
    else:
        logger.info("decode steps run djl-stream's Llama decode step%s",
                    " (no compiled one-row step)" if one_row is not None else "")
    return step


def _pad_rows(step: LlamaDecodeStep) -> None:
    """Pad the rows of ``step``'s products where this CPU's GEMM is faster at 16 rows
    (:mod:`~djl_stream.generation.row_padding`, logged)."""
    try:
        trials = padding_trial(step.products(), step.embedding.dtype)
    except Exception as error:  # noqa: BLE001 - an optimization: the step runs without it
        logger.warning("timing the decode step's products failed (%s: %s); no product is "
                       "padded", type(error).__name__, str(error).splitlines()[0] if str(error)
                       else "")
        return
    described = step.pad_rows(trials)
    if described:
        logger.info("decode-step products of a few rows run padded to %d rows where this CPU "
                    "multiplies 16 faster: %s", PADDED_ROWS, "; ".join(described))


def _checked_one_row(step: LlamaDecodeStep, model, tokenizer, one_row):
    """``one_row`` if its logits on a one-row probe agree with the model's forward, else
    ``None`` (logged): the eager step then runs one-row steps too."""
    step.one_row = one_row
    try:
        if _agrees(step, model, tokenizer, 1) and step.last_step_compiled:
            return one_row
        logger.warning("the compiled one-row decode step differs from the model's forward on "
                       "a probe; one-row steps run the eager step")
        return None
    finally:
        step.one_row = None


def _checked_batch_program(step: LlamaDecodeStep, model, tokenizer, program):
    """``program`` if its logits on a probe of the fewest rows it runs (padded up to its
    rows: :func:`first_rows_of`) agree with the model's forward, else ``None`` (logged)."""
    step.batch_program = program
    try:
        rows = step.batch_program_from()
        if (_agrees(step, model, tokenizer, rows, room_for_rows=program.rows - rows)
                and step.last_step_batch_program):
            return program
        logger.warning("the compiled %d-row decode step differs from the model's forward on "
                       "a probe; batch steps run the eager step", program.rows)
        return None
    finally:
        step.batch_program = None


def _checked_few_rows(step: LlamaDecodeStep, model, tokenizer, program):
    """``program`` if its logits on probes of 2 and 3 rows agree with the model's
    forward, else ``None`` (logged)."""
    step.few_rows = program
    try:
        for rows in (2, 3):
            if not (_agrees(step, model, tokenizer, rows) and step.last_step_few_rows):
                logger.warning("the compiled few-rows decode step differs from the model's "
                               "forward on a probe of %d rows; those steps run the eager "
                               "step", rows)
                return None
        return program
    finally:
        step.few_rows = None


def _checked_graphs(step: LlamaDecodeStep, model, tokenizer):
    """A :class:`~djl_stream.generation.cuda_graphs.CudaGraphSteps` for ``step`` if its
    replays agree with the model's forward on the probes of 1 and 3 rows, else ``None``
    (logged)."""
    reason = cuda_graphs_unavailable(model)
    if reason:
        logger.info("decode steps are not replayed from CUDA graphs: %s", reason)
        return None
    # each probe runs one step: captured at once, not at the step serving would
    step.graphs = graphs = CudaGraphSteps(step, capture_after=1)
    try:
        for rows in (1, 3):
            if not (_agrees(step, model, tokenizer, rows) and step.last_step_replayed):
                logger.warning("the decode step replayed from a CUDA graph differs from the "
                               "model's forward on a probe of %d rows; decode steps run eagerly",
                               rows)
                return None
        graphs.capture_after = CAPTURE_AFTER
        return graphs
    finally:
        step.graphs = None


def install(model, step: LlamaDecodeStep) -> None:
    """Have ``model``'s decode steps run ``step`` (:func:`attach` checks one first)."""
    setattr(model, _ATTRIBUTE, step)


def detach(model) -> None:
    """Decode steps of ``model`` run its forward again."""
    if hasattr(model, _ATTRIBUTE):
        delattr(model, _ATTRIBUTE)


def _probe_prompts(model, tokenizer, rows: int, room_for_rows: int = 0):
    """A batch of ``rows`` prompts of different lengths (so that some are padded), before
    its prefill; its cache has ``room_for_rows`` more rows."""
    from djl_stream.generation.batch import CausalLMBatch
    from djl_stream.generation.sequence import GenerationSequence

    vocab = model.config.vocab_size
    sequences = [GenerationSequence(("probe", row), [(7 * i + row) % vocab for i in range(3 + 4 * row)],
                                    tokenizer, max_new_tokens=4, eos_token_ids=frozenset(),
                                    ignore_eos=True)
                 for row in range(rows)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return CausalLMBatch.from_sequences(sequences, pad_token_id=pad, device=model.device,
                                        room_for_rows=room_for_rows)


def _probe_batch(model, tokenizer, rows: int, room_for_rows: int = 0):
    """:func:`_probe_prompts` past its prefill (the model's forward), at its first decode
    step."""
    from djl_stream.generation.batch import generate_token

    _, batch = generate_token(model, _probe_prompts(model, tokenizer, rows, room_for_rows))
    return batch


def _one_row_arguments(inputs: tuple, keys, values, column: int, start: int) -> tuple:
    """:meth:`~djl_stream.generation.compiled_decode.CompiledOneRow.run`'s arguments for a
    one-row step: ``inputs`` from
    :meth:`LlamaDecodeStep._inputs`, then each buffer's first row only, so that the graph
    sees one row capacity (1) whatever the cache holds (another would need another
    graph)."""
    return (*inputs, [k[:1] for k in keys], [v[:1] for v in values], torch.tensor([column]),
            start)


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    tolerance = TOLERANCE.get(theirs.dtype, TOLERANCE[torch.float32])
    ours, theirs = ours.float(), theirs.float()
    scale = float(theirs.abs().max()) or 1.0
    return bool(torch.isfinite(ours).all()) and float((ours - theirs).abs().max()) <= tolerance * scale


def _agrees(step: LlamaDecodeStep, model, tokenizer, rows: int, room_for_rows: int = 0) -> bool:
    from djl_stream.generation.batch import forward_logits

    ours = step.logits(_probe_batch(model, tokenizer, rows, room_for_rows))
    return _close(ours, forward_logits(model, _probe_batch(model, tokenizer, rows)))


def _mixed_agrees(step: LlamaDecodeStep, model, tokenizer) -> bool:
    """A mixed pass of a 3-row probe at its decode step with the whole prompts of a
    2-row one (of different lengths: one is padded) against the forward on each."""
    from djl_stream.generation.batch import forward_logits

    prompts = _probe_prompts(model, tokenizer, 2)
    decode_logits, first_logits = step.mixed_logits(_probe_batch(model, tokenizer, 3), prompts,
                                                    prompts.columns_to_feed)
    return (_close(decode_logits, forward_logits(model, _probe_batch(model, tokenizer, 3)))
            and _close(first_logits, forward_logits(model, _probe_prompts(model, tokenizer, 2))))
