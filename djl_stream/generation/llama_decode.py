"""A decode step of Llama-architecture models written for this project's KV cache, run in
place of the model's forward (and optionally compiled by ``torch.compile``).

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
its forward. On a GPU the model's forward runs, as before: this step has not run on one.

``compile=True`` (``option.decode_step=compiled``) hands the step to ``torch.compile``
(dynamic shapes, one graph, ``cpp_wrapper``), with the oneDNN-packed weights behind a
custom operator (``djl_stream::packed_linear``: an opaque packed tensor cannot enter a
graph). Measured: 32.0 ms with one row, 30.3 with four, 50.9 with sixteen, for 152 s of
compiling at load (one row and several are two graphs): an option, not the default.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
    ...                                      num_hidden_layers=1, num_attention_heads=2))
    >>> unsupported_reason(model) is None
    True
    >>> step = LlamaDecodeStep(model, compile=False)
"""

from __future__ import annotations

import logging
import os
import time
from typing import List, Optional

import torch
import torch.nn.functional as F

from djl_stream.generation.kv_cache import PreallocatedCache

logger = logging.getLogger(__name__)

#: The attribute under which :func:`attach` keeps a model's step.
_ATTRIBUTE = "_djl_stream_decode_step"
#: How far the step's logits may be from the model's forward on the probes of
#: :func:`attach`, relative to the largest logit, by the model's dtype (another summation
#: order: ~1e-6 seen in float32; in bfloat16 every layer's output is rounded to 8 bits of
#: mantissa, and 30 layers of it part by about 1e-2).
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 5e-2}


# -- packed weights behind an operator a compiled graph can call ----------------------

#: (packed weight, bias or None, out features) by handle; compiled steps only (they live
#: as long as the process, as the model they serve does)
_PACKED: List[tuple] = []


@torch.library.custom_op("djl_stream::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    weight, bias, _ = _PACKED[handle]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_packed_linear.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _PACKED[handle][2])


def _linear(module: torch.nn.Module, compile: bool):
    """A function ``x (rows, in) -> (rows, out)`` doing what ``module`` does (the module
    itself, run eagerly), in a form a graph can hold when ``compile``."""
    from djl_stream.generation.int8_linear import Int8Linear
    from djl_stream.generation.packed_linear import PackedLinear

    if not compile or isinstance(module, Int8Linear):  # plain tensors and operators: traceable
        return module
    if isinstance(module, PackedLinear):
        _PACKED.append((module.weight, module.bias, module.out_features))
        handle = len(_PACKED) - 1
        return lambda x: _packed_linear(x, handle)
    if type(module) is torch.nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda x: F.linear(x, weight, bias)
    raise TypeError(f"no graph form for {type(module).__name__}")


# -- which models ----------------------------------------------------------------------

def unsupported_reason(model) -> Optional[str]:
    """Why :class:`LlamaDecodeStep` cannot run ``model``'s decode steps, or ``None`` if it can.

    >>> unsupported_reason(torch.nn.Linear(2, 2))
    'not a Llama-architecture causal LM (Linear)'
    """
    from djl_stream.generation.int8_linear import Int8Linear
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
               for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                         layer.mlp.down_proj)] + [model.lm_head]
    odd = [type(m).__name__ for m in linears
           if type(m) not in (torch.nn.Linear, PackedLinear, Int8Linear)]
    if odd:
        return f"linear layers of type {odd[0]}"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "not on a CPU (this step has been measured on CPUs only)"
    return None


# -- the step --------------------------------------------------------------------------

class LlamaDecodeStep:
    """One decode step of a Llama-architecture model over a
    :class:`~djl_stream.generation.kv_cache.PreallocatedCache`: see the module docstring.

    ``compile=True`` hands the step to ``torch.compile`` (see the module docstring).
    """

    def __init__(self, model, *, compile: bool = False):
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(reason)
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = (getattr(config, "head_dim", None)
                         or config.hidden_size // config.num_attention_heads)
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim ** -0.5
        # a plain bool: computed in the graph from the int attributes, it would be symbolic
        self.grouped = bool(self.kv_heads != self.heads)
        decoder = model.model
        self.embedding = decoder.embed_tokens.weight
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.layers = [dict(q=_linear(layer.self_attn.q_proj, compile),
                            k=_linear(layer.self_attn.k_proj, compile),
                            v=_linear(layer.self_attn.v_proj, compile),
                            o=_linear(layer.self_attn.o_proj, compile),
                            gate=_linear(layer.mlp.gate_proj, compile),
                            up=_linear(layer.mlp.up_proj, compile),
                            down=_linear(layer.mlp.down_proj, compile),
                            attention_norm=layer.input_layernorm.weight,
                            mlp_norm=layer.post_attention_layernorm.weight)
                       for layer in decoder.layers]
        self.lm_head = _linear(model.lm_head, compile)
        self.compiled = compile
        # fullgraph: a graph break would leave parts to eager Python silently (slower than
        # the model's own forward); it fails here instead, and attach() says why
        self._step = (torch.compile(self._logits, dynamic=True, fullgraph=True,
                                    options={"cpp_wrapper": True}) if compile else self._logits)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as LlamaRMSNorm: in float32, then back to the weight's dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(weight.dtype)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, keys: List[torch.Tensor],
                values: List[torch.Tensor], column: torch.Tensor, start: int) -> torch.Tensor:
        """Logits ``(rows, vocab)`` of one step. ``keys[i]``/``values[i]`` are layer
        ``i``'s whole cache buffers ``(row capacity, kv heads, column capacity,
        head_dim)``; the step writes buffer column ``column`` (a 0-d index tensor) of the
        first ``rows`` rows and attends over the ``attention_mask.shape[1]`` columns from
        ``start``, which ``attention_mask`` ``(rows, columns)`` says each row sees.

        The buffers themselves are the graph's inputs, not views of them: a mutated view
        of an input would be copied back whole after every step."""
        rows = input_ids.shape[0]
        hidden = F.embedding(input_ids.view(rows), self.embedding)
        cos, sin = self.rotary(hidden, position_ids.view(rows, 1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (rows, 1, 1, head_dim)
        columns = attention_mask.shape[1]
        mask = self._padding_mask(attention_mask, hidden.dtype)
        for layer, layer_keys, layer_values in zip(self.layers, keys, values):
            x = self._norm(hidden, layer["attention_norm"])
            q = layer["q"](x).view(rows, self.heads, 1, self.head_dim)
            k = layer["k"](x).view(rows, self.kv_heads, 1, self.head_dim)
            v = layer["v"](x).view(rows, self.kv_heads, 1, self.head_dim)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            layer_keys[:rows].index_copy_(2, column, k)
            layer_values[:rows].index_copy_(2, column, v)
            # (enable_gqa only where heads are grouped: PyTorch < 2.5 has no such argument,
            # and a model without grouped heads runs there too)
            attended = F.scaled_dot_product_attention(
                q, layer_keys[:rows].narrow(2, start, columns),
                layer_values[:rows].narrow(2, start, columns), attn_mask=mask, scale=self.scaling,
                **({"enable_gqa": True} if self.grouped else {}))
            hidden = hidden + layer["o"](attended.reshape(rows, self.heads * self.head_dim))
            hidden = self._mlp(layer, hidden)
        return self.lm_head(self._norm(hidden, self.final_norm))

    def _padding_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``(rows, 1, 1, columns)`` of a decode step, made once a step:
        a boolean one is turned into this by every layer's attention call (four more
        operators a layer)."""
        rows, columns = attention_mask.shape
        mask = torch.zeros((rows, 1, 1, columns), dtype=dtype, device=attention_mask.device)
        return mask.masked_fill_(attention_mask.view(rows, 1, 1, columns) == 0, float("-inf"))

    def _mlp(self, layer: dict, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` after layer ``layer``'s gated MLP (with its norm and residual)."""
        x = self._norm(hidden, layer["mlp_norm"])
        return hidden + layer["down"](F.silu(layer["gate"](x)) * layer["up"](x))

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
        d_write = torch.tensor([d_column])
        gqa = {"enable_gqa": True} if self.grouped else {}
        width = self.heads * self.head_dim

        def heads_first(t, heads):  # the chunk's tokens of t, as (prompts, heads, columns, dim)
            return t[rows:].view(prompts, columns, heads, self.head_dim).transpose(1, 2)

        for index, layer in enumerate(self.layers):
            x = self._norm(hidden, layer["attention_norm"])
            q, k, v = layer["q"](x), layer["k"](x), layer["v"](x)
            # this step's column of the running rows
            qd = self._rotate(q[:rows].view(rows, self.heads, 1, self.head_dim), d_cos, d_sin)
            kd = self._rotate(k[:rows].view(rows, self.kv_heads, 1, self.head_dim), d_cos, d_sin)
            d_keys[index][:rows].index_copy_(2, d_write, kd)
            d_values[index][:rows].index_copy_(2, d_write, v[:rows].view(rows, self.kv_heads, 1, -1))
            d_out = F.scaled_dot_product_attention(
                qd, d_keys[index][:rows].narrow(2, d_start, d_mask.shape[3]),
                d_values[index][:rows].narrow(2, d_start, d_mask.shape[3]),
                attn_mask=d_mask, scale=self.scaling, **gqa)
            # the prompt chunk's columns
            qp = self._rotate(heads_first(q, self.heads), p_cos, p_sin)
            kp = self._rotate(heads_first(k, self.kv_heads), p_cos, p_sin)
            written = slice(p_column, p_column + columns)
            p_keys[index][:prompts, :, written] = kp
            p_values[index][:prompts, :, written] = heads_first(v, self.kv_heads)
            p_out = F.scaled_dot_product_attention(
                qp, p_keys[index][:prompts].narrow(2, p_start, seen),
                p_values[index][:prompts].narrow(2, p_start, seen),
                attn_mask=p_mask, scale=self.scaling, **gqa)
            attended = torch.cat([d_out.reshape(rows, width),
                                  p_out.transpose(1, 2).reshape(tokens, width)])
            hidden = self._mlp(layer, hidden + layer["o"](attended))
        decode_cache.next_columns_written()
        prompt_cache.next_columns_written(columns)
        last = hidden[:rows]
        if finishing:
            last = torch.cat([last, hidden[rows:].view(prompts, columns, -1)[:, -1]])
        logits = self.lm_head(self._norm(last, self.final_norm))
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
            logits = self._step(batch.input_ids, batch.position_ids, batch.attention_mask,
                                keys, values, torch.tensor([column]), start)
        batch.past_key_values.next_columns_written()
        return logits

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


def attach(model, tokenizer, *, compile: bool = False) -> Optional[LlamaDecodeStep]:
    """Build ``model``'s :class:`LlamaDecodeStep` (and compile it, for one row and for
    several, with ``compile``), check it against the model's forward on probe batches of
    1 and 3 rows, and attach it, so that :func:`~djl_stream.generation.batch.generate_token`
    uses it for decode steps.

    Returns the step, or ``None`` (logged) where the model is not supported, compiling
    failed, or the step's logits differ from the forward's.
    """
    reason = unsupported_reason(model)
    if reason:
        logger.info("decode steps run the model's forward: %s", reason)
        return None
    started = time.perf_counter()
    try:
        step = LlamaDecodeStep(model, compile=compile)
        for rows in (1, 3):
            if not _agrees(step, model, tokenizer, rows):
                logger.warning("the Llama decode step differs from the model's forward on "
                               "a probe of %d rows; decode steps run the model's forward", rows)
                return None
        if not _mixed_agrees(step, model, tokenizer):
            logger.warning("the Llama decode step's mixed pass differs from the model's "
                           "forward on a probe; decode steps run the model's forward")
            return None
    except Exception as error:  # noqa: BLE001 - serving goes on without the step
        logger.warning("%s the Llama decode step failed (%s: %s); decode steps run the "
                       "model's forward", "compiling" if compile else "building",
                       type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return None
    install(model, step)
    if compile:
        logger.info("decode step compiled in %.0f s (Inductor's cache: %s)",
                    time.perf_counter() - started,
                    os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default"))
    else:
        logger.info("decode steps run djl-stream's Llama decode step")
    return step


def install(model, step: LlamaDecodeStep) -> None:
    """Have ``model``'s decode steps run ``step`` (:func:`attach` checks one first)."""
    setattr(model, _ATTRIBUTE, step)


def detach(model) -> None:
    """Decode steps of ``model`` run its forward again."""
    if hasattr(model, _ATTRIBUTE):
        delattr(model, _ATTRIBUTE)


def _probe_prompts(model, tokenizer, rows: int):
    """A batch of ``rows`` prompts of different lengths (so that some are padded), before
    its prefill."""
    from djl_stream.generation.batch import CausalLMBatch
    from djl_stream.generation.sequence import GenerationSequence

    vocab = model.config.vocab_size
    sequences = [GenerationSequence(("probe", row), [(7 * i + row) % vocab for i in range(3 + 4 * row)],
                                    tokenizer, max_new_tokens=4, eos_token_ids=frozenset(),
                                    ignore_eos=True)
                 for row in range(rows)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return CausalLMBatch.from_sequences(sequences, pad_token_id=pad, device=model.device)


def _probe_batch(model, tokenizer, rows: int):
    """:func:`_probe_prompts` past its prefill (the model's forward), at its first decode
    step."""
    from djl_stream.generation.batch import generate_token

    _, batch = generate_token(model, _probe_prompts(model, tokenizer, rows))
    return batch


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    tolerance = TOLERANCE.get(theirs.dtype, TOLERANCE[torch.float32])
    ours, theirs = ours.float(), theirs.float()
    scale = float(theirs.abs().max()) or 1.0
    return bool(torch.isfinite(ours).all()) and float((ours - theirs).abs().max()) <= tolerance * scale


def _agrees(step: LlamaDecodeStep, model, tokenizer, rows: int) -> bool:
    from djl_stream.generation.batch import forward_logits

    ours = step.logits(_probe_batch(model, tokenizer, rows))
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
